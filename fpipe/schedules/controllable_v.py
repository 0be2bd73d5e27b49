"""V-Half and V-Min, the V schedules of controllable memory (Qi, Wan, Huang and Lin, "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024, arXiv:2405.15362): 2K stages on K workers
in a V, worker w holding stages w and 2K-1-w, as in ZB-V, with about a half (V-Half) or a
third (V-Min) of the activations that ZB-V and 1F1B hold.

Why it works: a schedule that repeats one building block per micro-batch holds, in its steady
state, about as many micro-batches alive as the block's lifespan (from a stage's forward to the
end of its backward) spans repetitions. The V runs six unit actions per micro-batch on each
worker (F, I and W of each of its two stages), so a block repeats every 6 slots; the V-Half
block's lifespans add up to about 6K slots per worker (K live pairs), V-Min's to about 4K
(2K/3 pairs), against ZB-V's 12K (2K pairs). The price is idle time: the shorter the lifespan,
the less room to wait for a transfer, and the warm-up and cool-down of a short block leave
more of the pipeline idle.

The program is built in the authors' steps (their generator: the block laid out, weight
gradients put in the free slots, warm-up and cool-down squeezed under the block's memory), so
its simulated time equals theirs (tests/test_vschedules.py holds their numbers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from fpipe.schedules.actions import Action, F, I, Program, W, stage_count, stage_count_error
from fpipe.schedules.remat import RematPolicy, apply_remat, check_fields

__all__ = ["ControllableV", "v_half", "v_min", "v_peak"]

#: The kinds of job a worker of the V runs: the forward of its first stage (on the way down),
#: of its second stage (on the way up), the input gradient of its second stage (which comes
#: back first), of its first stage, and a weight gradient (untyped while the order is built;
#: of the second stage or the first in the program).
DOWN_F, UP_F, UP_I, DOWN_I, WEIGHT, UP_W, DOWN_W = range(7)

#: Slots per micro-batch per worker: F, I and W of each of its two stages.
PERIOD = 6

#: A job: (kind, micro-batch); a worker's plan: the slot of each of its jobs.
Job = tuple[int, int]
Plan = dict[Job, int]


def _half_block(k: int) -> list[tuple[int, int, int, int]]:
    """V-Half's block: worker w's slots for micro-batch 0 of DOWN_F, UP_F, UP_I, DOWN_I. The
    forwards go down the V one worker per two slots, back up one per slot; the backwards the
    same way back. With K even, the backwards start 3 slots later, else the second stage's
    forward and the first stage's input gradient would share a slot (3K apart, a multiple of
    6); every other two of a worker's four slots differ by 1 or 2 modulo 3."""
    gap = 3 if k % 2 == 0 else 0
    return [(2 * w, 3 * k - 2 - w, 3 * k - 1 + gap + 2 * w, 6 * k - 2 + gap - w)
            for w in range(k)]


def _min_block(k: int) -> list[tuple[int, int, int, int]]:
    """V-Min's block: one slot per worker down and up, forwards then backwards, a shorter
    lifespan than V-Half's. With K a multiple of 3 the backwards start 2 slots later, else the
    forward of a worker's first stage and the input gradient of its second (and the second's
    forward and the first's input gradient) would share a slot (2K apart, a multiple of 6);
    every other two of a worker's four slots are an odd number apart."""
    gap = 2 if k % 3 == 0 else 0
    return [(w, 2 * k - 1 - w, 2 * k + gap + w, 4 * k - 1 + gap - w) for w in range(k)]


#: The building blocks by name: per K, each worker's slots of micro-batch 0's four jobs, no two
#: of one worker equal modulo :data:`PERIOD` (so laid out, no two jobs share a slot).
BLOCKS: dict[str, Callable[[int], list[tuple[int, int, int, int]]]] = {
    "half": _half_block, "min": _min_block}


