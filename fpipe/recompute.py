"""``is_recomputing()``: lets a stage tell a recompute from the forward it repeats.

A recompute must rebuild exactly what its forward computed, so a stage with side effects
(counting, logging, caching) can skip them while this is true. ``is_checkpointing()`` is true
in the forward a recompute will repeat (its activations are dropped), as torchgpipe's is. The
flags are per thread, since each worker of the local driver runs on its own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["is_recomputing", "recomputing", "is_checkpointing", "checkpointing"]

_flag = threading.local()


def is_recomputing() -> bool:
    """True while the calling thread runs a stage's recompute."""
    return getattr(_flag, "on", False)


@contextmanager
def recomputing() -> Iterator[None]:
    _flag.on = True
    try:
        yield
    finally:
        _flag.on = False


def is_checkpointing() -> bool:
    """True while the calling thread runs a training forward whose activations are dropped, to
    be rebuilt by a recompute before the backward."""
    return getattr(_flag, "checkpointing", False)


@contextmanager
def checkpointing() -> Iterator[None]:
    _flag.checkpointing = True
    try:
        yield
    finally:
        _flag.checkpointing = False
