"""README.md tells the truth: its example runs, and .ci/run runs its set-up commands as they
are, then every extra with every test that needs one."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commands(text):
    """The command lines of a shell text, without comments and blank lines."""
    lines = (re.sub(r"(^|\s)#.*", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line]


def setup_commands():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"\n## Set-up\n(.*?)\n## ", readme, re.S).group(1)
    return commands(re.search(r"```bash\n(.*?)```", section, re.S).group(1))


def extras():
    """pyproject.toml's extras: {name: [the module each requirement installs]}."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(r"\[project\.optional-dependencies\]\n(.*?)\n\[", text, re.S).group(1)
    return {name: [re.split(r"[<>=!~\[; ]", req)[0].lower().replace("-", "_")
                   for req in re.findall(r'"([^"]+)"', reqs)]
            for name, reqs in re.findall(r"^(\w+) = \[(.*?)\]", table, re.M)}


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


#: The suite, as README.md, docs/install.md and .ci/run run it: two tests at a time
#: (pytest-xdist, of the [test] extra), each in its own process.
TESTS = "python -m pytest -q -n 2"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = (ROOT / "docs" / "install.md").read_text()
    assert f"&& {TESTS}\n" in install
    assert f"{TESTS} " in readme
    assert TESTS in ci
    assert "pytest_xdist" in extras()["test"]


def test_ci_runs_the_readme_setup_in_a_fresh_venv():
    setup, ci = setup_commands(), commands((ROOT / ".ci" / "run").read_text())
    assert setup[0] == "pip install torch==2.13.0"  # torch first, as README says
    assert setup[-1].endswith(f"&& {TESTS}")
    # README's lines, together and in order, first thing in a new venv: nothing installed before.
    start = ci.index(setup[0])
    assert ci[start:start + len(setup)] == setup
    assert any(line.startswith("python3 -m venv ") for line in ci[:start])
    assert any(line.startswith("source ") and "/bin/activate" in line for line in ci[:start])
    assert not any(re.search(r"\bpip\b|PYTHONPATH", line) for line in ci[:start])
    # Then every extra, and the tests that need one.
    rest = ci[start + len(setup):]
    installed = next(line for line in rest if line.startswith("pip install"))
    assert set(re.search(r"\.\[([\w,]+)\]", installed).group(1).split(",")) == set(extras())
    assert rest[-1] == f"{TESTS} -m needs_extra"
    # And the documentation site, with warnings as errors.
    assert any(line.startswith("mkdocs build --strict") for line in rest)


def test_tests_that_need_an_extra_are_marked():
    """A test that skips without an extra's package (``importorskip``, a ``find_spec`` check)
    is marked ``needs_extra`` (on the function, a ``pytest.param`` or the module), since
    .ci/run runs only the marked tests once the extras are installed."""
    modules = {m for name, ms in extras().items() if name != "test" for m in ms}
    assert {"transformers", "matplotlib"} <= modules

    def unmarked(node, marked):
        if isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0]):
            return []  # the module's marks: checked below
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            marked = marked or any("needs_extra" in ast.unparse(d) for d in node.decorator_list)
        found = []
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).split(".")[-1]
            marked = marked or (name == "param" and "needs_extra" in ast.unparse(node))
            if (name in ("importorskip", "find_spec") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] in modules and not marked):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            found += unmarked(child, marked)
        return found

    missing, needing = {}, set()
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        module_marked = any(isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node)
                            and "needs_extra" in ast.unparse(node.value) for node in tree.body)
        found = [] if module_marked else unmarked(tree, False)
        if found:
            missing[path.name] = found
        if "needs_extra" in text:
            needing.add(path.name)
    assert not missing, f"mark these tests @pytest.mark.needs_extra: {missing}"
    assert {"test_hf.py", "test_render.py", "test_saving.py", "test_benchmarks.py"} <= needing


README_LIMIT = 12 * 1024  # bytes: a front page that fits on a few screens (issue 27)


def test_the_readme_is_a_front_page_and_the_site_holds_the_manual():
    """README.md stays short: what fpipe is, the set-up with how long it takes, one example,
    a map of the docs. What it held as a manual lives on the site, each fact on some page."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= README_LIMIT, f"README.md is {len(readme.encode())} bytes"
    setup = re.search(r"\n## Set-up\n(.*?)\n## ", readme, re.S).group(1)
    assert re.search(r"torch's\s+install\s+about\s+\w+", setup)
    said = r"the tests\s+(take\s+)?(about|under|over)\s+\d+\s+minutes"
    assert re.search(said, setup), "say how long the suite takes"
    site = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    facts = [
        "| What | Raised as |", "`fpipe.NonFiniteLossError` with `.microbatches`",  # Errors
        'logging.getLogger("fpipe")', "3x the median",  # Logging
        "torch._dynamo.maybe_mark_dynamic", "issue #128711",  # torch.compile
        "makes a step reproducible", "profile_all_threads=True",  # random numbers, threads
        "`pipe(x, *, params=None)`", "`pipe.vjp(x, *, params=None) -> (y, vjp_fn)`",  # API
        "`from_sequential(module, balance, devices=None, *, stateful=None",
        "What differs, on purpose:", "`state_reduce=\"broadcast\"`", "`amp.LossScaler`",
        "Failed to initialize NumPy", "FPIPE_TEST_TIMEOUT_SCALE", "torch-fpipe",
    ]
    missing = [fact for fact in facts if fact not in site]
    assert not missing, f"not on the documentation site: {missing}"