def v_peak(memory: str, n_workers: int) -> int:
    """The most live pairs any worker of ``memory``'s V holds (half-size stages, as ZB-V's):
    the peak of the building block in its steady state, which squeezing never exceeds.
    V-Half: 2*floor((K+2)/2), K+2 or K+1; V-Min: 2*floor((K+4)/3). 1F1B's first worker holds K
    whole-stage pairs, 2K of these: V-Half's is about half of it, V-Min's about a third."""
    _block(memory)
    k = n_workers
    return 2 * ((k + 2) // 2) if memory == "half" else 2 * ((k + 4) // 3)


def _block(memory: str) -> Callable[[int], list[tuple[int, int, int, int]]]:
    if not isinstance(memory, str) or memory not in BLOCKS:
        raise ValueError(f"memory must be one of {', '.join(map(repr, BLOCKS))} (V-Half, "
                         f"V-Min), got {memory!r}")
    return BLOCKS[memory]


@dataclass(frozen=True)
class ControllableV:
    """A V of controllable memory over ``chunks`` micro-batches: 2K stages on K workers,
    worker w holding stages w and 2K-1-w; ``memory`` names the building block, ``"half"``
    (V-Half) or ``"min"`` (V-Min).

    Why: ZB-V nearly removes the bubble but holds as many activations as 1F1B's first worker
    (2K live pairs of half-size stages); V-Half holds about half of that (K+2 pairs at most,
    :func:`v_peak`) and V-Min about a third, for some idle time: with equal F, I and W costs
    V-Half comes close to ZB-V's time and V-Min stays ahead of 1F1B's (the table in
    docs/choosing-a-schedule.md). So where activations do not fit 1F1B or ZB-V, these may,
    without recomputing. The order does not depend on the costs; the blocks are laid out for
    equal F, I and W, and with unequal ones V-Min can fall behind 1F1B (simulate yours).
    """

    chunks: int
    memory: str = "half"
    remat: RematPolicy = "never"

    def __post_init__(self) -> None:
        check_fields(self)
        _block(self.memory)

    def program(self, n_stages: int) -> Program:
        """Worker w holds stages w and 2K-1-w; its order is :func:`v_order`'s."""
        stage_count(n_stages)
        if n_stages % 2:
            raise stage_count_error(
                f"v_{self.memory} places 2K stages on K workers in a V (worker w holds stages w "
                f"and 2K-1-w), so it needs an even number of stages, got {n_stages}")
        return apply_remat(v_order(self.memory, n_stages // 2, self.chunks), self.remat)


@functools.lru_cache(maxsize=128)
def v_order(memory: str, n_workers: int, chunks: int) -> Program:
    """The program of the ``memory`` block on ``n_workers`` workers over ``chunks``
    micro-batches, in the authors' steps:

    1. the block laid out once per micro-batch, :data:`PERIOD` slots apart;
    2. a weight gradient in each free slot while an input gradient waits for one;
    3. the warm-up and the cool-down squeezed (:func:`squeeze`) under the block's peak memory,
       then every job run as early as its inputs allow in unit steps (:func:`retimed`);
    4. the weights taken out and the cool-down squeezed again with them left to the free
       slots, which gives them more room; retimed, and the weights put back, those of the
       second stage first (its input gradient came back first).
    """
    k = n_workers
    laid = [{(kind, m): start + PERIOD * m for kind, start in enumerate(starts)
             for m in range(chunks)} for starts in _block(memory)(k)]
    plans = squeeze([with_weights(p) for p in laid], chunks, weights=True)
    plans = squeeze([_without_weights(p) for p in retimed(plans)], chunks, weights=False)
    plans = [with_weights(_without_weights(p), typed=True)
             for p in retimed([with_weights(p) for p in plans])]
    return Program([_actions(w, k, plan) for w, plan in enumerate(plans)], 2 * k, chunks)


def _actions(w: int, k: int, plan: Plan) -> list[Action]:
    down, up = w, 2 * k - 1 - w
    as_action = {DOWN_F: (down, F), UP_F: (up, F), UP_I: (up, I), DOWN_I: (down, I),
                 UP_W: (up, W), DOWN_W: (down, W)}
    return [Action(*as_action[kind], m) for (kind, m), _ in sorted(plan.items(),
                                                                   key=lambda item: item[1])]


def _without_weights(plan: Plan) -> Plan:
    return {job: slot for job, slot in plan.items() if job[0] < WEIGHT}


def with_weights(plan: Plan, typed: bool = False) -> Plan:
    """``plan`` with a weight gradient in each free slot while an input gradient has run
    without its own, and the rest right after the last job. Untyped: the n-th is ``(WEIGHT,
    n)``; typed: of the stage whose input gradient waits, the second stage's first."""
    out = dict(plan)
    at = {slot: job for job, slot in plan.items()}
    waiting = {UP_W: 0, DOWN_W: 0}
    made = {UP_W: 0, DOWN_W: 0, WEIGHT: 0}
    end = max(plan.values())

    def put(slot: int) -> None:
        kind = next(kind for kind in (UP_W, DOWN_W) if waiting[kind])
        waiting[kind] -= 1
        named = kind if typed else WEIGHT
        out[named, made[named]] = slot
        made[named] += 1

    for slot in range(end + 1):
        job = at.get(slot)
        if job is not None:
            if job[0] in (UP_I, DOWN_I):
                waiting[UP_W if job[0] == UP_I else DOWN_W] += 1
        elif any(waiting.values()):
            put(slot)
    while any(waiting.values()):
        end += 1
        put(end)
    return out


def peak(plan: Plan) -> int:
    """The most live pairs of a worker's plan: a forward adds one, a weight gradient frees
    one; without weights in the plan, each free slot runs one that an input gradient left."""
    at = {slot: job[0] for job, slot in plan.items()}
    has_weights = any(kind >= WEIGHT for kind in at.values())
    live = most = waiting = 0
    for slot in range(max(at) + 1):
        kind = at.get(slot)
        if kind in (DOWN_F, UP_F):
            live += 1
        elif kind in (UP_I, DOWN_I):
            waiting += 1
        elif kind is not None:
            live -= 1
        elif waiting and not has_weights:
            live -= 1
            waiting -= 1
        most = max(most, live)
    return most


#: The phases of :func:`squeeze`, in order.
WARM_UP, STEADY, COOL_DOWN = range(3)


def squeeze(plans: list[Plan], chunks: int, weights: bool) -> list[Plan]:
    """``plans`` with jobs moved earlier: each, in the order of its slot (then worker), to the
    earliest free slot after its inputs where its worker holds no more live pairs than the
    most any worker holds now (:func:`peak`), or left where it is.

    Only the warm-up (with ``weights``, the first squeeze) and the cool-down move: the steady
    state is the block's, from worker 0's first input gradient of its first stage (the first
    micro-batch back through the whole V) to the first forward of the last micro-batch after
    it. Moving a job earlier never passes one that needs it, so the order stays valid."""
    plans = [dict(plan) for plan in plans]
    cap = max(peak(plan) for plan in plans)
    taken: list[set[int]] = [set() for _ in plans]
    phase = WARM_UP
    for slot, w, job in sorted((s, w, job) for w, plan in enumerate(plans)
                               for job, s in plan.items()):
        kind, m = job
        if phase == WARM_UP and (w, kind) == (0, DOWN_I):
            phase = STEADY
        if phase == STEADY and (kind, m) == (DOWN_F, chunks - 1):
            phase = COOL_DOWN
            moves = False
        else:
            moves = phase == COOL_DOWN or (phase == WARM_UP and weights)
        if moves:
            plans[w][job] = _earliest(plans, w, job, slot, taken[w], cap)
        taken[w].add(plans[w][job])
    return plans


def _earliest(plans: list[Plan], w: int, job: Job, slot: int, taken: set[int],
              cap: int) -> int:
    """The first free slot before ``slot`` and after ``job``'s inputs at which worker ``w``
    stays within ``cap`` live pairs; ``slot`` if there is none."""
    plan = plans[w]
    ready = [plans[v][need] for v, need in _inputs(len(plans), w, job)]
    if job[0] == WEIGHT:  # the n-th weight gradient follows the n-th input gradient
        ready.append(sorted(s for (kind, _), s in plan.items() if kind in (UP_I, DOWN_I))[job[1]])
    for s in range(1 + max(ready, default=-1), slot):
        if s not in taken:
            plan[job] = s
            if peak(plan) <= cap:
                return s
    plan[job] = slot
    return slot


def retimed(plans: list[Plan]) -> list[Plan]:
    """Each job at the step it starts when every worker runs its jobs in slot order, one per
    unit step, each as soon as its inputs are done: the empty slots squeezed out."""
    out: list[Plan] = [{} for _ in plans]
    free = [0] * len(plans)
    for _, w, job in sorted((s, w, job) for w, plan in enumerate(plans)
                            for job, s in plan.items()):
        start = max([free[w], *(out[v][need] + 1 for v, need in _inputs(len(plans), w, job))])
        out[w][job] = start
        free[w] = start + 1
    return out


def _inputs(k: int, w: int, job: Job) -> list[tuple[int, Job]]:
    """The jobs ``job`` of worker ``w`` waits for: its stage's previous micro-batch; a forward
    down, or an input gradient up, waits for the worker before, the others for the worker
    after; the second stage's forward, and each input gradient, for the job before it on the
    way through the V on this worker (the turn, on worker K-1)."""
    kind, m = job
    needs = [(w, (kind, m - 1))] if m else []
    if kind in (DOWN_F, UP_I) and w > 0:
        needs.append((w - 1, job))
    if kind in (UP_F, DOWN_I) and w + 1 < k:
        needs.append((w + 1, job))
    if kind in (UP_F, UP_I, DOWN_I):
        needs.append((w, (kind - 1, m)))
    return needs


def v_half(chunks: int, remat: object = "never") -> ControllableV:
    """V-Half (2K stages on K workers in a V), about half of 1F1B's activations for a small
    bubble; ``remat`` is a policy accepted by :func:`normalize_remat`. See
    :class:`ControllableV`."""
    return ControllableV(chunks, "half", remat)  # type: ignore[arg-type]


def v_min(chunks: int, remat: object = "never") -> ControllableV:
    """V-Min (2K stages on K workers in a V), about a third of 1F1B's activations for a larger
    bubble; ``remat`` is a policy accepted by :func:`normalize_remat`. See
    :class:`ControllableV`."""
    return ControllableV(chunks, "min", remat)  # type: ignore[arg-type]
