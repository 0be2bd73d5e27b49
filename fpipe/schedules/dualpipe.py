"""DualPipeV: DeepSeek's DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report",
arXiv:2412.19437, section 3.2.1) folded into a V, in the order of the open-source DualPipeV
(github.com/deepseek-ai/DualPipe) as ``torch.distributed.pipelining.ScheduleDualPipeV``
writes it.

DualPipe feeds micro-batches from both ends of the pipeline; folded into a V on K workers
(worker w holds stages w and 2K-1-w, as in ZB-V), it needs one copy of the parameters instead
of two. Its steady state pairs the forward of one stage with the full backward of the other,
which DeepSeek runs overlapped so that one's communication hides behind the other's compute.
The pairs are :class:`~fpipe.schedules.Overlap` units of the program, at torch's positions: a
pair starts once both its inputs are there, in the simulator and when run (fpipe runs the
forward, then the backward; ``Costs(overlap="max")`` prices a runtime that overlaps them).
The tail splits backwards into ``I`` and ``W`` to fill the drain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fpipe.schedules.actions import (
    Action,
    B,
    F,
    I,
    Op,
    Overlap,
    Program,
    W,
    stage_count,
    stage_count_error,
)
from fpipe.schedules.remat import RematPolicy, apply_remat, check_fields

__all__ = ["DualPipeV", "dual_pipe_v"]


@dataclass(frozen=True)
class DualPipeV:
    """DualPipeV over ``chunks`` micro-batches: 2K stages on K workers in a V, at least 2K
    micro-batches (as in ``torch.distributed.pipelining``).

    Why: like ZB-V it turns each micro-batch round on the worker that started it and fills
    the drain with weight gradients; its steady state of forward-backward pairs keeps every
    worker at most 2K+1 live pairs (ZB-V: 2K), and where forward and backward can
    overlap (two streams, communication hidden) it hides the transfers that ZB-V exposes.
    Run one action at a time, as fpipe does, expect about ZB-V's time (simulate with your
    costs).

    ``overlap=True`` (the default) makes each forward-backward pair of DeepSeek's order one
    unit (:class:`~fpipe.schedules.Overlap`), as DeepSeek's and torch's runtimes run it: the
    forward waits for the backward's input too, which costs idle time where the gradient comes
    late, and the simulated bubble is DeepSeek's ``(K-1)(F&B + B - 3W)``. ``overlap=False`` is
    the same order with every action a unit of its own, which fpipe, running one action at a
    time, can start earlier.
    """

    chunks: int
    remat: RematPolicy = "never"
    overlap: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be True or False, got {self.overlap!r}")

    def program(self, n_stages: int) -> Program:
        """Worker w of K holds stages w (its first) and 2K-1-w (its second). In the eight
        steps of DualPipeV: 2(K-1-w) forwards of the first stage; w+1 pairs of forwards (first,
        second); K-1-w times an ``I`` and a ``W`` of the second stage and its forward; the main
        step, ``chunks``-2K+w+1 times a forward of the first stage with a backward of the
        second, then a forward of the second with a backward of the first (each pair
        overlapped, except the very first on the last worker, whose backward's gradient comes
        late: torch leaves it unpaired); K-1-w times a
        backward of the second then the pair (forward of the second, backward of the first);
        w+1 times a backward of each stage, split into ``I`` from the middle on; K-1-w times a
        pending ``W`` then a backward of the first stage; and the w+1 pending ``W`` left.
        Each stage's actions of one op go in micro-batch order, and each ``W`` follows its
        ``I`` in the order the ``I`` ran."""
        n_stages = stage_count(n_stages)
        if n_stages % 2:
            raise stage_count_error(
                f"dual_pipe_v places 2K stages on K workers in a V (worker w holds stages w and "
                f"2K-1-w), so it needs an even number of stages, got {n_stages}")
        if self.chunks < n_stages:
            raise ValueError(f"dual_pipe_v needs at least as many micro-batches as stages (2K): "
                             f"{self.chunks} chunks for {n_stages} stages")
        k = n_stages // 2
        workers = [_Worker(w, n_stages - 1 - w, self.overlap).run(k, self.chunks)
                   for w in range(k)]
        program = Program(workers, n_stages, self.chunks)
        return apply_remat(program, self.remat)


class _Worker:
    """One worker's order, written as DualPipeV's steps: counters per (stage, op) give the
    micro-batch, and a queue holds the ``W`` of each ``I`` until a step runs it."""

    def __init__(self, first: int, second: int, overlap: bool) -> None:
        self.first, self.second, self.overlap = first, second, overlap
        self.next: dict[tuple[int, Op], int] = {}
        self.weights: deque[Action] = deque()
        self.actions: list[Action | Overlap] = []

    def add(self, stage: int, op: Op) -> Action:
        key = (stage, F if op is F else B)  # B and I share the backward counter
        m = self.next.get(key, 0)
        self.next[key] = m + 1
        action = Action(stage, op, m)
        self.actions.append(action)
        if op is I:
            self.weights.append(Action(stage, W, m))
        return action

    def pair(self, forward: int, backward: int, overlapped: bool = True) -> None:
        """A forward of one stage and a full backward of the other: one unit if overlapped."""
        f, b = self.add(forward, F), self.add(backward, B)
        if overlapped and self.overlap:
            del self.actions[-2:]
            self.actions.append(Overlap(f, b))

    def weight(self) -> None:
        if self.weights:
            self.actions.append(self.weights.popleft())

    def run(self, k: int, chunks: int) -> list[Action | Overlap]:
        w, first, second = self.first, self.first, self.second
        for _ in range(2 * (k - 1 - w)):  # 1: F0
            self.add(first, F)
        for _ in range(w + 1):  # 2: F0 F1
            self.add(first, F)
            self.add(second, F)
        for _ in range(k - 1 - w):  # 3: I1 W1 F1
            self.add(second, I)
            self.weight()
            self.add(second, F)
        for i in range(chunks - 2 * k + w + 1):  # 4: F0 B1, F1 B0
            self.pair(first, second, overlapped=not (i == 0 and w == k - 1))
            self.pair(second, first)
        for _ in range(k - 1 - w):  # 5: B1, F1 B0
            self.add(second, B)
            self.pair(second, first)
        split = False
        for i in range(w + 1):  # 6: B1 B0, split from the middle on
            split = split or (i == (w + 1) // 2 and w % 2 == 1)
            self.add(second, I if split else B)
            split = split or (i == (w + 1) // 2 and w % 2 == 0)
            self.add(first, I if split else B)
        for _ in range(k - 1 - w):  # 7: W0 B0
            self.weight()
            self.add(first, I if split else B)
        for _ in range(w + 1):  # 8: W0
            self.weight()
        return self.actions


def dual_pipe_v(chunks: int, remat: object = "never", overlap: bool = True) -> DualPipeV:
    """DualPipeV (2K stages on K workers in a V, chunks >= 2K); ``remat`` is a policy accepted
    by :func:`normalize_remat`; ``overlap`` makes DeepSeek's forward-backward pairs units (see
    :class:`DualPipeV`)."""
    return DualPipeV(chunks, remat, overlap)  # type: ignore[arg-type]
