"""Skip connections: values that one stage stashes and a later stage pops (U-Net style).

A stage declared ``skippable(fn, stash=["enc1"])`` returns ``(y, {"enc1": value})``: ``y`` goes
to the next stage as usual, while ``value`` goes straight to the stage that pops it, from
device to device, without passing through the stages between. A stage declared
``skippable(fn, pop=["enc1"])`` is called ``fn(params, x, {"enc1": value})`` (with ``state``
before ``x`` in a stateful pipeline) and returns its output as usual; it may also stash.
Gradients flow back along the same routes. :func:`skip_routes` checks the declarations before
anything runs: every skip is stashed by exactly one stage and popped by exactly one later stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["Skippable", "skippable", "skip_routes", "SkipError"]


class SkipError(ValueError):
    """Skip declarations that no pipeline can carry; the message names the skip and stages."""


class Skippable:
    """A stage function with the names it stashes and pops (both sorted tuples)."""

    def __init__(self, fn: Callable, stash: Iterable[str] = (), pop: Iterable[str] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"skippable needs a stage function, got {type(fn).__name__}")
        self.fn = fn
        self.__wrapped__ = fn  # what it wraps, for those that look through wrappers
        self.stash = _names("stash", stash)
        self.pop = _names("pop", pop)
        both = set(self.stash) & set(self.pop)
        if both:
            raise SkipError(f"a stage cannot stash and pop the same skip: {sorted(both)}")

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", repr(self.fn))
        return f"skippable({name}, stash={list(self.stash)}, pop={list(self.pop)})"


def skippable(fn: Callable | None = None, *, stash: Iterable[str] = (),
              pop: Iterable[str] = ()) -> Any:
    """Declare what a stage stashes and pops; usable as ``@skippable(stash=["a"])`` too.

    On an ``nn.Module`` class, ``@skippable(stash=[...], pop=[...])`` is torchgpipe's: the
    module's ``forward`` yields ``stash(name, tensor)`` and ``pop(name)`` commands (see
    :mod:`fpipe.stages.module_skip`)."""
    if fn is not None and not callable(fn):  # torchgpipe's skippable(stash_names)
        fn, stash = None, fn
    if fn is None:
        return lambda f: _declare(f, stash, pop)
    return _declare(fn, stash, pop)


def _declare(fn: Any, stash: Iterable[str], pop: Iterable[str]) -> Any:
    if isinstance(fn, type):
        from torch import nn

        from fpipe.stages.module_skip import skippable_module
        if issubclass(fn, nn.Module):
            return skippable_module(fn, stash, pop)
    return Skippable(fn, stash, pop)


def stashes(stage: Callable) -> tuple[str, ...]:
    return stage.stash if isinstance(stage, Skippable) else ()


def pops(stage: Callable) -> tuple[str, ...]:
    return stage.pop if isinstance(stage, Skippable) else ()


def skip_routes(stages: Sequence[Callable]) -> dict[str, tuple[int, int]]:
    """For every skip, ``(stashing stage, popping stage)``; a SkipError for a skip popped
    before (or without) being stashed, stashed twice, never popped, or popped twice."""
    stashed_by: dict[str, int] = {}
    popped_by: dict[str, int] = {}
    for s, stage in enumerate(stages):
        for name in pops(stage):
            if name in popped_by:
                raise SkipError(f"skip {name!r} is popped by stage {popped_by[name]} and again "
                                f"by stage {s}; each skip is popped once")
            if name not in stashed_by:
                later = next((t for t in range(s + 1, len(stages))
                              if name in stashes(stages[t])), None)
                where = (f"it is stashed only later, by stage {later}" if later is not None
                         else "no stage stashes it")
                raise SkipError(f"skip {name!r} is popped by stage {s} before it is stashed: "
                                f"{where}")
            popped_by[name] = s
        for name in stashes(stage):
            if name in stashed_by:
                raise SkipError(f"skip {name!r} is stashed by stage {stashed_by[name]} and "
                                f"again by stage {s}; each skip is stashed once")
            stashed_by[name] = s
    never = sorted(set(stashed_by) - set(popped_by))
    if never:
        raise SkipError(f"skip {never[0]!r} is stashed by stage {stashed_by[never[0]]} but no "
                        f"later stage pops it")
    return {name: (stashed_by[name], popped_by[name]) for name in sorted(stashed_by)}


def declared(stages: Sequence[Callable]) -> tuple[tuple, tuple, dict[str, tuple[int, int]]]:
    """The skips ``stages`` declare, checked (:func:`skip_routes`), as plain data: per stage
    the names it pops and stashes, and per skip its ``(stashing, popping)`` stages. The faces
    hand them to the engine as its ``Skips`` value (``Skips(*declared(stages))``): this
    layer knows no engine."""
    return (tuple(pops(fn) for fn in stages), tuple(stashes(fn) for fn in stages),
            skip_routes(stages))


def _names(kind: str, names: Iterable[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(f"{kind} must be a list of skip names, not the string {names!r}")
    names = list(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"skip names must be non-empty strings, got {name!r} in {kind}")
    if len(set(names)) != len(names):
        raise SkipError(f"{kind} names a skip twice: {names}")
    return tuple(sorted(names))
