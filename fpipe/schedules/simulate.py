"""A cost model for programs (contract 7 of DESIGN.md): timeline, makespan, bubble, memory.

Schedules trade idle time against live activations; simulating a program under assumed costs
shows the trade before any kernel runs, and lets tests hold each schedule to its known bubble.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from fpipe.schedules.actions import Action, B, F, Program, R, W
from fpipe.schedules.costs import Cost, Costs
from fpipe.schedules.memory import Memory
from fpipe.schedules.memory import peak_bytes as count_bytes
from fpipe.schedules.validate import execution_order, unit_needs, validate

__all__ = ["Costs", "Cost", "Span", "Breakdown", "Simulation", "simulate", "in_flight",
           "UnmeasuredCostWarning"]


@dataclass(frozen=True)
class Span:
    """``action`` ran from ``start`` to ``end``."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Breakdown:
    """Where the workers' time went, as fractions of all of it (workers x makespan), summing to 1.

    ``useful`` is the work the step needs (forwards and backwards); ``recompute`` the forwards
    run again after their activations were dropped (work a step without remat would not do);
    ``overhead`` the driver's time between actions (``Costs.overhead``); ``idle`` the rest,
    waiting for inputs or for the last worker to finish.
    """

    useful: float
    recompute: float
    overhead: float
    idle: float


@dataclass(frozen=True)
class Simulation:
    """The outcome of :func:`simulate`.

    ``bubble`` is the fraction of the workers' time not spent on useful work: ``1 -
    breakdown.useful``, so a recompute, which the step would not need without remat, counts
    against it (GPipe with remat has a larger bubble than without, as it is slower);
    ``breakdown`` splits it into recompute, overhead and idle time.

    ``peak_activations[w]`` is the most live pairs on worker ``w`` at once: (stage,
    micro-batch) pairs forwarded, with the backward not finished (the ``B``, or the ``W`` of a
    split backward, since the weight gradient still reads the saved activations). A worker
    holding two stages counts a micro-batch once per stage it holds it on. A pair that will be
    recomputed counts too, as it holds its input; a forward with no backward (inference) keeps
    nothing.

    ``peak_full_activations`` counts only pairs holding full activations: forwards that are not
    recomputed later, and recomputed pairs between their ``R`` and the end of their backward.

    Both follow from each worker's order alone, not from the costs: a worker runs its actions
    one at a time, and the activations of a stage live on the worker that holds it.
    ``peak_bytes`` is the same count in bytes, per worker, when :func:`simulate` was given a
    :class:`~fpipe.schedules.Memory` (else ``None``).
    """

    timeline: tuple[tuple[Span, ...], ...]
    makespan: float
    bubble: float
    peak_activations: tuple[int, ...]
    peak_full_activations: tuple[int, ...]
    breakdown: Breakdown = Breakdown(0.0, 0.0, 0.0, 0.0)
    peak_bytes: tuple[int, ...] | None = None


def simulate(program: Program, costs: Costs | None = None,
             memory: Memory | None = None) -> Simulation:
    """Run ``program`` under ``costs`` by list scheduling.

    Each worker runs its actions in order; an action starts when its worker is free (plus
    ``costs.overhead``) and each dependency has ended, plus the transfer time (``transfer +
    latency``) for a dependency that ran on another worker. An overlapped pair
    (:attr:`Program.overlaps`) is one unit: it starts once the inputs of its forward and of its
    backward are there, and lasts as ``costs.overlap`` says (the sum of the two, or the
    longer). The program is validated first (as an inference program if it holds only
    forwards). Pricing a recompute with costs that never measured one
    (``costs.unmeasured``) warns. With ``memory`` (a
    :class:`~fpipe.schedules.Memory`), the simulation also reports each worker's peak bytes.
    """
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        hint = f" (write Costs(**{costs!r}))" if isinstance(costs, dict) else ""
        raise TypeError(f"costs must be a Costs value, got a {type(costs).__name__}{hint}")
    costs = costs.for_stages(program.n_stages)
    training = any(a.op is not F for actions in program.workers for a in actions)
    validate(program, training=training)
    _warn_unmeasured(program, costs)
    peak_bytes = None if memory is None else count_bytes(program, memory)
    present = frozenset(a for actions in program.workers for a in actions)
    needs = unit_needs(program, present)
    partner = {o.forward: o.backward for o in program.overlaps}
    placement = program.placement
    free = [0.0] * program.n_workers
    overhead = busy = recompute = 0.0
    spans: dict[Action, Span] = {}
    for action in execution_order(program):
        if action in spans:  # the backward of a pair, placed with its forward
            continue
        worker = placement[action.stage]
        start = free[worker] + costs.overhead
        for need in needs(action):
            if placement[need.stage] != worker:
                start = max(start, spans[need].end + costs.carry(need.stage))
        overhead += costs.overhead
        length = costs.of(action.op, action.stage)
        spans[action] = Span(action, start, start + length)
        recompute += length if action.op is R else 0.0
        backward = partner.get(action)
        if backward is not None:  # one unit: both at once ("max"), or one after the other
            b = costs.of(backward.op, backward.stage)
            at = start if costs.overlap == "max" else start + length + costs.overhead
            overhead += 0.0 if costs.overlap == "max" else costs.overhead
            spans[backward] = Span(backward, at, at + b)
            length = max(length, b) if costs.overlap == "max" else length + b
        busy += length
        free[worker] = max(spans[a].end for a in (action, backward) if a is not None)
    timeline = tuple(tuple(spans[a] for a in actions) for actions in program.workers)
    makespan = max(free)
    total = program.n_workers * makespan
    useful = busy - recompute
    # (useful / total may round past 1 where the spans' ends and the busy time are summed
    # in another order: a worker busy all the time is busy all the time, no more)
    breakdown = (Breakdown(min(1.0, useful / total), recompute / total, overhead / total,
                           max(0.0, 1.0 - (useful + recompute + overhead) / total))
                 if total > 0 else Breakdown(0.0, 0.0, 0.0, 0.0))
    return Simulation(
        timeline=timeline,
        makespan=makespan,
        bubble=1.0 - breakdown.useful if total > 0 else 0.0,
        peak_activations=tuple(_peak_live(a, full_only=False) for a in program.workers),
        peak_full_activations=tuple(_peak_live(a, full_only=True) for a in program.workers),
        breakdown=breakdown,
        peak_bytes=peak_bytes,
    )


def _warn_unmeasured(program: Program, costs: Costs) -> None:
    unmeasured = {stage for name, stage in costs.unmeasured if name == "recompute"}
    if not unmeasured:
        return
    guessed = next((a for actions in program.workers for a in actions
                    if a.op is R and ({a.stage, None} & unmeasured)), None)
    if guessed is not None:
        warnings.warn(
            f"simulate prices a recompute ({guessed}) with costs that never measured one: "
            "costs.recompute was taken as the forward's, while a recompute measures 1.3-1.9x a "
            "forward; fit the costs to a step that recomputes too (e.g. recorded with "
            "remat='always'), or give recompute=", UnmeasuredCostWarning, stacklevel=3)


class UnmeasuredCostWarning(UserWarning):
    """:func:`simulate` priced an op with a cost derived, not measured (``Costs.unmeasured``)."""


def in_flight(program: Program) -> tuple[int, ...]:
    """Per stage, the most of its live pairs at once (its micro-batches forwarded and not yet
    backward-finished), from program order alone (the backward finishes at ``B``, or at ``W``
    in a split backward)."""
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
