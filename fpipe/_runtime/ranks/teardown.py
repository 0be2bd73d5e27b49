"""The end of a script that ran fpipe over ``torch.distributed``: what must happen while the
interpreter still runs, before its teardown.

A gloo process group's worker thread releases each finished collective's tensors after the
caller's ``wait()`` has returned. When a tensor's Python object has already gone, that release
needs the interpreter (the GIL). If the script ends right after its last collective (a
checkpoint, then ``destroy_process_group()``), the release can come after the interpreter's
teardown has begun, and the thread then aborts the whole process ("terminate called without
an active exception"; pytorch#179291 describes the same race). So at exit, fpipe first lets go
of the groups of any pipeline never closed, collects garbage (a reference cycle holding a group
would otherwise be freed during the teardown), and gives the worker threads a moment, with the
GIL released, to finish."""

from __future__ import annotations

import atexit
import gc
import time
import weakref

__all__ = ["OPEN", "used"]

#: The call states (:class:`~fpipe._runtime.ranks.calls.Calls`) of every distributed pipeline
#: of this process not yet closed: each has a ``forget()``.
OPEN: weakref.WeakSet = weakref.WeakSet()
#: Seconds given to gloo's worker threads at exit, GIL released.
SETTLE = 0.2
_USED: list[bool] = [False]


def used() -> None:
    """Note that this process ran collectives through fpipe (a pipeline, a checkpoint)."""
    _USED[0] = True


@atexit.register
def _before_teardown() -> None:
    for calls in list(OPEN):
        calls.forget()  # sends nothing: the peers may be gone
    if _USED[0]:
        gc.collect()
        time.sleep(SETTLE)
