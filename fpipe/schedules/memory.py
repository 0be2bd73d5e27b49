"""Memory in bytes: each worker's peak over a program, and a program checked against a budget.

Counting live pairs (``peak_activations``: (stage, micro-batch) pairs forwarded, backward not
finished) says which schedule holds more, not whether it fits a device. With
the bytes a stage's forward keeps (measured by :func:`fpipe.timeline.stage_memory`, or given)
and the parameter, gradient and optimiser bytes, a program's peak on each worker follows from
each worker's order alone, so it can be checked before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from fpipe.schedules.actions import Action, B, F, I, Program, R, W
from fpipe.schedules.costs import Cost, _cost, _items
from fpipe.schedules.validate import ScheduleError

__all__ = ["Memory", "peak_bytes", "check_memory"]

#: What a micro-batch's size scales (:meth:`Memory.scaled`).
PER_SAMPLE = ("activations", "inputs")


@dataclass(frozen=True)
class Memory:
    """Bytes, a number for all stages or a tuple with one per stage.

    - ``activations``: what the forward of one micro-batch keeps for its backward, its input
      included, alive from the forward until the backward ends (``B``, or the ``W`` of a split
      backward, which still reads them);
    - ``inputs``: one micro-batch's input to the stage, all that a forward keeps when the pair
      will be recomputed (until its ``R`` rebuilds the activations);
    - ``parameters``, ``gradients`` (default: as many as the parameters) and ``optimizer``
      (e.g. Adam's two moments: twice the parameters): held by the worker of each stage for
      the whole step;
    - ``workspace``: what a backward (``B`` or ``I``) of the stage allocates while it runs and
      frees at its end, above all else then alive: the gradients of the saved activations,
      about as large as the activations themselves (nothing measures it for you; 0 by
      default).

    ``per="model"`` gives the whole model's activations, workspace, parameters, gradients and
    optimiser bytes, split evenly over the program's stages; ``inputs`` are per stage either
    way. Not counted: buffers a transfer receives into, and what a split backward's graph
    keeps between ``I`` and ``W`` beyond the activations.
    """

    activations: Cost = 0.0
    inputs: Cost = 0.0
    parameters: Cost = 0.0
    gradients: Cost | None = None
    optimizer: Cost = 0.0
    workspace: Cost = 0.0
    per: str = "stage"

    def __post_init__(self) -> None:
        if self.per not in ("stage", "model"):
            raise ValueError(f"memory.per must be 'stage' or 'model', got {self.per!r}")
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "per" or value is None:
                continue
            value = _cost(field.name, value)
            if isinstance(value, tuple) and self.per == "model":
                raise ValueError(f"memory.{field.name} must be a single number with "
                                 f"per=model, got {value!r}")
            object.__setattr__(self, field.name, value)
        if self.gradients is None:
            object.__setattr__(self, "gradients", self.parameters)

    def for_stages(self, n_stages: int) -> Memory:
        """Per-stage bytes for a program of ``n_stages`` stages (a ValueError when a tuple
        does not have one entry per stage)."""
        if self.per == "model":
            return replace(self, per="stage", **{
                f.name: getattr(self, f.name) / n_stages for f in fields(self)
                if f.name not in ("per", "inputs")})  # an input is as large however cut
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple) and len(value) != n_stages:
                raise ValueError(f"memory.{field.name} has {len(value)} entries but the program "
                                 f"has {n_stages} stages")
        return self

    def scaled(self, factor: float) -> Memory:
        """Activations and inputs times ``factor`` (a micro-batch ``factor`` times as large);
        parameters, gradients and optimiser state kept."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"the factor must be a positive number, got {factor!r}")
        return replace(self, **{name: tuple(v * factor for v in _items(getattr(self, name)))
                                if isinstance(getattr(self, name), tuple)
                                else getattr(self, name) * factor for name in PER_SAMPLE})

    def of(self, name: str, stage: int) -> float:
        value = getattr(self, name)
        return value[stage] if isinstance(value, tuple) else value


def peak_bytes(program: Program, memory: Memory) -> tuple[int, ...]:
    """Each worker's peak bytes over ``program``: its stages' parameters, gradients and optimiser
    state, plus the most activation bytes alive at once in its order (see :class:`Memory`)."""
    return tuple(peak for peak, _, _ in _walks(program, memory))


def check_memory(program: Program, memory: Memory, budget: float) -> Program:
    """``program`` if every worker's peak (:func:`peak_bytes`) is within ``budget`` bytes, else
    a :class:`~fpipe.schedules.ScheduleError` under the rule ``memory-budget`` naming the first
    worker over it and the action at which it first goes over (none when its stages' state
    alone does)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
        raise ValueError(f"budget must be a non-negative number of bytes, got {budget!r}")
    from fpipe.schedules.validate import _in_context

    for worker, (peak, state, changes) in enumerate(_walks(program, memory)):
        if peak <= budget:
            continue
        live, at = state, None
        for position, (during, change) in enumerate(changes):
            if live + max(during, change) > budget:
                at = position
                break
            live += change
        action = program.workers[worker][at] if at is not None and state <= budget else None
        where = (f", first at {action}" if action is not None
                 else f"; its stages' state alone is {round(state):,}")
        raise _in_context(ScheduleError(
            "memory-budget", f"worker {worker} needs {peak:,} bytes at its peak "
            f"({peak / budget:.2f}x the budget of {int(budget):,}){where}",
            action, worker), program,
            [(worker, at)] if action is not None else [])
    return program


def _walks(program: Program,
           memory: Memory) -> list[tuple[int, float, list[tuple[float, float]]]]:
    """Per worker: peak bytes, its stages' state bytes, and each action's (bytes above the
    live ones while it runs, change once it has run)."""
    if not isinstance(memory, Memory):
        raise TypeError(f"memory must be a Memory value, got a {type(memory).__name__}")
    memory = memory.for_stages(program.n_stages)
    out = []
    for actions in program.workers:
        stages = {a.stage for a in actions}
        state = sum(memory.of(name, s) for s in stages
                    for name in ("parameters", "gradients", "optimizer"))
        changes = _changes(actions, memory)
        live = peak = 0.0
        for during, change in changes:
            peak = max(peak, live + during, live + change)
            live += change
        out.append((round(state + peak), state, changes))
    return out


def _changes(actions: tuple[Action, ...], memory: Memory) -> list[tuple[float, float]]:
    """Per action: the bytes above those alive that it holds while it runs (a backward's
    workspace), and how it changes the activation bytes alive on its worker (what a forward
    keeps counts from its start, what a backward frees from its end)."""
    backward = {(a.stage, a.microbatch) for a in actions if a.op is B or a.op is W}
    recomputed = {(a.stage, a.microbatch) for a in actions if a.op is R}

    def change(action: Action) -> tuple[float, float]:
        pair, stage = (action.stage, action.microbatch), action.stage
        if action.op is F:
            if pair not in backward:
                return 0.0, 0.0
            kept = memory.of("inputs" if pair in recomputed else "activations", stage)
            return kept, kept
        if action.op is R:
            rebuilt = memory.of("activations", stage) - memory.of("inputs", stage)
            return rebuilt, rebuilt
        workspace = memory.of("workspace", stage) if action.op in (B, I) else 0.0
        return workspace, -memory.of("activations", stage) if action.op is not I else 0.0

    return [change(a) for a in actions]
