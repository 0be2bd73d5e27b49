"""Schedules with several stages per worker, placed in a loop: worker w of K holds stages
w, w+K, w+2K, ... (``stages_per_worker`` = v of them, n_stages = K*v).

Splitting each worker's layers into v stages makes every stage v times cheaper, so the ramp-up
and ramp-down of the pipeline, which are made of stage-sized steps, shrink v-fold; the price is
v times more transfers between workers, and more live activations than 1F1B.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fpipe.schedules.actions import (
    Action,
    B,
    F,
    I,
    Program,
    W,
    stage_count,
    stage_count_error,
)
from fpipe.schedules.remat import RematPolicy, apply_remat, check_fields

__all__ = ["InterleavedOneFOneB", "LoopedBFS", "InterleavedZeroBubble", "interleaved_one_f_one_b",
           "looped_bfs", "interleaved_zero_bubble"]


def looped_workers(n_stages: int, stages_per_worker: int, name: str) -> int:
    """The number of workers K = n_stages / v, or a ValueError when v does not divide it."""
    stage_count(n_stages)
    if n_stages % stages_per_worker:
        raise stage_count_error(
            f"{name} with stages_per_worker={stages_per_worker} needs a number of stages that "
            f"is a multiple of {stages_per_worker} (worker w holds stages w, w+K, ...), got "
            f"{n_stages}"
        )
    return n_stages // stages_per_worker


def rounds(chunks: int, n_workers: int) -> list[range]:
    """Micro-batches in consecutive rounds of at least ``n_workers`` each (larger rounds
    first), or a single round when there are fewer micro-batches than workers."""
    if chunks < n_workers:
        return [range(chunks)]
    count = chunks // n_workers
    size, extra = divmod(chunks, count)
    out, start = [], 0
    for r in range(count):
        stop = start + size + (r < extra)
        out.append(range(start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class InterleavedOneFOneB:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", SC 2021, arXiv:2104.04473) over ``chunks`` micro-batches,
    with ``stages_per_worker`` stages per worker placed in a loop.

    Why: with v stages per worker, each stage holds 1/v of a worker's layers, and the pipeline's
    fill and drain are made of stage-sized steps, so the idle time per worker shrinks by v
    against 1F1B at the same memory per micro-batch-stage; the trade is v times more
    point-to-point transfers, and warm-up forwards (about 2(K-1-w) + (v-1)K stage-forwards on
    worker w) that keep more activations alive than 1F1B's K-w. Megatron requires ``chunks``
    to be a multiple of the number of workers; here any count works (see :meth:`program`).
    """

    chunks: int
    stages_per_worker: int = 2
    remat: RematPolicy = "never"

    def __post_init__(self) -> None:
        check_fields(self, "stages_per_worker")

    def program(self, n_stages: int) -> Program:
        """Worker w of K = n_stages/v holds stages w, w+K, ...; it runs its forwards in rounds
        (for each round of micro-batches, each of its stages in turn, all of the round's
        micro-batches) and its backwards in the same rounds with its stages reversed. It
        starts with ``(v-1)*G + 2*(K-1-w)`` forwards (G the size of the first round), then
        alternates one forward and one backward, then runs the backwards left.

        Rounds hold K micro-batches when K divides ``chunks`` (Megatron's schedule exactly);
        otherwise ``chunks // K`` rounds of at least K, larger first; with fewer micro-batches
        than workers, one round. With v = 1 the warm-up is 1F1B's K-1-w and the program is
        1F1B's.

        Valid for every count (v = 1 being 1F1B): for v >= 2, give forward number i of worker
        w the time ``i + w`` and backward number j the time ``j + (v-1)*G + 2K - 1.5 - w``.
        Each worker's order is
        increasing in time, and each dependency comes earlier: along a loop of workers since
        w-1 < w (forwards) and w+1 > w (backwards), from one loop to the next since every round
        has at least K micro-batches, and a forward before its own backward since G is the
        largest round. With fewer micro-batches than workers the program is the one for K
        micro-batches with the missing ones left out, and dropping whole micro-batches keeps a
        program valid.
        """
        v = self.stages_per_worker
        n_workers = looped_workers(n_stages, v, "interleaved 1F1B")
        groups = rounds(self.chunks, n_workers)
        forwards = [(c, m) for r in groups for c in range(v) for m in r]
        backwards = [(c, m) for r in groups for c in reversed(range(v)) for m in r]
        slope = 2 if v > 1 else 1
        workers = []
        for w in range(n_workers):
            warmup = min(len(forwards), (v - 1) * len(groups[0]) + slope * (n_workers - 1 - w))
            order = [(F, c, m) for c, m in forwards[:warmup]]
            for (cf, mf), (cb, mb) in zip(forwards[warmup:], backwards, strict=False):
                order += [(F, cf, mf), (B, cb, mb)]
            order += [(B, c, m) for c, m in backwards[len(forwards) - warmup:]]
            workers.append([Action(c * n_workers + w, op, m) for op, c, m in order])
        return apply_remat(Program(workers, n_stages, self.chunks), self.remat)


