"""``is_recomputing()``: lets a stage tell a recompute from the forward it repeats.

A recompute must rebuild exactly what its forward computed, so a stage with side effects
(counting, logging, caching) can skip them while this is true. ``is_checkpointing()`` is true
in the forward a recompute will repeat (its activations are dropped), as torchgpipe's is. The
flags are per thread, since each worker of the local driver runs on its own thread.

One more flag is the runtime's own: :func:`state_owned` is true in a stateful stage's call
whose state no one else holds (made earlier in the step, and neither the caller's nor kept for
a recompute), which the stage may therefore update in place instead of copying first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["is_recomputing", "recomputing", "is_checkpointing", "checkpointing"]

_flag = threading.local()


def is_recomputing() -> bool:
    """True while the calling thread runs a stage's recompute."""
    return getattr(_flag, "recomputing", False)


def is_checkpointing() -> bool:
    """True while the calling thread runs a training forward whose activations are dropped, to
    be rebuilt by a recompute before the backward."""
    return getattr(_flag, "checkpointing", False)


def state_owned() -> bool:
    """True while the calling thread runs a stage call whose state it may update in place: the
    runtime made that state earlier in the step and holds it nowhere else (see
    :func:`owning_state`)."""
    return getattr(_flag, "owned", False)


def owning_state() -> contextlib.AbstractContextManager[None]:
    return _raised("owned")


def recomputing() -> contextlib.AbstractContextManager[None]:
    return _raised("recomputing")


def checkpointing() -> contextlib.AbstractContextManager[None]:
    return _raised("checkpointing")


@contextlib.contextmanager
def _raised(name: str) -> Iterator[None]:
    """The calling thread's flag ``name`` true for the block."""
    setattr(_flag, name, True)
    try:
        yield
    finally:
        setattr(_flag, name, False)
