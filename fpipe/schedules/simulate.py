"""A cost model for programs (contract 7 of DESIGN.md): timeline, makespan, bubble, memory.

Schedules trade idle time against live activations; simulating a program under assumed costs
shows the trade before any kernel runs, and lets tests hold each schedule to its known bubble.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from fpipe.schedules.actions import Action, B, F, I, Op, Program, R, W
from fpipe.schedules.validate import dependencies, execution_order, validate

#: A cost for every stage, or one per stage.
Cost = float | tuple[float, ...]


@dataclass(frozen=True)
class Costs:
    """Time of each op, a number for all stages or a tuple with one per stage.

    ``recompute`` defaults to ``forward``. ``transfer`` is the time to carry a result of a stage
    (its activation, or its input-gradient) to another worker; a dependency on the same worker
    costs nothing to reach.
    """

    forward: Cost = 1.0
    backward: Cost = 2.0
    backward_input: Cost = 1.0
    backward_weight: Cost = 1.0
    recompute: Cost | None = None
    transfer: Cost = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                object.__setattr__(self, field.name, _cost(field.name, value))

    def of(self, op: Op, stage: int) -> float:
        """The time ``op`` takes on ``stage``."""
        cost = {F: self.forward, B: self.backward, I: self.backward_input,
                W: self.backward_weight, R: self.forward if self.recompute is None
                else self.recompute}[op]
        return cost[stage] if isinstance(cost, tuple) else cost

    def carry(self, stage: int) -> float:
        """The time to bring a result of ``stage`` to another worker."""
        return self.transfer[stage] if isinstance(self.transfer, tuple) else self.transfer

    def check_stages(self, n_stages: int) -> None:
        """Raise a ValueError if a per-stage tuple does not have one entry per stage."""
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple) and len(value) != n_stages:
                raise ValueError(
                    f"costs.{field.name} has {len(value)} entries but the program has "
                    f"{n_stages} stages"
                )


def _cost(name: str, value: object) -> Cost:
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if (isinstance(item, bool) or not isinstance(item, (int, float))
                or not math.isfinite(item) or item < 0):
            raise ValueError(
                f"costs.{name} must be a non-negative number or a tuple of them, got {value!r}"
            )
    floats = tuple(float(item) for item in items)
    return floats if isinstance(value, (tuple, list)) else floats[0]


@dataclass(frozen=True)
class Span:
    """``action`` ran from ``start`` to ``end``."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """The outcome of :func:`simulate`.

    ``peak_activations[w]`` is the most (stage, micro-batch) pairs on worker ``w`` alive at once:
    forwarded, with the backward not finished (the ``B``, or the ``W`` of a split backward, since
    the weight gradient still reads the saved activations). A pair that will be recomputed
    counts too, as it holds its input; a forward with no backward (inference) keeps nothing.

    ``peak_full_activations`` counts only pairs holding full activations: forwards that are not
    recomputed later, and recomputed pairs between their ``R`` and the end of their backward.

    Both follow from each worker's order alone, not from the costs: a worker runs its actions
    one at a time, and the activations of a stage live on the worker that holds it.
    """

    timeline: tuple[tuple[Span, ...], ...]
    makespan: float
    bubble: float
    peak_activations: tuple[int, ...]
    peak_full_activations: tuple[int, ...]


def simulate(program: Program, costs: Costs | None = None) -> Simulation:
    """Run ``program`` under ``costs`` by list scheduling.

    Each worker runs its actions in order; an action starts when its worker is free and each
    dependency has ended, plus the transfer time for a dependency that ran on another worker.
    The program is validated first (as an inference program if it holds only forwards).
    """
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        hint = f" (write Costs(**{costs!r}))" if isinstance(costs, dict) else ""
        raise TypeError(f"costs must be a Costs value, got a {type(costs).__name__}{hint}")
    costs.check_stages(program.n_stages)
    training = any(a.op is not F for actions in program.workers for a in actions)
    validate(program, training=training)
    present = frozenset(a for actions in program.workers for a in actions)
    placement = program.placement
    free = [0.0] * program.n_workers
    spans: dict[Action, Span] = {}
    for action in execution_order(program):
        worker = placement[action.stage]
        start = free[worker]
        for need, _ in dependencies(action, present, program.n_stages):
            carry = costs.carry(need.stage) if placement[need.stage] != worker else 0.0
            start = max(start, spans[need].end + carry)
        free[worker] = start + costs.of(action.op, action.stage)
        spans[action] = Span(action, start, free[worker])
    timeline = tuple(tuple(spans[a] for a in actions) for actions in program.workers)
    makespan = max(free)
    busy = sum(span.end - span.start for span in spans.values())
    return Simulation(
        timeline=timeline,
        makespan=makespan,
        bubble=1.0 - busy / (program.n_workers * makespan) if makespan > 0 else 0.0,
        peak_activations=tuple(_peak_live(a, full_only=False) for a in program.workers),
        peak_full_activations=tuple(_peak_live(a, full_only=True) for a in program.workers),
    )


def in_flight(program: Program) -> tuple[int, ...]:
    """Per stage, the most micro-batches forwarded and not yet backward-finished at once, from
    program order alone (the backward finishes at ``B``, or at ``W`` in a split backward)."""
    peaks = [0] * program.n_stages
    for actions in program.workers:
        live = [0] * program.n_stages
        for action, change in zip(actions, _changes(actions, full_only=False), strict=True):
            live[action.stage] += change
            peaks[action.stage] = max(peaks[action.stage], live[action.stage])
    return tuple(peaks)


def _peak_live(actions: tuple[Action, ...], full_only: bool) -> int:
    live = peak = 0
    for change in _changes(actions, full_only):
        live += change
        peak = max(peak, live)
    return peak


def _changes(actions: tuple[Action, ...], full_only: bool) -> list[int]:
    """How each action changes the count of live (stage, micro-batch) pairs on its worker.

    A forward with no backward (inference) keeps nothing for later, so it never counts.
    """
    backward = {(a.stage, a.microbatch) for a in actions if a.op is B or a.op is W}
    recomputed = {(a.stage, a.microbatch) for a in actions if a.op is R}

    def change(action: Action) -> int:
        pair = (action.stage, action.microbatch)
        if action.op is F:
            return int(pair in backward and not (full_only and pair in recomputed))
        if action.op is R:
            return int(full_only)
        return -1 if action.op is B or action.op is W else 0

    return [change(a) for a in actions]
