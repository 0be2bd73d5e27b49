"""The order of a distributed pipeline's calls on one rank: one at a time, a ``vjp`` step's
``vjp_fn`` before anything else, nothing after a failure or after ``close()``. A call that
breaks these rules is refused at once (never queued): nothing could make two threads' calls
reach every rank in one order."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from fpipe._runtime.ranks.faults import RankFaults
from fpipe._runtime.ranks.teardown import OPEN, used

__all__ = ["Calls"]


class Calls:
    """One pipeline's call state on this rank: ``pending`` is the step a ``vjp`` began (until
    its ``vjp_fn`` runs), ``closed`` whether ``close()`` ran. ``forget()`` drops the
    pipeline's references to its process groups: after ``close()``, and at the interpreter's
    exit for a pipeline never closed (:mod:`fpipe._runtime.ranks.teardown`)."""

    def __init__(self, faults: RankFaults, forget: Callable[[], None]) -> None:
        self.faults, self.forget = faults, forget
        self.running = threading.Lock()
        self.pending: object | None = None
        self.closed = False
        OPEN.add(self)
        used()

    @contextlib.contextmanager
    def alone(self, pending: object | None = None) -> Iterator[None]:
        """Hold the pipeline for one call (``pending``: the vjp step whose ``vjp_fn`` this
        is); a second thread's call while one runs is refused, and so is any call but the
        ``vjp_fn`` while a vjp step is half done."""
        if not self.running.acquire(blocking=False):
            raise RuntimeError("this distributed pipeline is already running a step on another "
                               "thread; its calls are collective, so make them from one thread, "
                               "in the same order on every rank")
        try:
            if self.closed:
                raise RuntimeError("this distributed pipeline was closed: build a new one "
                                   "(on every rank) to run more steps")
            if self.faults.broken is not None:
                raise RuntimeError("this distributed pipeline stopped after a failure and "
                                   "cannot run again; restart the job") from self.faults.broken
            if self.pending is not pending:
                raise RuntimeError("this vjp function was called already: a pipeline step "
                                   "runs its backward once" if pending is not None else
                                   "a step begun by vjp() is waiting for its vjp_fn: call it "
                                   "(on every rank) before anything else")
            yield
        finally:
            self.running.release()

    def close(self, release: Callable[[], None]) -> None:
        """Refuse every later call, then ``release()`` (collective) unless the pipeline failed,
        whose groups are aborted already. Closing twice does nothing more."""
        if self.closed:
            return
        if not self.running.acquire(blocking=False):
            raise RuntimeError("close() was called while another thread runs a step of this "
                               "distributed pipeline; close it from the thread that calls it")
        try:
            self.closed, self.pending = True, None
            OPEN.discard(self)
            if self.faults.broken is None:
                self.faults.guarded(release)
        finally:
            self.forget()
            self.running.release()

    def abandon(self, error: BaseException) -> None:
        """Close without waiting, because this rank leaves the pipeline on ``error`` (raised
        in a ``with`` block): the failure is published and fpipe's groups aborted, so the
        other ranks stop at once with an error naming it instead of waiting out the timeout
        for a peer that will not come. ``error`` itself goes on up, never masked here."""
        if self.closed:
            return
        self.closed, self.pending = True, None
        OPEN.discard(self)
        try:
            if self.faults.broken is None:
                self.faults.stop_everyone(error)
        except Exception:  # noqa: BLE001, S110 - best effort: the caller's error matters more
            pass
        finally:
            self.forget()
