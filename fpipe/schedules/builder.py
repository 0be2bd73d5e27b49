"""Schedules from rules: a per-worker priority and an in-flight cap, turned into a program by
list scheduling over the dependency graph.

V-shaped, look-ahead and other research schedules are usually written as index arithmetic per
worker, which is easy to get wrong and hard to vary. Here a schedule is a rule instead: each
time a worker is free, it runs, of the actions whose inputs have arrived, the one its priority
ranks first; a forward waits while the worker already holds its cap of live pairs (a live
pair: a (stage, micro-batch) forwarded on the worker, its backward not finished).
Running this under costs records an execution, so the program is valid by construction, and
no cap can make it hang (see :func:`list_schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fpipe.schedules.actions import Action, B, F, I, Op, Program, W, positive_int, stage_count
from fpipe.schedules.costs import Costs
from fpipe.schedules.remat import RematPolicy, apply_remat, check_fields

__all__ = ["list_schedule", "Rule", "backward_first", "forward_first", "ListScheduled"]

#: A priority rule: ``rule(action, worker)`` -> a key; the worker runs the ready action with
#: the least key (ties: the stage's lower index). Keys of one worker must be comparable.
Rule = Callable[[Action, int], object]


def backward_first(action: Action, worker: int) -> tuple:
    """1F1B's rule: an input gradient (``B`` or ``I``) first, as it unblocks the previous
    stage; then a forward, of the deepest stage first (the one closest to the turn); a ``W``,
    which nothing waits for, only when nothing else is ready. Older micro-batches first."""
    rank = {B: 0, I: 0, F: 1, W: 2}[action.op]
    return (rank, action.microbatch, -action.stage if action.op is F else action.stage)


def forward_first(action: Action, worker: int) -> tuple:
    """GPipe's and breadth-first looping's rule: every forward that is ready before any
    backward, shallower stages first; backwards of the deepest stage first."""
    rank = {F: 0, B: 1, I: 1, W: 2}[action.op]
    return (rank, action.stage if action.op is F else -action.stage, action.microbatch)


def list_schedule(n_stages: int, chunks: int, placement: Sequence[int], *,
                  rule: Rule = backward_first, in_flight: int | Sequence[int] | None = None,
                  split_backward: bool = False, costs: Costs | None = None) -> Program:
    """The program that list scheduling under ``costs`` (default ``Costs()``) records.

    - ``placement[s]``: the worker of stage ``s`` (workers numbered from 0, none left empty).
    - ``rule``: the per-worker priority (:data:`Rule`); :func:`backward_first` by default.
    - ``in_flight``: each worker's cap on live pairs, the (stage, micro-batch) pairs it has
      forwarded and not finished the backward of (``B``, or the ``W`` of a split backward):
      what :attr:`~fpipe.schedules.Simulation.peak_activations` counts. One number for all
      or one per worker; ``None``, no cap. A worker holding two stages of one micro-batch
      holds two pairs.
    - ``split_backward``: ``I`` and ``W`` instead of ``B``.

    Each stage runs its forwards, its backwards and its ``W`` in micro-batch order (so
    gradients sum in the same order as in every shipped schedule); the rule chooses among the
    stages' next actions. Time runs forward: whenever a worker is free, it takes the
    first-ranked action whose inputs have arrived (an action on another worker's stage counts
    from its end plus ``costs.carry``), or waits for the first to arrive.

    The cap is hard: no worker ever holds more live pairs than its cap. A forward runs only
    if, after it, the worker could still finish every micro-batch it holds, oldest first
    (a banker's check: a V's worker keeps room for the way back up of the micro-batches it
    sent down). What a micro-batch waits for is older and finishes first, so the oldest not
    finished can always go on and nothing hangs, as long as each cap holds one
    micro-batch's stages on its worker; a smaller cap is a ValueError. The actions run form
    an execution, which is what validity means.
    """
    n_stages = stage_count(n_stages)
    positive_int("chunks", chunks)
    workers = _check_placement(placement, n_stages)
    caps = _caps(in_flight, workers)
    costs = (Costs() if costs is None else costs).for_stages(n_stages)
    ops = (F, I, W) if split_backward else (F, B)
    state = _State(n_stages, chunks, tuple(placement), workers, ops, caps)
    free = [0.0] * workers
    order: list[list[Action]] = [[] for _ in range(workers)]
    while state.left:
        events = []
        for w in range(workers):
            choice = state.choose(w, free[w], rule, costs)
            if choice is not None:
                events.append((choice[0], w, choice[1]))
        if not events:  # cannot happen (see the docstring): say so rather than loop
            raise RuntimeError("list_schedule found no action to run; please report this")
        start, w, action = min(events, key=lambda e: (e[0], e[1]))
        end = start + costs.of(action.op, action.stage)
        state.done(action, end, w)
        free[w] = end
        order[w].append(action)
    return Program(order, n_stages, chunks)


class _State:
    """Which action each stage runs next, per op, and when each result is available."""

    def __init__(self, n_stages: int, chunks: int, placement: tuple[int, ...], workers: int,
                 ops: tuple[Op, ...], caps: list[float]) -> None:
        self.n_stages, self.chunks, self.placement, self.ops = n_stages, chunks, placement, ops
        self.next = {(s, op): 0 for s in range(n_stages) for op in ops}
        self.ends: dict[Action, tuple[float, int]] = {}
        self.mine = [[s for s in range(n_stages) if placement[s] == w] for w in range(workers)]
        self.left = n_stages * chunks * len(ops)
        self.caps = caps
        #: Per worker, for each micro-batch it holds or has begun: [live pairs, forwards left].
        self.holds: list[dict[int, list[int]]] = [{} for _ in range(workers)]
        for w, (cap, stages) in enumerate(zip(caps, self.mine, strict=True)):
            if cap < len(stages):
                raise ValueError(
                    f"in_flight cap {cap} of worker {w} is less than the {len(stages)} stages "
                    f"a micro-batch holds alive there ({stages}): no micro-batch could pass")

    def room(self, action: Action) -> bool:
        """Whether ``action`` may run now: anything but a forward may; a forward may if, with
        it run, the worker stays within its cap and can still finish what it holds, oldest
        micro-batch first (each, once its forwards there are done, frees all it held)."""
        if action.op is not F:
            return True
        w, m = self.placement[action.stage], action.microbatch
        holds = self.holds[w]
        live, left = holds.get(m, (0, len(self.mine[w])))
        room = self.caps[w] - sum(h[0] for h in holds.values()) - 1
        if room < 0:
            return False
        for mb in sorted({*holds, m}):
            held, need = (live + 1, left - 1) if mb == m else holds[mb]
            if need > room:
                return False
            room += held
        return True

    def candidates(self, worker: int) -> list[Action]:
        """The next action of each op on each of ``worker``'s stages whose inputs exist."""
        out = []
        for s in self.mine[worker]:
            for op in self.ops:
                m = self.next[s, op]
                if m < self.chunks and all(need in self.ends for need in self.needs(
                        Action(s, op, m))):
                    out.append(Action(s, op, m))
        return out

    def needs(self, action: Action) -> list[Action]:
        s, m = action.stage, action.microbatch
        if action.op is F:
            return [Action(s - 1, F, m)] if s else []
        if action.op is W:
            return [Action(s, I, m)]
        later = [Action(s + 1, action.op, m)] if s + 1 < self.n_stages else []
        return [Action(s, F, m), *later]

    def ready_time(self, action: Action, costs: Costs) -> float:
        worker = self.placement[action.stage]
        times = [end + (costs.carry(need.stage) if where != worker else 0.0)
                 for need in self.needs(action) for end, where in [self.ends[need]]]
        return max(times, default=0.0)

    def choose(self, worker: int, free: float, rule: Rule,
               costs: Costs) -> tuple[float, Action] | None:
        """When ``worker`` starts its next action and which: the first-ranked of those ready
        when it starts (forwards only with :meth:`room`)."""
        ready = [(self.ready_time(a, costs), a) for a in self.candidates(worker)
                 if self.room(a)]
        if not ready:
            return None
        start = max(free, min(t for t, _ in ready))
        now = [a for t, a in ready if t <= start]
        return start, min(now, key=lambda a: (rule(a, worker), a.stage))

    def done(self, action: Action, end: float, worker: int) -> None:
        self.ends[action] = (end, worker)
        self.next[action.stage, action.op] += 1
        self.left -= 1
        holds, m = self.holds[worker], action.microbatch
        if action.op is F:
            live, left = holds.get(m, (0, len(self.mine[worker])))
            holds[m] = [live + 1, left - 1]
        elif action.op is B or action.op is W:
            holds[m][0] -= 1
            if holds[m] == [0, 0]:
                del holds[m]


