"""GPipe: every micro-batch forward through the pipeline, then every one backward.

The simplest schedule and the reference for the others: its bubble is (K-1)/(M+K-1) for K
stages and M micro-batches, and each stage keeps all M micro-batches alive at the turn, which is
why it recomputes by default (torchgpipe's ``checkpoint="except_last"``: here every micro-batch
but the first, whose backward runs first, so its activations are freed before any recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

from fpipe.schedules.actions import Action, B, F, Program, stage_count
from fpipe.schedules.remat import RematPolicy, apply_remat, check_fields


@dataclass(frozen=True)
class GPipeSchedule:
    """The GPipe schedule over ``chunks`` micro-batches; a hashable value. (Named apart from
    ``fpipe.GPipe``, the torchgpipe-style module face, which runs this schedule.)"""

    chunks: int
    remat: RematPolicy = "except_last"

    def __post_init__(self) -> None:
        check_fields(self)

    def program(self, n_stages: int) -> Program:
        """Worker k holds stage k: all forwards, then all backwards, in micro-batch order.

        Backwards in micro-batch order, as in every shipped schedule, sum each stage's
        gradients in the same order, so schedules doing the same arithmetic per micro-batch
        give bitwise identical gradients. (torchgpipe runs them last-first, which sums in
        another order; remat's ``"except_last"`` keeps whichever micro-batch is
        backpropagated first, so both free the kept one before any recompute.)"""
        stage_count(n_stages)
        mbs = range(self.chunks)
        workers = [
            [Action(k, F, m) for m in mbs] + [Action(k, B, m) for m in mbs]
            for k in range(n_stages)
        ]
        return apply_remat(Program(workers, n_stages, self.chunks), self.remat)


def gpipe(chunks: int, remat: object = "except_last") -> GPipeSchedule:
    """The GPipe schedule; ``remat`` is a policy accepted by :func:`normalize_remat`."""
    return GPipeSchedule(chunks, remat)  # type: ignore[arg-type]
