"""``is_recomputing()``: lets a stage tell a recompute from the forward it repeats.

A recompute must rebuild exactly what its forward computed, so a stage with side effects
(counting, logging, caching) can skip them while this is true. The flag is per thread, since
each worker of the local driver runs on its own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["is_recomputing", "recomputing"]

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
