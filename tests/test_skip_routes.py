"""Skip declarations are checked before anything runs."""

from __future__ import annotations

import ast

import pytest

from fpipe.stages.skip import SkipError, skip_routes, skippable


def plain(p, x):
    return x


def test_routes_of_a_unet():
    stages = [skippable(plain, stash=["a"]), skippable(plain, stash=["b"]), plain,
              skippable(plain, pop=["b"]), skippable(plain, pop=["a"], stash=["c"]),
              skippable(plain, pop=["c"])]
    assert skip_routes(stages) == {"a": (0, 4), "b": (1, 3), "c": (4, 5)}
    assert skip_routes([plain, plain]) == {}


@pytest.mark.parametrize("stages, message", [
    ([skippable(plain, pop=["a"]), skippable(plain, stash=["a"])],
     "'a' is popped by stage 0 before it is stashed: it is stashed only later, by stage 1"),
    ([plain, skippable(plain, pop=["a"])], "no stage stashes it"),
    ([skippable(plain, stash=["a"]), plain], "'a' is stashed by stage 0 but no later stage pops"),
    ([skippable(plain, stash=["a"]), skippable(plain, stash=["a"]), skippable(plain, pop=["a"])],
     "stashed by stage 0 and again by stage 1"),
    ([skippable(plain, stash=["a"]), skippable(plain, pop=["a"]), skippable(plain, pop=["a"])],
     "popped by stage 1 and again by stage 2"),
])
def test_bad_routes_are_named(stages, message):
    with pytest.raises(SkipError, match=message):
        skip_routes(stages)


def test_bad_declarations():
    with pytest.raises(SkipError, match="cannot stash and pop the same skip"):
        skippable(plain, stash=["a"], pop=["a"])
    with pytest.raises(TypeError, match="not the string 'ab'"):
        skippable(plain, stash="ab")
    with pytest.raises(SkipError, match="names a skip twice"):
        skippable(plain, pop=["a", "a"])

    @skippable(stash=["z", "y"])
    def decorated(p, x):
        return x, {}
    assert decorated.stash == ("y", "z") and decorated.pop == ()


def test_the_engine_takes_skips_as_data():
    """The faces read the declarations once (``declared``); the engine gets a plain value and
    never imports the declaring layer, so another way of declaring skips needs only a Skips."""
    import pathlib

    import fpipe._runtime
    from fpipe._runtime.skips import Skips
    from fpipe.stages.skip import declared

    stages = [skippable(plain, stash=["b", "a"]), plain, skippable(plain, pop=["a"]),
              skippable(plain, pop=["b"])]
    skips = Skips(*declared(stages))
    assert skips == Skips(pops=((), (), ("a",), ("b",)), stashes=(("a", "b"), (), (), ()),
                          routes={"a": (0, 2), "b": (0, 3)})
    assert Skips(*declared([plain, plain])) == Skips.none(2)
    with pytest.raises(TypeError):
        skips.routes["c"] = (1, 2)  # frozen: the engine cannot change a route

    package = pathlib.Path(fpipe._runtime.__file__).parent.parent
    assert _imports_of(package / "_runtime", "fpipe.stages") == []
    # ... nor the declaring layer the engine: the faces hand one to the other.
    assert _imports_of(package / "stages", "fpipe._runtime") == []


def _imports_of(root, prefix: str) -> list[str]:
    """``"file: module"`` for each import under ``root`` of a module starting with ``prefix``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.startswith(prefix)]
    return found
