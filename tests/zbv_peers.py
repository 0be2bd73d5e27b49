"""The ZB-V orders fpipe's is compared with: torch's, taken from torch itself, and the
zero-bubble authors', re-derived here from reading their heuristic.

The authors' order is made by ``PipelineGraph.try_v_schedule`` and ``create_schedule`` in
sail-sg/zero-bubble-pipeline-parallelism, megatron/core/pipeline_parallel/zerobubble/scheduler/
zbv.py: a greedy that places each worker's actions in simulated time under the costs (F, B, W
and a hand-off cost ``c``), in three phases (fill, the rest of the warm-up, then rounds of one
backward and one forward per worker, with W actions slotted into the waits), retried with each
worker allowed the largest bubble of the previous try, and over the four choices of filling
waits before B and F. What follows is our reading of it, written for these tests: their
internal numbering (a worker's ``chunk`` 0 / 1 is its first / second stage for forwards and
the reverse for backwards; memory F +2, B -1, W -1, at most 4K) is kept so that the rules can
be checked against the source line by line.
"""

from __future__ import annotations

import types
from collections import deque

from fpipe.schedules import Action, Program

F_, B_, W_ = 0, 1, 2
MEMORY = (2, -1, -1)


def torch_zero_bubble_v(n_workers: int, chunks: int) -> Program:
    """``ScheduleZBVZeroBubble``'s order, from torch's own per-rank computation (it needs no
    process group: it reads the group size, the stage count and the micro-batch count)."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    fake = types.SimpleNamespace(pp_group_size=n_workers, _n_microbatches=chunks,
                                 num_stages=2 * n_workers)
    workers = [[Action.parse(str(a)) for a in
                ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, rank)
                if a is not None] for rank in range(n_workers)]
    return Program(workers, 2 * n_workers, chunks)


class _Try:
    """One ``try_v_schedule``: the actions placed so far and their times."""

    def __init__(self, p: int, m: int, cost: tuple[float, float, float], c: float,
                 fill_f: bool, fill_b: bool, approved: list[float] | None) -> None:
        self.p, self.m, self.cost, self.c = p, m, cost, c
        self.fill_f, self.fill_b = fill_f, fill_b
        self.approved = approved or [-1.0] * p
        self.count = [[0] * 6 for _ in range(p)]
        self.end: dict[tuple[int, int, int, int], float] = {}
        self.cur = [0.0] * p
        self.mem = [0] * p
        self.bubble = [0.0] * p
        self.pending: list[deque[int]] = [deque() for _ in range(p)]
        self.order: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]

    def ended(self, key: tuple[int, int, int, int] | None) -> float:
        return -1.0 if key is None else self.end.get(key, -1.0)

    def max_bubble(self, w: int = -1) -> float:
        most = max(self.bubble)
        if w >= 0:
            most = max(most, max(self.approved) - self.approved[w])
        return most

    def put(self, cat: int, chunk: int, w: int) -> None:
        n = self.count[w][cat * 2 + chunk]
        assert n < self.m
        earliest = end = self.cur[w] + self.cost[cat]
        if cat < 2:
            dep = self.neighbour(cat, chunk, w, n)
            if dep is not None:
                end = max(end, self.end[dep] + self.c + self.cost[cat])
        if self.count[w][0] > 0:
            self.bubble[w] += end - earliest
        self.end[cat, chunk, w, n] = end
        self.cur[w] = end
        self.mem[w] += MEMORY[cat]
        self.order[w].append((cat, chunk, n))
        if cat == B_:
            self.pending[w].append(chunk)
        self.count[w][cat * 2 + chunk] += 1

    def neighbour(self, cat: int, chunk: int, w: int, n: int) -> tuple | None:
        """The action on the next worker this one waits for (chunk 1 from w+1, 0 from w-1)."""
        if chunk == 1 and w < self.p - 1:
            return (cat, 1, w + 1, n)
        if chunk == 0 and w > 0:
            return (cat, 0, w - 1, n)
        return None

    def put_w(self, w: int) -> None:
        self.put(W_, self.pending[w].popleft(), w)

    def fill(self, w: int, dep: tuple | None, fill: bool) -> None:
        """W actions into the wait for ``dep``, and one more if the wait exceeds the bubble
        this worker is still allowed."""
        while self.pending[w] and dep is not None and (
                self.ended(dep) + self.c >= self.cur[w] + self.cost[W_]):
            self.put_w(w)
        if self.pending[w] and (self.ended(dep) + self.c - self.cur[w]
                                > self.max_bubble(w) - self.bubble[w]) and fill:
            self.put_w(w)

    def warm_up(self) -> None:
        p, m, count = self.p, self.m, self.count
        for w in range(p):
            self.put(F_, 0, w)
        for w in range(p - 1, -1, -1):
            if w < p - 1:
                turn = self.end[F_, 1, w + 1, 0] + self.c
                while (self.mem[w] + MEMORY[F_] * (2 + 2 * w) <= 4 * p
                       and self.cur[w] + self.cost[F_] <= turn and count[w][0] < m):
                    for v in range(w + 1):
                        self.put(F_, 0, v)
            self.put(F_, 1, w)
        chunk = 0
        for w in range(1, p):
            while (count[w][0] + count[w][1] < count[w - 1][0] + count[w - 1][1]
                   or count[w][1] <= count[w - 1][1] < m):
                for v in range(p - 1, w - 1, -1):
                    if count[v][chunk] < m:
                        self.put(F_, chunk, v)
                chunk = 1 - chunk

    def backward_round(self) -> None:
        p, count = self.p, self.count
        first, second = [], []
        for w in range(p):
            if count[w][3] >= count[w][2]:
                second.append(w)
            elif w == p - 1 or (B_, 1, w + 1, count[w][3]) in self.end or count[w][2] >= self.m:
                first.append(w)
            else:
                second.append(w)
        for w, chunk in [(w, 1) for w in reversed(first)] + [(w, 0) for w in second]:
            dep = self.neighbour(B_, chunk, w, count[w][2 + chunk])
            self.fill(w, dep, chunk == 1 or self.fill_b)
            self.put(B_, chunk, w)

    def forward_round(self) -> None:
        p, m, count = self.p, self.m, self.count
        for w in range(p):
            if count[w][1] >= m:
                continue
            chunk = None
            if count[w][1] >= count[w][0]:
                chunk = 0
            elif w == p - 1 or (F_, 1, w + 1, count[w][1]) in self.end:
                chunk = 1
            elif count[w][0] < m and (w == 0 or (F_, 0, w - 1, count[w][0]) in self.end):
                chunk = 0
            if chunk is None:
                continue
            while self.mem[w] + MEMORY[F_] > 4 * p:
                self.put_w(w)
            dep = self.neighbour(F_, chunk, w, count[w][chunk])
            self.fill(w, dep, self.fill_f)
            self.put(F_, chunk, w)

    def run(self) -> float:
        self.warm_up()
        for _ in range(2 * self.m):
            self.backward_round()
            self.forward_round()
        for w in range(self.p):
            while self.pending[w]:
                self.put_w(w)
        return self.max_bubble()


def _best_try(p: int, m: int, cost: tuple, c: float, fill_f: bool, fill_b: bool,
              approved: list[float] | None = None) -> _Try:
    """A try, retried while allowing each worker the bubble of the last try improves it."""
    attempt = _Try(p, m, cost, c, fill_f, fill_b, approved)
    bubble = attempt.run()
    if approved is None or bubble < max(approved):
        retry = _best_try(p, m, cost, c, fill_f, fill_b, list(attempt.bubble))
        if retry.max_bubble() < bubble:
            return retry
    return attempt


def authors_zero_bubble_v(n_workers: int, chunks: int, forward: float = 1.0,
                          backward_input: float = 1.0, backward_weight: float = 1.0,
                          latency: float = 0.0) -> Program:
    """The authors' ZB-V order for these costs (``c`` is the hand-off ``latency``)."""
    p, cost = n_workers, (forward, backward_input, backward_weight)
    best = None
    for fill_b in (True, False):
        for fill_f in (True, False):
            attempt = _best_try(p, chunks, cost, latency, fill_f, fill_b)
            if best is None or attempt.max_bubble() < best.max_bubble():
                best = attempt
    letters = {F_: "F", B_: "I", W_: "W"}
    workers = []
    for w, actions in enumerate(best.order):
        row = []
        for cat, chunk, n in actions:
            second = chunk == 1 if cat == F_ else chunk == 0
            stage = 2 * p - 1 - w if second else w
            row.append(Action.parse(f"{stage}{letters[cat]}{n}"))
        workers.append(row)
    return Program(workers, 2 * p, chunks)
