"""A step's header: the few integers every rank of a distributed pipeline must agree on before
values are exchanged (the batch size, the step's seed, which call this is), and what each
rank alone knows is wrong with its input or target, so that every rank refuses a bad batch
alike and the pipeline stays usable.

The header is one sum over the ranks (:func:`_summing`): each rank fills the words it knows
and zeros elsewhere. It is *posted* at once (:func:`post`) and its *outcome* read later
(:meth:`Header.outcome`), so the rank of stage 0 does not wait for it before its first
forward: that rank gives the batch size and the seed, so it needs nothing from the header
to compute, only to exchange values (see :meth:`Header.deferrable`). Every other rank needs
the batch size and the seed to begin, and reads the outcome at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fpipe._runtime import microbatch
from fpipe._runtime.ranks.faults import RankFaults
from fpipe.errors import BatchError

__all__ = ["CALLS", "Header", "post", "agreed_by_all"]

#: What a step was called for, by the code in its header.
CALLS = ("inference", "value_and_grad", "vjp")


class Header:
    """A posted header (see the module's docstring): ``n`` and ``seed`` as this rank filled
    them (the true ones on the rank of stage 0), ``errors`` what this rank found wrong with
    its own input or target."""

    def __init__(self, work: Any, rows: torch.Tensor, words: list[int], errors: dict,
                 mine: tuple[int, int], ranks: tuple[int, int], faults: RankFaults,
                 late: Callable[[], list[int]]) -> None:
        self.work, self.rows, self.errors, self.mine = work, rows, errors, mine
        self.n, self.seed = words[0], words[1]
        # Its input's and target's status, and the target's size + 1 where it holds that too.
        self._held = (words[4], words[6], words[5])
        self.first_rank, self.last_rank = ranks
        self.faults, self.late = faults, late

    @property
    def deferrable(self) -> bool:
        """Whether this rank may compute before the outcome: it gave the batch size and the
        seed (stage 0's rank) and found nothing wrong with what it holds (a target it holds
        too has the input's batch size)."""
        input_status, target_status, target_size = self._held
        return (self.faults.rank == self.first_rank and not input_status
                and not target_status and target_size in (0, self.n + 1))

    def outcome(self) -> tuple[int, int, BatchError | None]:
        """The agreed ``(n, seed, error)``: ``error`` a bad input or target (every rank gets
        it, to raise alike, the rank that holds it with the details). Ranks called
        differently raise here (out of step, they stop).

        A rank about to wait says so in the store first (:meth:`RankFaults.arrive`), so that
        one waiting in vain can name the ranks that never came (:meth:`RankFaults.late`). A
        header already summed needs no record, since every rank came: so a step whose header
        is in before it is read (stage 0's, read after its first forward) makes no round trip
        to the store, which may be on another machine."""
        if not self.work.is_completed():
            self.faults.arrive(self.mine[1])
        self.faults.wait(self.work, lambda: f"every rank of the pipeline to start call "
                                            f"{self.mine[1]} (its header)",
                         self.first_rank, late=self.late)
        n, seed, call_first, calls_first, input_status, target_size, target_status = (
            self.rows.sum(0).tolist())
        if input_status:
            return n, seed, self.errors.get("input") or _batch_error(
                input_status, "input", self.first_rank)
        if (call_first, calls_first) != self.mine:
            raise RuntimeError(f"rank {self.faults.rank} was called for "
                               f"{_call_name(*self.mine)} but rank {self.first_rank} for "
                               f"{_call_name(call_first, calls_first)}: every rank must make "
                               f"the same calls in the same order")
        if target_status:
            return n, seed, self.errors.get("target") or _batch_error(
                target_status, "target", self.last_rank)
        if target_size and target_size - 1 != n:
            return n, seed, BatchError(f"the input has {n} samples but the target has "
                                       f"{target_size - 1}")
        return n, seed, None


def post(x: Any, target: Any, seed: int, call: int, calls: int, worker: int,
         ends: tuple[int, int], ranks: tuple[int, ...], group: Any, backend: str,
         wire: torch.device, faults: RankFaults) -> Header:
    """Post this rank's words of a step's header. The rank of stage 0 (worker ``ends[0]``)
    gives the batch size, the seed and what it was called for (``CALLS[call]``, its
    ``calls``-th call), or says its input is missing or has no batch size; the rank of the
    last stage (worker ``ends[1]``) gives its target's batch size, or says it has none."""
    first, last = ends
    mine = (call, calls)
    words = [0] * 7  # a tensor once filled: one tensor op, not one per word
    errors: dict[str, BatchError] = {}
    if worker == first:
        n = _size(x, "input", errors) if x is not None else 0
        words[:5] = [n, seed, *mine, _status(x, "input", errors)]
    if worker == last and call == 1 and target is not None:
        words[5] = _size(target, "target", errors) + 1
        words[6] = _status(target, "target", errors)
    work, rows = _summing(words, group, len(ranks), backend, wire)
    return Header(work, rows, words, errors, mine, (ranks[first], ranks[last]), faults,
                  lambda: faults.late(ranks, calls))


def agreed_by_all(error: BaseException) -> BaseException:
    """Mark ``error`` as one every rank raises alike from the header: raising it stops no
    other rank (:meth:`RankFaults.guarded`), and the pipeline runs on."""
    error.fpipe_agreed = True  # type: ignore[attr-defined]
    return error


def _summing(words: list[int], group: Any, size: int, backend: str,
             wire: torch.device) -> tuple[Any, torch.Tensor]:
    """Start summing ``words`` over the ``size`` ranks of ``group``: ``(work, rows)``, whose
    ``rows.sum(0)`` is the sum once ``work`` is done. On gloo each rank sends its words to
    every rank (``all_to_all_single``), one exchange where an all-reduce makes a ring's two
    passes: 0.2 ms against 0.5 on 2 ranks of a 2-core machine, before every step's first
    action. NCCL keeps the all-reduce."""
    if backend != "gloo":
        rows = torch.tensor([words], dtype=torch.int64, device=wire)
        return dist.all_reduce(rows, group=group, async_op=True), rows
    sent = torch.tensor(words * size, dtype=torch.int64)
    rows = torch.empty_like(sent)
    work = dist.all_to_all_single(rows, sent, group=group, async_op=True)
    return work, rows.view(size, len(words))


def _call_name(call: int, count: int) -> str:
    return f"{CALLS[call]} (call {count})"


def _size(tree: Any, what: str, errors: dict) -> int:
    """``tree``'s batch size, or 0 with its :class:`BatchError` kept in ``errors[what]``."""
    try:
        return microbatch.batch_size(tree, what)
    except BatchError as error:
        errors[what] = error
        return 0


def _status(tree: Any, what: str, errors: dict) -> int:
    """What the header says of an input or target: 0 fine, 1 missing, 2 without one batch
    size (the rank that holds it keeps the details in ``errors``)."""
    return 1 if tree is None else 2 if what in errors else 0


def _batch_error(status: int, what: str, rank: int) -> BatchError:
    """The error every other rank raises for a bad input or target on ``rank``."""
    if status == 1:
        return BatchError(f"rank {rank} holds stage 0, so it needs the input x")
    return BatchError(f"the {what} on rank {rank} has no single batch size (dim 0) to split "
                      f"into micro-batches; rank {rank} raised the details")
