"""``is_recomputing()``: lets a stage tell a recompute from the forward it repeats.

A recompute must rebuild exactly what its forward computed, so a stage with side effects
(counting, logging, caching) can skip them while this is true. ``is_checkpointing()`` is true
in the forward a recompute will repeat (its activations are dropped), as torchgpipe's is. The
flags are per thread, since each worker of the local driver runs on its own thread.

One more flag is the runtime's own: :func:`state_owned` is true in a stateful stage's call
whose state the step made (not the caller's), which the stage may update in place instead of
copying first, except what its recompute would read: the state a forward saw is what its
recompute starts from. And :func:`run_serial` names the run the thread is in (a worker's stage
calls for a step or half a step, or a whole ``fpipe.GPipe`` forward: blocks in which none of
the caller's code runs), so that a module stage checks its module's structure once per run
instead of once per call.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

__all__ = ["is_recomputing", "is_checkpointing"]

_flag = threading.local()


def is_recomputing() -> bool:
    """True while the calling thread runs a stage's recompute."""
    return getattr(_flag, "recomputing", False)


def is_checkpointing() -> bool:
    """True while the calling thread runs a training forward whose activations are dropped, to
    be rebuilt by a recompute before the backward."""
    return getattr(_flag, "checkpointing", False)


def state_owned() -> bool:
    """True while the calling thread runs a stage call whose state the step made (not the
    caller's): the stage may update in place what no recompute reads (a recompute starts from
    the state its forward saw)."""
    return getattr(_flag, "owned", False)


_serials = itertools.count(1)


def run_serial() -> int | None:
    """While the calling thread runs stage calls for the runtime (:func:`run`), a number of
    that run alone; else ``None``. What a stage caches of its module's structure holds for one
    serial: in between only fpipe's code and stage calls ran, no code of the caller's (which
    waits for the run), so a change of the module made since is one a stage made in its own
    call."""
    return getattr(_flag, "run", None)


@contextlib.contextmanager
def run() -> Iterator[None]:
    """The block of one run: a worker's stage calls (a step, or one half of a step run in two
    calls), or a whole call of a face that runs nothing of its caller's inside
    (``fpipe.GPipe``'s forward, whose checks of its partitions then count for its stages).
    Inside one run a nested block is part of it (the same serial); the outermost gets a new
    :func:`run_serial`, and ``None`` is restored after it."""
    if getattr(_flag, "run", None) is not None:
        yield
        return
    _flag.run = next(_serials)  # next() on a count is atomic: no two runs share one
    try:
        yield
    finally:
        _flag.run = None


def flags(*, recomputing: bool = False, checkpointing: bool = False,
          owned: bool = False) -> contextlib.AbstractContextManager[None]:
    """Sets the calling thread's flags for a block, as the runtime does around each stage call:
    those given true are true inside it (and false after)."""
    return _FLAGS[recomputing, checkpointing, owned]


class _Flags:
    """One combination of flags: an object, not a generator, since one is entered per call."""

    __slots__ = ("names",)

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __enter__(self) -> None:
        for name in self.names:
            setattr(_flag, name, True)

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            setattr(_flag, name, False)


_FLAGS = {(r, c, o): _Flags(tuple(name for name, on in (("recomputing", r),
                                                         ("checkpointing", c), ("owned", o))
                                  if on))
          for r in (False, True) for c in (False, True) for o in (False, True)}
