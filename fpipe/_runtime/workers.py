"""Worker threads and their inboxes: how the local driver runs workers concurrently.

Threads are started once per pipeline, not per step, and the caller's own thread runs one of
the workers (worker 0, unless told otherwise), so a one-worker program starts no thread at
all. Torch kernels release the GIL, so workers on CPU stages really compute in parallel. A
step that fails is aborted everywhere: every inbox wakes its waiter with :class:`Aborted`,
each worker returns, and only then does the caller raise, so no thread is ever left blocked
inside a step.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.autograd import profiler

from fpipe._runtime.log import logger
from fpipe.errors import OversubscriptionWarning

__all__ = ["Aborted", "Inbox", "WorkerPool", "cores", "warn_if_oversubscribed",
           "warn_if_profiler_misses_workers"]


def cores() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def warn_if_oversubscribed(n_workers: int) -> None:
    """Say so when ``n_workers`` threads are more than the cores that can run them at once."""
    available = cores()
    if n_workers <= available:
        return
    warnings.warn(
        f"this pipeline runs {n_workers} worker threads, but this process has {available} CPU "
        f"cores: the workers will take turns, and each value handed from one worker to the "
        f"next waits for a thread to be woken. Put several stages on one worker with "
        f"fpipe.schedules.colocate(schedule, workers) (e.g. colocate(one_f_one_b(chunks=8), "
        f"[0, 0, 1, 1]): stage s on worker workers[s]), or silence this with "
        f"warnings.simplefilter('ignore', fpipe.OversubscriptionWarning)",
        OversubscriptionWarning, stacklevel=_outside_fpipe())


_warned_profiler: list[bool] = []


def warn_if_profiler_misses_workers(n_workers: int) -> None:
    """Say once per process when a profiler records only the caller's thread, which runs one of
    ``n_workers`` workers: torch's profiler keeps its callbacks per thread unless built with
    ``profile_all_threads``, which no library can change for the threads it starts. (Built with
    it, the profiler is on for every thread and for none in particular: the caller's thread
    then reports no thread-local profiler.)"""
    if n_workers < 2 or _warned_profiler or not profiler._is_profiler_enabled:
        return
    if not torch._C._autograd._profiler_enabled():
        return
    _warned_profiler.append(True)
    warnings.warn(
        f"the profiler records only the calling thread, which runs one of this pipeline's "
        f"{n_workers} workers; the other workers' actions and ops are missing from the trace. "
        f"To record every worker, build the profiler with experimental_config="
        f"torch._C._profiler._ExperimentalConfig(profile_all_threads=True)",
        RuntimeWarning, stacklevel=_outside_fpipe())


def _outside_fpipe() -> int:
    """The stack level of the first caller outside fpipe (the line that built the pipeline)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "fpipe":
        frame, level = frame.f_back, level + 1
    return level


class Aborted(Exception):
    """Raised in a worker waiting for a value when another worker has failed."""


class Inbox:
    """Values addressed to one worker, each taken once by key, only by that worker.

    Every put rings a bell (a ``queue.SimpleQueue``, whose waits and wake-ups are C code): a
    worker waiting for a key sleeps on the bell and looks again at each ring. A ring it did not
    wait for (a value found at once) only costs a later wait one look more; none is lost, since
    the queue counts them."""

    __slots__ = ("_items", "_bell", "aborted")

    def __init__(self) -> None:
        self._items: dict[Hashable, Any] = {}
        self._bell: queue.SimpleQueue = queue.SimpleQueue()
        self.aborted = False

    def put(self, key: Hashable, item: Any) -> None:
        self._items[key] = item
        self._bell.put(None)

    def take(self, key: Hashable) -> Any:
        items = self._items
        while key not in items:
            if self.aborted:
                raise Aborted
            self._bell.get()
        return items.pop(key)

    def abort(self) -> None:
        self.aborted = True
        self._bell.put(None)


class WorkerPool:
    """``n`` workers: the caller's thread and ``n - 1`` daemon threads kept between steps."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._jobs: list[queue.SimpleQueue] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        for w in range(1, self.n):
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(jobs, self._done),
                                      name=f"fpipe-worker-{w}", daemon=True)
            thread.start()
            self._jobs.append(jobs)
            self._threads.append(thread)
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._threads)
        logger.info("started %d worker threads", self.n - 1)

    def run(self, jobs: list[Callable[[], None]], on_interrupt: Callable[[], None],
            inline: int = 0) -> None:
        """Run the ``n`` jobs at once, ``jobs[inline]`` in the calling thread and the others on
        the pool's threads; return when all have returned.

        Jobs handle their own errors. If the caller is interrupted (KeyboardInterrupt) while
        running or waiting, ``on_interrupt`` aborts the step, the other workers are waited for,
        and the interrupt is re-raised.
        """
        if self.n > 1 and not self._threads:
            self._start()
        for job, inbox in zip(jobs[:inline] + jobs[inline + 1:], self._jobs):
            inbox.put(job)
        pending = self.n - 1
        try:
            jobs[inline]()
            while pending:
                self._done.get()
                pending -= 1
        except BaseException:
            on_interrupt()
            while pending:
                self._done.get()
                pending -= 1
            raise

    def runs_in(self, ident: int) -> bool:
        """Whether the thread ``ident`` is one of the pool's."""
        return any(thread.ident == ident for thread in self._threads)

    def close(self) -> None:
        """Stop the threads; the pool starts new ones if it is used again."""
        if self._finalizer is not None:
            self._finalizer()
            logger.info("stopped %d worker threads", len(self._threads))
        self._jobs, self._threads, self._finalizer = [], [], None


def _serve(jobs: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job()
        except BaseException:  # noqa: S110 - the job has recorded it; the thread must live on
            pass
        finally:
            job = None  # hold nothing of the finished step (or of its pipeline) while idle
            done.put(None)


def _stop(jobs: list[queue.SimpleQueue], threads: list[threading.Thread]) -> None:
    for inbox in jobs:
        inbox.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()
