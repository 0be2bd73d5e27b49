"""Orders for the V (2K stages on K workers, worker w holding stages w and 2K-1-w) that hold up
when handing a result to another worker takes time.

The unit-step V order (:func:`~fpipe.schedules.zero_bubble.v_shape_order`) is perfect when
F, I and W cost the same and a hand-off is free, but it packs forwards tightly, so any hand-off
latency shows up as idle time in the middle of the step. Two things help: the zero-bubble
paper's hand-written V (its Figure 5: in the steady state each worker runs a forward, an ``I``
and a ``W`` of each of its stages in turn, the ``W`` leaving room for the next input to
arrive), which is :class:`~fpipe.schedules.ZeroBubbleV`'s order without costs, and moving each
``W``, which nothing waits for, into the waits that the costs predict. Which is best depends on
the costs, so :class:`~fpipe.schedules.ZeroBubbleV` given costs simulates them all and keeps
the fastest.
"""

from __future__ import annotations

from collections import deque

from fpipe.schedules.actions import Action, F, I, Program, W
from fpipe.schedules.costs import Costs
from fpipe.schedules.validate import dependencies

__all__ = ["handcrafted_v", "fill_weight_gradients"]


def handcrafted_v(chunks: int, n_workers: int) -> Program:
    """The paper's hand-written ZB-V, in the phases :func:`_worker_phases` lists.

    The pattern is written for at least 2K-1 micro-batches; with fewer, it is laid out for
    2K-1 and the actions of the micro-batches that do not exist are left out, which keeps
    every dependency and every worker's order (the same device torch's ZB-V uses).
    """
    laid_out = max(chunks, 2 * n_workers - 1)
    workers = [[a for a in _worker_phases(w, n_workers, laid_out) if a.microbatch < chunks]
               for w in range(n_workers)]
    return Program(workers, 2 * n_workers, chunks)


def _worker_phases(w: int, k: int, chunks: int) -> list[Action]:
    """Worker ``w``'s actions: 2(K-w)-1 forwards of its first stage; w pairs of forwards
    (second stage, then first); K-w rounds of F, I, W of its second stage; the steady state,
    F, I, W of the first stage then of the second; the drain, w pairs of ``I`` (first,
    second), K-w of ``I`` and ``W`` of the first stage; the ``W`` left, second stage first."""
    first, second = w, 2 * k - 1 - w
    counts = {(s, op): 0 for s in (first, second) for op in (F, I, W)}
    out: list[Action] = []

    def put(stage: int, *ops: object) -> None:
        for op in ops:
            out.append(Action(stage, op, counts[stage, op]))  # type: ignore[arg-type]
            counts[stage, op] += 1  # type: ignore[index]

    for _ in range(2 * (k - w) - 1):
        put(first, F)
    for _ in range(w):
        put(second, F)
        put(first, F)
    for _ in range(k - w):
        put(second, F, I, W)
    while counts[second, F] < counts[first, F] or counts[first, F] < chunks:
        put(first, *((F,) if counts[first, F] < chunks else ()), I, W)
        put(second, F, I, W)
    for _ in range(w):
        put(first, I)
        put(second, I)
    for _ in range(k - w):
        put(first, I, W)
    for stage in (second, first):
        while counts[stage, W] < counts[stage, I]:
            put(stage, W)
    return out


def fill_weight_gradients(program: Program, costs: Costs, cap: int,
                          slack: float = 1.0) -> Program:
    """``program`` with each worker's forwards and input gradients in their order, and each
    ``W`` moved to where the costs say the worker would otherwise wait.

    Time runs forward as in :func:`~fpipe.schedules.simulate`. A free worker runs its oldest
    pending ``W`` (micro-batch order per stage) when its next action's input arrives at least
    ``slack`` times that ``W``'s cost later, when that input does not exist yet, or when the
    next action is a forward and the worker already holds ``cap`` live pairs; else it runs its
    next action. A smaller ``slack`` lets a ``W`` delay the next action by up to
    ``1 - slack`` of its cost, which pays when latency is short. The result records an
    execution, so it is valid whenever ``program`` is.
    """
    present = frozenset(a for actions in program.workers for a in actions)
    other = next((a for actions in program.workers for a in actions
                  if a.op not in (F, I, W)), None)
    if other is not None:
        raise ValueError(f"fill_weight_gradients moves the W of a split backward; {other} is "
                         f"neither F, I nor W (apply remat after it)")
    costs = costs.for_stages(program.n_stages)
    state = _Fill(program, costs, present)
    while state.left:
        events = [e for w in range(program.n_workers)
                  if (e := state.next_event(w, cap, slack)) is not None]
        start, w, action = min(events, key=lambda e: (e[0], e[1]))
        state.run(w, action, start)
    return Program(state.order, program.n_stages, program.n_microbatches)


class _Fill:
    """The state of :func:`fill_weight_gradients`: per worker, its next non-W action, its
    pending ``W`` actions, when it is free, how many pairs it holds, and every action's end."""

    def __init__(self, program: Program, costs: Costs, present: frozenset[Action]) -> None:
        self.program, self.costs, self.present = program, costs, present
        self.main = [[a for a in actions if a.op is not W] for actions in program.workers]
        self.at = [0] * program.n_workers
        self.pending: list[deque[Action]] = [deque() for _ in program.workers]
        self.free = [0.0] * program.n_workers
        self.live = [0] * program.n_workers
        self.ends: dict[Action, float] = {}
        self.order: list[list[Action]] = [[] for _ in program.workers]
        self.left = len(present)
        placement = program.placement
        self.needs = {a: [(need, costs.carry(need.stage)
                           if placement[need.stage] != placement[a.stage] else 0.0)
                          for need, _ in dependencies(a, present, program.n_stages)]
                      for a in present if a.op is not W}

    def arrival(self, action: Action) -> float | None:
        """When ``action``'s inputs are all on its worker (None if one has not run)."""
        times = []
        for need, carry in self.needs[action]:
            if need not in self.ends:
                return None
            times.append(self.ends[need] + carry)
        return max(times, default=0.0)

    def next_event(self, w: int, cap: int, slack: float) -> tuple[float, int, Action] | None:
        action = self.main[w][self.at[w]] if self.at[w] < len(self.main[w]) else None
        weight = self.pending[w][0] if self.pending[w] else None
        if action is None:
            return None if weight is None else (self.free[w], w, weight)
        arrives = self.arrival(action)
        if weight is not None:
            gap = None if arrives is None else arrives - self.free[w]
            full = action.op is F and self.live[w] >= cap
            if full or gap is None or gap >= slack * self.costs.of(W, weight.stage) - 1e-12:
                return self.free[w], w, weight
        return None if arrives is None else (max(self.free[w], arrives), w, action)

    def run(self, w: int, action: Action, start: float) -> None:
        self.free[w] = self.ends[action] = start + self.costs.of(action.op, action.stage)
        self.order[w].append(action)
        self.left -= 1
        if action.op is W:
            self.pending[w].popleft()
            self.live[w] -= 1
            return
        self.at[w] += 1
        if action.op is I:
            self.pending[w].append(Action(action.stage, W, action.microbatch))
        elif action.op is F:
            self.live[w] += 1
