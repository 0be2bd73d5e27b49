"""Rematerialisation policies as program -> program transforms (contract 5 of DESIGN.md).

A recomputed (stage, micro-batch) keeps only its input after the forward and runs the forward
again, as an ``R`` action, just before its backward. Writing the recompute into the program,
rather than leaving it to a driver flag, lets memory and time be counted before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

from fpipe.schedules.actions import Action, B, I, Overlap, Program, R, positive_int, program_of

#: A normalised policy: one of :data:`POLICIES`, or the frozenset of stages to recompute.
RematPolicy = str | frozenset[int]

POLICIES = ("always", "except_last", "never")


def normalize_remat(policy: object) -> RematPolicy:
    """The hashable canonical form of a policy, or a ValueError saying what is accepted.

    ``"always"`` recomputes every (stage, micro-batch); ``"except_last"`` every one except,
    per stage, the micro-batch whose backward runs first (see :func:`apply_remat`);
    ``"never"`` none; an iterable of stage indices recomputes those stages on every
    micro-batch.
    """
    accepted = f"one of {', '.join(map(repr, POLICIES))}, or a set of stage indices"
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown remat policy {policy!r}: expected {accepted}")
        return policy
    try:
        stages = frozenset(policy)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"remat policy must be {accepted}, got {policy!r}") from None
    bad = sorted((s for s in stages if isinstance(s, bool) or not isinstance(s, int) or s < 0),
                 key=repr)
    if bad:
        raise ValueError(
            f"remat stages must be non-negative integers, got {', '.join(map(repr, bad))}"
        )
    return stages


@dataclass(frozen=True)
class Rematerialized:
    """A schedule whose programs get a remat policy applied: what :func:`apply_remat` returns
    for a schedule that is not a ``Program`` (a value, or a function ``n_stages -> Program``),
    since its program is known only once the stage count is."""

    schedule: object
    policy: RematPolicy

    def program(self, n_stages: int) -> Program:
        return apply_remat(program_of(self.schedule, n_stages), self.policy)


@overload
def apply_remat(program: Program, policy: object) -> Program: ...
@overload
def apply_remat(program: object, policy: object) -> Rematerialized: ...


def apply_remat(program: object, policy: object) -> Program | Rematerialized:
    """``program`` with ``R(s, m)`` inserted right before the first backward (B or I) of each
    (stage, micro-batch) the policy selects, on that stage's worker.

    ``"except_last"`` keeps, per stage, the micro-batch whose backward comes first on its
    worker: torchgpipe's last micro-batch, since its backwards run last-first (the last forward
    is closest to the backwards), and micro-batch 0 in fpipe's schedules, whose backwards run
    in micro-batch order so that every schedule sums gradients in one order. Keeping the one
    backpropagated first frees its activations before any recompute builds another's: the
    peak holds one micro-batch's activations, not two.

    A backward overlapped with a forward (:class:`~fpipe.schedules.Overlap`) gets its ``R``
    before the pair, which stays one unit.

    Pairs that already recompute keep their ``R`` and get no second one, so applying a policy
    twice changes nothing; pairs without a backward (inference) are left alone. Any schedule
    form works: given a schedule value or a function ``n_stages -> Program`` rather than a
    ``Program``, the result is a schedule (:class:`Rematerialized`) whose programs are those of
    ``program`` with the policy applied.
    """
    policy = normalize_remat(policy)
    if not isinstance(program, Program):
        if not (hasattr(program, "program") or callable(program)):
            raise TypeError(f"apply_remat needs a Program or a schedule, got "
                            f"{type(program).__name__}")
        return Rematerialized(program, policy)
    if isinstance(policy, frozenset):
        beyond = sorted(s for s in policy if s >= program.n_stages)
        if beyond:
            raise ValueError(
                f"remat stages {beyond} do not exist: the program has {program.n_stages} stages"
            )
    kept = first_backwards(program)

    def selected(stage: int, mb: int) -> bool:
        if policy == "always":
            return True
        if policy == "except_last":
            return kept.get(stage) != mb
        if policy == "never":
            return False
        return stage in policy

    handled = set(recomputed(program))
    workers = []
    for units in program.units:
        out: list[Action | Overlap] = []
        for unit in units:
            for action in unit.actions if isinstance(unit, Overlap) else (unit,):
                pair = (action.stage, action.microbatch)
                if action.op in (B, I) and pair not in handled:
                    handled.add(pair)
                    if selected(*pair):
                        out.append(Action(action.stage, R, action.microbatch))
            out.append(unit)
        workers.append(out)
    return Program(workers, program.n_stages, program.n_microbatches)


def first_backwards(program: Program) -> dict[int, int]:
    """Per stage, the micro-batch of its first backward (B or I) in its worker's order."""
    first: dict[int, int] = {}
    for actions in program.workers:
        for action in actions:
            if action.op in (B, I):
                first.setdefault(action.stage, action.microbatch)
    return first


def recomputed(program: Program) -> frozenset[tuple[int, int]]:
    """The (stage, micro-batch) pairs that ``program`` recomputes."""
    return frozenset(
        (a.stage, a.microbatch) for actions in program.workers for a in actions if a.op is R
    )


def check_fields(schedule: object, *counts: str) -> None:
    """Check a schedule value's ``chunks`` and other ``counts`` (positive integers) and
    normalise its ``remat`` policy, in place: for the frozen dataclasses' ``__post_init__``."""
    for name in ("chunks", *counts):
        object.__setattr__(schedule, name, positive_int(name, getattr(schedule, name)))
    object.__setattr__(schedule, "remat", normalize_remat(schedule.remat))
