"""How a failure on one rank stops every rank of a distributed pipeline, and what each says.

Every wait on another rank is bounded by the pipeline's timeout (:meth:`RankFaults.wait`). The
first rank that fails writes what happened (rank, stage, micro-batch, op, the exception's type
and message) to the process group's store and aborts fpipe's process groups, which wakes every
rank blocked on one of them; each reads the store, raises an error naming the first failure
(a :class:`~fpipe.StageError` for a stage's, a :class:`~fpipe.errors.PeerError` for a lost or
silent rank) and aborts in turn. After a failure the pipeline cannot run again.
"""

from __future__ import annotations

import itertools
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fpipe.errors import PeerError, StageError, Where, where

__all__ = ["RankFaults", "at_rank"]

_created = itertools.count()
#: The most seconds a rank that timed out waits for the others to say whom they wait on.
_CHAIN_S = 2.0


class RankFaults:
    """One pipeline's failure state on this rank: the store record every rank reads, the
    groups aborted on failure (fpipe's own, never the caller's), and ``broken``, the failure
    that stopped the pipeline (``None`` while it runs)."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        self._limit = timedelta(seconds=timeout)  # made once: every wait of every step uses it
        self.store = dist.distributed_c10d._get_default_store()
        # One record for the pipelines every rank builds at once (replicas too: they are
        # built together, so this count agrees), so a failure in one replica is the one every
        # rank of every replica names.
        self.prefix = f"fpipe/pipeline{next(_created)}"
        self.key = f"{self.prefix}/failure"
        self.groups: list[Any] = []
        self.broken: BaseException | None = None

    def guarded(self, fn: Callable[[], Any]) -> Any:
        """``fn()``; if it raises, every other rank is stopped first (unless already, or
        unless every rank raises the same error by itself: a step's header refusing a bad
        batch, :func:`~fpipe._runtime.ranks.header.agreed_by_all`)."""
        try:
            return fn()
        except BaseException as exc:
            if self.broken is None and not getattr(exc, "fpipe_agreed", False):
                self.stop_everyone(exc)
            raise

    def wait(self, work: Any, what: str | Callable[[], str], peer: int,
             stage: int | None = None, microbatch: int | None = None,
             late: Callable[[], list[int]] | None = None) -> None:
        """Wait for ``work`` at most ``timeout`` seconds; a failure raises the error that
        :meth:`failure_from` makes (after stopping every rank), quoting the time waited.
        ``what`` may be a function that says it, called only then (the waits of every step
        format nothing). ``late``: for a collective, which ranks never came to it
        (:meth:`late`), named instead of ``peer`` when it times out."""
        started = time.monotonic()
        try:
            work.wait(self._limit)
        except Exception as exc:
            waited = time.monotonic() - started
            what = what() if callable(what) else what
            if late is not None and _timed_out(exc):
                peer = next(iter(late()), peer)
            raise self.failure_from(peer, what, stage, microbatch, exc, waited) from exc

    def arrive(self, call: int) -> None:
        """Say in the store that this rank came to call ``call``'s first collective, so that
        a rank that waits there in vain can name the ranks that did not (:meth:`late`)."""
        try:
            self.store.set(f"{self.prefix}/at/{self.rank}", str(call))
        except Exception:  # noqa: BLE001, S110 - only a better message is lost
            pass

    def late(self, ranks: tuple[int, ...], call: int) -> list[int]:
        """The ranks of ``ranks`` that have not come to call ``call`` (:meth:`arrive`)."""
        found = []
        for rank in ranks:
            key = f"{self.prefix}/at/{rank}"
            try:
                there = self.store.check([key]) and int(self.store.get(key)) >= call
            except Exception:  # noqa: BLE001 - the store's host may be gone: name none
                return []
            if not there:
                found.append(rank)
        return found

    def failure_from(self, peer: int, what: str, stage: int | None, mb: int | None,
                     exc: Exception, waited: float | None = None) -> Exception:
        """The error to raise after a wait on ``peer`` failed (after ``waited`` seconds): the
        first rank's published failure if there is one, else what this rank saw. Every rank
        is stopped."""
        record = self._published()
        if record is None and _timed_out(exc):
            peer = self._culprit(peer)
            record = self._published()  # it may have come while this rank looked
        waited_s = f"{self.timeout if waited is None else waited:.3g} s"
        if record is not None:
            kind, rank, f_stage, f_mb, op, type_name, message = record
            said = f"rank {rank} failed, so rank {self.rank} stopped while waiting for {what}: "
            if kind == "stage":
                error: Exception = StageError(
                    said + _stage_failure(type_name, message, Where(f_stage, f_mb, op)),
                    f_stage, f_mb, op, rank)
            else:
                error = PeerError(f"{said}{type_name}: {message}", rank, f_stage, f_mb)
        elif _timed_out(exc):
            error = PeerError(f"rank {self.rank} waited {waited_s} for {what} and got "
                              f"nothing: rank {peer} is late, stuck or gone", peer, stage, mb)
        else:
            error = PeerError(f"rank {self.rank} lost rank {peer} after {waited_s} while "
                              f"waiting for {what}: {exc}", peer, stage, mb)
        self.stop_everyone(error)
        return error

    def _culprit(self, peer: int) -> int:
        """The rank at the end of the chain of waits from ``peer``: a rank that timed out
        says in the store whom it waited on, gives the others a moment to say the same, then
        follows the chain to a rank that waits on no one (late or hung), so every rank of a
        chain names that rank, not its neighbour."""
        try:
            self.store.set(f"{self.prefix}/waiting/{self.rank}", str(peer))
            time.sleep(min(_CHAIN_S, self.timeout / 5))
            seen = {self.rank}
            while peer not in seen:
                seen.add(peer)
                key = f"{self.prefix}/waiting/{peer}"
                if not self.store.check([key]):
                    return peer
                peer = int(self.store.get(key))
        except Exception:  # noqa: BLE001, S110 - the store's host may be gone: name the peer
            pass
        return peer

    def _published(self) -> tuple | None:
        try:
            if self.store.check([self.key]):
                return pickle.loads(self.store.get(self.key))
        except Exception:  # noqa: BLE001 - the store's host may be gone too; say what we saw
            return None
        return None

    def stop_everyone(self, error: BaseException) -> None:
        """Publish ``error`` unless a failure is already known, then abort fpipe's groups,
        which wakes every rank blocked on this one.

        A failure located in a stage (:func:`~fpipe.errors.where`: the stage's own exception
        or a :class:`StageError`) is published as a stage failure of the rank where it was
        raised; a :class:`PeerError` as a failure of the rank it names; anything else as this
        rank's failure. Each keeps the type and message."""
        self.broken = error
        at = where(error)
        if at is not None:
            record = ("stage", self.rank if at.rank is None else at.rank, at.stage,
                      at.microbatch, at.op)
        else:  # a PeerError names the rank at fault (late, stuck or gone), not this one
            culprit = getattr(error, "rank", None) if isinstance(error, PeerError) else None
            record = ("peer", self.rank if culprit is None else culprit,
                      getattr(error, "stage", None), getattr(error, "microbatch", None), None)
        record += (type(error).__name__, str(error))
        try:
            self.store.compare_set(self.key, "", pickle.dumps(record))
        except Exception:  # noqa: BLE001, S110 - best effort: the abort below still wakes peers
            pass
        for group in self.groups:
            dist.distributed_c10d._abort_process_group(group)


def _timed_out(exc: BaseException) -> bool:
    return "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def at_rank(error: BaseException, rank: int) -> BaseException:
    """``error``, a step's failure, with the rank it was raised on recorded in its
    :func:`~fpipe.errors.where` (a stage's own exception that takes no attributes keeps none)."""
    if isinstance(error, StageError):
        error.rank = rank
    elif (at := where(error)) is not None:
        try:
            error.fpipe_where = at._replace(rank=rank)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            pass
    return error


def _stage_failure(type_name: str, message: str, at: Where) -> str:
    """What failed where, for ranks that only learn of it: the place, the original exception's
    type and its message (a StageError of the interpreter's already says the place)."""
    place = at.failed()
    if type_name == "StageError" and message.startswith(place):
        return message
    return f"{place}: {type_name}: {message}"