def _check_placement(placement: Sequence[int], n_stages: int) -> int:
    placement = list(placement)
    if len(placement) != n_stages:
        raise ValueError(f"placement has {len(placement)} entries but there are {n_stages} "
                         f"stages")
    used = sorted(set(placement))
    if used != list(range(len(used))) or any(isinstance(w, bool) for w in placement):
        raise ValueError(f"placement must number workers 0, 1, ... with none left out, got "
                         f"{placement}")
    return len(used)


def _caps(in_flight: int | Sequence[int] | None, workers: int) -> list[float]:
    if in_flight is None:
        return [float("inf")] * workers
    if isinstance(in_flight, int):
        return [positive_int("in_flight", in_flight)] * workers
    caps = [positive_int("in_flight", c) for c in in_flight]
    if len(caps) != workers:
        raise ValueError(f"in_flight has {len(caps)} caps but there are {workers} workers")
    return caps  # type: ignore[return-value]


@dataclass(frozen=True)
class ListScheduled:
    """A schedule value built by :func:`list_schedule` for any stage count: ``placement``
    maps (stage, n_stages) to a worker, ``in_flight`` maps (worker, n_workers) to its cap;
    ``costs`` (default ``Costs()``) are those the list scheduling runs under."""

    chunks: int
    placement: Callable[[int, int], int]
    rule: Rule = backward_first
    in_flight: Callable[[int, int], int] | None = None
    split_backward: bool = False
    remat: RematPolicy = "never"
    costs: Costs | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.costs is not None and not isinstance(self.costs, Costs):
            raise TypeError(f"ListScheduled's costs must be a Costs value or None, got a "
                            f"{type(self.costs).__name__}")

    def program(self, n_stages: int) -> Program:
        n_stages = stage_count(n_stages)
        where = [self.placement(s, n_stages) for s in range(n_stages)]
        workers = len(set(where))
        caps = (None if self.in_flight is None
                else [self.in_flight(w, workers) for w in range(workers)])
        program = list_schedule(n_stages, self.chunks, where, rule=self.rule, in_flight=caps,
                                split_backward=self.split_backward, costs=self.costs)
        return apply_remat(program, self.remat)
