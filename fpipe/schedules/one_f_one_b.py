"""1F1B (PipeDream-flush): alternate forwards and backwards to bound live activations.

Same bubble as GPipe with equal costs, but stage k of K holds at most K-k micro-batches at once
instead of all M, because each backward frees one as soon as the steady state begins.
"""

from __future__ import annotations

from dataclasses import dataclass

from fpipe.schedules.actions import Action, B, F, Program, stage_count
from fpipe.schedules.remat import RematPolicy, apply_remat, check_fields


@dataclass(frozen=True)
class OneFOneB:
    """The 1F1B schedule over ``chunks`` micro-batches; a hashable value."""

    chunks: int
    remat: RematPolicy = "never"

    def __post_init__(self) -> None:
        check_fields(self)

    def program(self, n_stages: int) -> Program:
        """Worker k holds stage k: K-k-1 warm-up forwards, then one forward and one backward
        in turn, then the remaining backwards; backwards go in micro-batch order."""
        stage_count(n_stages)
        workers = [self._worker(k, n_stages) for k in range(n_stages)]
        return apply_remat(Program(workers, n_stages, self.chunks), self.remat)

    def _worker(self, stage: int, n_stages: int) -> list[Action]:
        warmup = min(n_stages - stage - 1, self.chunks)
        actions = [Action(stage, F, m) for m in range(warmup)]
        for m in range(self.chunks - warmup):
            actions += [Action(stage, F, warmup + m), Action(stage, B, m)]
        actions += [Action(stage, B, m) for m in range(self.chunks - warmup, self.chunks)]
        return actions


def one_f_one_b(chunks: int, remat: object = "never") -> OneFOneB:
    """The 1F1B schedule; ``remat`` is a policy accepted by :func:`normalize_remat`."""
    return OneFOneB(chunks, remat)  # type: ignore[arg-type]
