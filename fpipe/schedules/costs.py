"""What each action costs, for :func:`fpipe.schedules.simulate`: given, derived, or fitted.

A simulation is only as true as its costs, and costs given in part are the easiest way to make
it lie: a split backward whose halves silently kept a default while the full backward was
given would make zero-bubble schedules look twice as good as they are. So :class:`Costs` never
mixes defaults with given values: what is not given is derived from what is, by rules stated
here, and :meth:`Costs.from_timeline` fits every cost to a recorded step.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace

from fpipe.schedules.actions import Action, B, F, I, Op, Overlap, R, W, _as_overlap
from fpipe.schedules.validate import dependencies

__all__ = ["Costs", "Cost"]

#: A cost for every stage, or one per stage.
Cost = float | tuple[float, ...]

#: The fields that are the time of an op: divided among stages (``per="model"``) and scaled
#: with the micro-batch (:meth:`Costs.scaled`), unlike ``overhead`` and ``latency``.
COMPUTE = ("forward", "backward", "backward_input", "backward_weight", "recompute")
SCOPES = ("stage", "model")
OVERLAPS = ("sum", "max")
STATISTICS = {"mean": statistics.fmean, "median": statistics.median}
#: The quantile of the free gaps (those of actions that need nothing from another worker)
#: above which an action that needs something from another worker counts as having waited.
_WAITED_ABOVE = 0.9


@dataclass(frozen=True)
class Costs:
    """Time of each op on one micro-batch, a number for all stages or a tuple with one per stage.

    What is not given is derived, never defaulted beside given values:

    - ``forward`` defaults to 1 (the unit of time);
    - ``backward`` (the full backward) defaults to ``backward_input + backward_weight`` when both
      halves are given, else to twice the forward (the usual rule of thumb: a backward does
      twice a forward's matmuls);
    - the halves of a split backward default to half the backward each; given one half, the
      other is the backward minus it (a ValueError if that is negative); given only one half
      and no backward, nothing can be derived, which is a ValueError too;
    - ``recompute`` defaults to ``forward``.

    All three of ``backward``, ``backward_input`` and ``backward_weight`` may be given: measured
    halves often add up to more than the fused backward, and each is used for its own op.

    ``transfer`` is the time to carry a result of a stage (its activation, or its input
    gradient) to another worker, in proportion to its size; ``latency`` is added to every such
    transfer whatever its size; a dependency on the same worker costs nothing to reach.
    ``overhead`` is the driver's time between two actions of a worker (dispatch, hand-offs),
    charged before each action unless the worker waits for an input anyway.

    ``overlap`` is what a forward and a backward run as one unit (an
    :class:`~fpipe.schedules.Overlap`, DualPipeV's pairs) cost: ``"sum"`` (the default) their
    two costs one after the other, as fpipe runs them, on one stream; ``"max"`` the longer of
    the two, as where they truly overlap (DeepSeek's two streams, communication hidden).

    ``unmeasured`` holds ``(name, stage)`` for each op cost that :meth:`from_timeline` derived
    rather than measured (``stage`` ``None`` once the costs are for the whole model);
    :func:`~fpipe.schedules.simulate` warns when it prices a recompute with such a cost (a
    recompute measured 1.3-1.9x a forward where costs assumed one forward).

    ``per="stage"`` (the default) gives the costs of one stage; ``per="model"`` those of the
    whole model, split evenly over the stages of the program simulated, so one value compares
    schedules with one stage per worker to those with several (interleaved, ZB-V): a program of
    8 stages runs each at an eighth of the model's costs. Model costs are numbers, not tuples;
    ``transfer``, ``latency`` and ``overhead`` are never divided (an activation between two
    stages is as large however the model is cut).
    """

    forward: Cost | None = None
    backward: Cost | None = None
    backward_input: Cost | None = None
    backward_weight: Cost | None = None
    recompute: Cost | None = None
    transfer: Cost = 0.0
    overhead: float = 0.0
    latency: float = 0.0
    per: str = "stage"
    overlap: str = "sum"
    unmeasured: frozenset[tuple[str, int | None]] = frozenset()

    def __post_init__(self) -> None:
        if self.per not in SCOPES:
            raise ValueError(f"costs.per must be 'stage' or 'model', got {self.per!r}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"costs.overlap must be 'sum' or 'max', got {self.overlap!r}")
        try:
            unmeasured = frozenset((name, stage) for name, stage in self.unmeasured)
        except (TypeError, ValueError):
            unmeasured = None
        if unmeasured is None or any(name not in COMPUTE or not (
                stage is None or isinstance(stage, int)) for name, stage in unmeasured):
            raise ValueError(f"costs.unmeasured holds (op cost's name, stage) pairs, names "
                             f"among {', '.join(COMPUTE)}, got {self.unmeasured!r}")
        object.__setattr__(self, "unmeasured", unmeasured)
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name not in ("per", "overlap", "unmeasured") and value is not None:
                value = _cost(field.name, value)
                if isinstance(value, tuple) and (field.name in ("overhead", "latency")
                                                 or self.per == "model"):
                    raise ValueError(f"costs.{field.name} must be a single number"
                                     f"{' with per=model' if self.per == 'model' else ''}, "
                                     f"got {value!r}")
                object.__setattr__(self, field.name, value)
        self._derive()

    def _derive(self) -> None:
        """Fill the op costs that were not given from those that were (see the class doc)."""
        def set_(name: str, value: Cost) -> None:
            object.__setattr__(self, name, value)

        if self.forward is None:
            set_("forward", 1.0)
        given_i, given_w = self.backward_input is not None, self.backward_weight is not None
        if self.backward is None:
            if given_i and given_w:
                set_("backward", _map(lambda i, w: i + w, self.backward_input,
                                      self.backward_weight))
            elif given_i or given_w:
                raise ValueError(
                    f"costs give backward_{'input' if given_i else 'weight'} but neither the "
                    f"other half nor backward: give both halves (backward is then their sum), "
                    f"or backward too (the other half is then the difference)")
            else:
                set_("backward", _map(lambda f: 2.0 * f, self.forward))
        if not given_i and not given_w:
            half = _map(lambda b: b / 2.0, self.backward)
            set_("backward_input", half)
            set_("backward_weight", half)
        elif given_i != given_w:
            known, missing = (("backward_input", "backward_weight") if given_i
                              else ("backward_weight", "backward_input"))
            rest = _map(lambda b, k: b - k, self.backward, getattr(self, known))
            if min(_items(rest)) < -1e-12 * max(_items(self.backward)):
                raise ValueError(f"costs.{known} ({getattr(self, known)!r}) exceeds costs."
                                 f"backward ({self.backward!r}): {missing} would be negative")
            set_(missing, _map(lambda r: max(r, 0.0), rest))
        if self.recompute is None:
            set_("recompute", self.forward)

    def of(self, op: Op, stage: int) -> float:
        """The time ``op`` takes on ``stage`` (for costs ``per="stage"``)."""
        cost = {F: self.forward, B: self.backward, I: self.backward_input,
                W: self.backward_weight, R: self.recompute}[op]
        return cost[stage] if isinstance(cost, tuple) else cost  # type: ignore[index,return-value]

    def carry(self, stage: int) -> float:
        """The time to bring a result of ``stage`` to another worker: transfer plus latency."""
        transfer = self.transfer[stage] if isinstance(self.transfer, tuple) else self.transfer
        return transfer + self.latency

    def for_stages(self, n_stages: int) -> Costs:
        """These costs for a program of ``n_stages`` stages, per stage: model costs divided
        evenly, stage costs checked to have one entry per stage (a ValueError otherwise)."""
        if self.per == "model":
            return replace(self, per="stage", **{
                name: getattr(self, name) / n_stages for name in COMPUTE})
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple) and len(value) != n_stages:
                raise ValueError(
                    f"costs.{field.name} has {len(value)} entries but the program has "
                    f"{n_stages} stages"
                )
        return self

    def check_stages(self, n_stages: int) -> None:
        """Raise a ValueError if a per-stage tuple does not have one entry per stage."""
        self.for_stages(n_stages)

    def scaled(self, factor: float) -> Costs:
        """The op times and ``transfer`` multiplied by ``factor``; ``overhead`` and ``latency``
        kept: the costs of a micro-batch ``factor`` times as large, if time follows size."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"the factor must be a positive number, got {factor!r}")
        return replace(self, **{name: _map(lambda c: c * factor, getattr(self, name))
                                for name in (*COMPUTE, "transfer")})

    def as_model(self, n_stages: int) -> Costs:
        """The same costs for the whole model (``per="model"``): each op's time summed over
        the ``n_stages`` stages, so programs with other stage counts can use them."""
        stage = self.for_stages(n_stages)

        def total(cost: Cost) -> float:
            return sum(cost) if isinstance(cost, tuple) else cost * n_stages

        return replace(stage, per="model", **{name: total(getattr(stage, name))
                                              for name in COMPUTE},
                       unmeasured=frozenset((name, None) for name, _ in stage.unmeasured))

    @classmethod
    def from_timeline(cls, *timelines: Sequence[Sequence[object]], n_stages: int | None = None,
                      statistic: str = "mean", overlaps: Iterable[Overlap | str] = ()) -> Costs:
        """Costs fitted to one or more recorded steps (``Recorder.timeline``, or
        ``*recorder.steps``), per stage, in the timelines' unit (seconds for a recorder).

        - Each op's cost on each stage is the mean of its recorded durations (with
          ``statistic="median"``, their median). The mean is the default because a step's
          time is a sum of durations: the rare slow action (a preempted thread, a slow
          hand-off) costs the step what it costs, however rare; the median describes the
          typical action instead. Ops the steps did not run are derived as in the class doc:
          split backwards give ``backward = backward_input + backward_weight``, full ones give
          halves of ``backward``, and without recomputes ``recompute = forward``; their
          names are in ``unmeasured``.
        - ``overhead`` is the mean (or median) gap between an action and the one before it on
          its worker (or the step's start), over the actions that had nothing to wait for from
          another worker.
        - ``latency`` is the mean (or median) of how long after its input's end an action that
          waited for it started; a recorded step cannot tell a transfer's fixed latency from
          its size-proportional part, so ``transfer`` is 0 and all of it is in ``latency``.
          An action waited if its gap exceeds 90% of the free gaps (and the overhead): a
          measured gap a little over the typical one is the driver's jitter, while its input
          may have ended long before (the worker was busy), which read as a wait made the
          latency of 4 stages on 2 workers ten times too long (3.4 ms against 0.3).
        - ``overlaps``: the program's overlapped pairs (``program.overlaps``), which a timeline
          does not show. A pair is one unit: its forward waited for its backward's inputs too,
          and its backward for nothing more, so the forward's wait counts from the later of
          both inputs, and the backward's gap is overhead (``"sum"``) or none at all
          (``"max"``, where it started with the forward). ``overlap`` is ``"max"`` when every
          pair's backward started before its forward ended (or with it: they ran at once),
          else ``"sum"``; the worker is free after the later of the two ends.

        Simulating the recorded program under the result reproduces a timeline made by the
        simulator exactly; for a measured one, see docs/choosing-a-schedule.md for how close.
        """
        if not timelines:
            raise ValueError("from_timeline needs at least one timeline")
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be 'mean' or 'median', got {statistic!r}")
        average = STATISTICS[statistic]
        rows = [[_span(s) for s in row] for timeline in timelines for row in _rows(timeline)]
        if not any(rows):
            raise ValueError("the timelines hold no actions")
        durations: dict[tuple[Op, int], list[float]] = defaultdict(list)
        for row in rows:
            for action, start, end in row:
                durations[action.op, action.stage].append(end - start)
        stages = 1 + max(stage for _, stage in durations)
        n_stages = stages if n_stages is None else n_stages
        if stages > n_stages:
            raise ValueError(f"the timelines hold stage {stages - 1}, beyond n_stages={n_stages}")
        durations_of = {key: average(values) for key, values in durations.items()}
        missing = [s for s in range(n_stages) if (F, s) not in durations_of]
        if missing:
            raise ValueError(f"the timelines hold no forward of stage(s) {missing}: cannot fit "
                             f"costs.forward for every stage")
        ops: dict[str, list[float]] = {name: [] for name in COMPUTE}
        for s in range(n_stages):
            stage = Costs(**{name: durations_of.get((op, s)) for op, name in zip((F, B, I, W, R),
                                                                           COMPUTE)})
            for name in COMPUTE:
                ops[name].append(getattr(stage, name))
        pairs = {o.forward: o.backward for o in map(_as_overlap, overlaps)}
        overhead, latency, overlap = _gaps(timelines, n_stages, average, pairs)
        unmeasured = {(name, s) for op, name in zip((F, B, I, W, R), COMPUTE)
                      for s in range(n_stages) if (op, s) not in durations_of}
        return cls(**{name: tuple(values) for name, values in ops.items()},
                   overhead=overhead, latency=latency, overlap=overlap,
                   unmeasured=frozenset(unmeasured))


def _gaps(timelines: Sequence[Sequence[Sequence[object]]], n_stages: int,
          average: Callable[[list[float]], float],
          pairs: dict[Action, Action]) -> tuple[float, float, str]:
    """The overhead between actions, the wait for another worker's input, averaged, and how
    the overlapped ``pairs`` (forward -> backward) ran.

    Each action has its gap (from the end of the one before it on its worker, or from the
    step's start) and, if it needs a result from another worker, the time since the last such
    result ended. Gaps of actions that need nothing from another worker are pure overhead;
    an action whose gap exceeds the overhead waited for its input, and that wait is latency.
    A pair's forward needs its backward's inputs too; its backward needs nothing: its gap is
    overhead under ``"sum"``, and under ``"max"`` (it started with the forward) it has none.
    """
    rows_of = [[[_span(s) for s in row] for row in _rows(timeline)] for timeline in timelines]
    at_once = [_ran_at_once(row, i, pairs) for rows in rows_of for row in rows
               for i, (action, _, _) in enumerate(row) if action in pairs]
    overlap = "max" if at_once and all(at_once) else "sum"
    paired = set(pairs.values())
    observed = []  # (gap, time since the last remote input ended, or None)
    for rows in rows_of:
        where = {a: w for w, row in enumerate(rows) for a, _, _ in row}
        ends = {a: end for row in rows for a, _, end in row}
        present = frozenset(where)
        for w, row in enumerate(rows):
            before = 0.0
            for action, start, end in row:
                if action in paired:  # its inputs were awaited by its forward
                    if overlap == "sum":
                        observed.append((start - before, None))
                else:
                    needs = [need for unit in (action, pairs.get(action)) if unit is not None
                             for need, _ in dependencies(unit, present, n_stages)]
                    remote = [ends[need] for need in needs if need in where and where[need] != w]
                    observed.append((start - before, start - max(remote) if remote else None))
                before = max(before, end)  # a pair's worker is free after its later end
    free = sorted(gap for gap, wait in observed if wait is None)
    overhead = max(average(free), 0.0) if free else 0.0
    # A gap within the spread of the free ones is the driver's, whatever came from elsewhere
    # (its input had arrived while the worker was busy): only a longer one was a wait.
    jitter = free[int(_WAITED_ABOVE * (len(free) - 1))] if free else 0.0
    tolerance = 1e-9 * max(1.0, overhead)
    waited = [wait for gap, wait in observed
              if wait is not None and gap > max(overhead, jitter) + tolerance]
    return overhead, max(average(waited), 0.0) if waited else 0.0, overlap


def _ran_at_once(row: list, i: int, pairs: dict[Action, Action]) -> bool:
    """Whether the pair whose forward is ``row[i]`` ran at once: its backward, which must be
    the next span on the worker, started before the forward ended or with it."""
    forward, start, end = row[i]
    if i + 1 == len(row) or row[i + 1][0] != pairs[forward]:
        raise ValueError(f"the timeline does not hold the overlapped pair "
                         f"{Overlap(forward, pairs[forward])}: its backward must be the span "
                         f"right after its forward on the worker")
    b_start = row[i + 1][1]
    return b_start < end or b_start <= start


def _rows(timeline: object) -> list:
    if isinstance(timeline, (str, bytes)) or not isinstance(timeline, Sequence):
        raise TypeError(f"a timeline is, per worker, a sequence of spans (action, start, end); "
                        f"got {type(timeline).__name__}")
    return list(timeline)


def _span(span: object) -> tuple[Action, float, float]:
    try:
        action, start, end = span.action, span.start, span.end  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"a timeline holds spans with action, start and end; got {span!r}") \
            from None
    if not (math.isfinite(start) and math.isfinite(end)) or end < start:
        raise ValueError(f"span of {action} runs from {start} to {end}")
    return action, float(start), float(end)


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


def _items(cost: Cost) -> tuple[float, ...]:
    return cost if isinstance(cost, tuple) else (cost,)


def _map(fn: Callable[..., float], *costs: Cost) -> Cost:
    """``fn`` applied stage by stage; a tuple if any argument is one (lengths must agree)."""
    lengths = {len(c) for c in costs if isinstance(c, tuple)}
    if not lengths:
        return fn(*costs)
    if len(lengths) > 1:
        raise ValueError(f"per-stage costs of different lengths: {sorted(lengths)}")
    n = lengths.pop()
    return tuple(fn(*(c[s] if isinstance(c, tuple) else c for c in costs)) for s in range(n))