@dataclass(frozen=True)
class LoopedBFS:
    """Breadth-first looping (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023,
    arXiv:2211.05953) over ``chunks`` micro-batches, with ``stages_per_worker`` stages per
    worker placed in a loop.

    Why: every micro-batch goes through one of a worker's stages before the worker moves to
    its next stage, so a stage's parameters (and, sharded, their gathering) are used in one
    stretch per step, and with v stages per worker the pipeline fills in stage-sized steps;
    the price is GPipe's memory: every micro-batch is alive on every stage at the turn, which
    rematerialisation can cut back.
    """

    chunks: int
    stages_per_worker: int = 2
    remat: RematPolicy = "never"

    def __post_init__(self) -> None:
        check_fields(self, "stages_per_worker")

    def program(self, n_stages: int) -> Program:
        """Worker w of K holds stages w, w+K, ...: every forward of its first stage, then of
        its next, ...; then the backwards of its stages in reverse order, each in micro-batch
        order. Valid: sorting all forwards by (stage, micro-batch), then all backwards by
        (descending stage, micro-batch), gives a global order that every worker follows."""
        v = self.stages_per_worker
        n_workers = looped_workers(n_stages, v, "looped BFS")
        mbs = range(self.chunks)
        workers = []
        for w in range(n_workers):
            mine = [c * n_workers + w for c in range(v)]
            workers.append([Action(s, F, m) for s in mine for m in mbs]
                           + [Action(s, B, m) for s in reversed(mine) for m in mbs])
        return apply_remat(Program(workers, n_stages, self.chunks), self.remat)


def interleaved_one_f_one_b(chunks: int, stages_per_worker: int = 2,
                            remat: object = "never") -> InterleavedOneFOneB:
    """Interleaved 1F1B with ``stages_per_worker`` stages per worker; ``remat`` is a policy
    accepted by :func:`normalize_remat`."""
    return InterleavedOneFOneB(chunks, stages_per_worker, remat)  # type: ignore[arg-type]


def looped_bfs(chunks: int, stages_per_worker: int = 2, remat: object = "never") -> LoopedBFS:
    """Breadth-first looping with ``stages_per_worker`` stages per worker; ``remat`` is a
    policy accepted by :func:`normalize_remat`."""
    return LoopedBFS(chunks, stages_per_worker, remat)  # type: ignore[arg-type]


@dataclass(frozen=True)
class InterleavedZeroBubble:
    """Interleaved zero bubble: ZB-H1 (Qi, Wan, Huang and Lin, "Zero Bubble Pipeline
    Parallelism", ICLR 2024, arXiv:2401.10241) with ``stages_per_worker`` virtual stages per
    worker placed in a loop, as ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble``
    orders it (its "ZB1P"), over ``chunks`` micro-batches.

    Why: interleaving divides the fill and drain v-fold, as in interleaved 1F1B; splitting
    the backward lets the input gradients travel back at the pace of ``I`` alone while the
    ``W`` actions fill what idle time is left. The warm-up is one forward per hop shorter than
    interleaved 1F1B's two, since the gradients come back faster; the trade is that a pair
    stays alive until its ``W``.
    """

    chunks: int
    stages_per_worker: int = 2
    remat: RematPolicy = "never"

    def __post_init__(self) -> None:
        check_fields(self, "stages_per_worker")

    def program(self, n_stages: int) -> Program:
        """Worker w of K = n_stages/v: the forwards and backwards of interleaved 1F1B in its
        rounds (see :meth:`InterleavedOneFOneB.program`), each backward an ``I``; a warm-up of
        ``(v-1)*G + (K-1-w)`` forwards (G the first round's size); then one forward and one
        ``I`` in turn, then the ``I`` left; after the (w+1)-th ``I`` and each one after it,
        the oldest pending ``W``; the ``W`` left go last. With v = 1 this is ZB-H1's program
        (:class:`~fpipe.schedules.ZeroBubble`)."""
        v = self.stages_per_worker
        n_workers = looped_workers(n_stages, v, "interleaved zero bubble")
        groups = rounds(self.chunks, n_workers)
        forwards = [(c, m) for r in groups for c in range(v) for m in r]
        backwards = [(c, m) for r in groups for c in reversed(range(v)) for m in r]
        workers = []
        for w in range(n_workers):
            warmup = min(len(forwards), (v - 1) * len(groups[0]) + (n_workers - 1 - w))
            order = [(F, c, m) for c, m in forwards[:warmup]]
            pending: deque[tuple[int, int]] = deque()
            for i, backward in enumerate(backwards):
                if warmup + i < len(forwards):
                    order.append((F, *forwards[warmup + i]))
                order.append((I, *backward))
                pending.append(backward)
                if i >= w:
                    order.append((W, *pending.popleft()))
            order += [(W, c, m) for c, m in pending]
            workers.append([Action(c * n_workers + w, op, m) for op, c, m in order])
        return apply_remat(Program(workers, n_stages, self.chunks), self.remat)


def interleaved_zero_bubble(chunks: int, stages_per_worker: int = 2,
                            remat: object = "never") -> InterleavedZeroBubble:
    """Interleaved zero bubble (ZB-H1 with ``stages_per_worker`` virtual stages); ``remat``
    is a policy accepted by :func:`normalize_remat`."""
    return InterleavedZeroBubble(chunks, stages_per_worker, remat)  # type: ignore[arg-type]
