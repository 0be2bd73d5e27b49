"""Zero-bubble schedules (Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism",
ICLR 2024, arXiv:2401.10241): the backward of each (stage, micro-batch) is split into the
input gradient ``I``, which the previous stage waits for, and the weight gradient ``W``, which
nobody waits for, so the ``W`` actions can be moved into the idle time of the pipeline.

A pair stays alive until its ``W`` (the weight gradient reads the saved activations), which is
what bounds how far the ``W`` actions can be deferred.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

from fpipe.schedules.actions import (
    Action,
    F,
    I,
    Program,
    W,
    stage_count,
    stage_count_error,
)
from fpipe.schedules.costs import Costs
from fpipe.schedules.remat import RematPolicy, apply_remat, check_fields
from fpipe.schedules.simulate import simulate
from fpipe.schedules.v_shape import fill_weight_gradients, handcrafted_v

#: The ``slack`` values :meth:`ZeroBubbleV.program` tries with costs (see
#: :func:`~fpipe.schedules.v_shape.fill_weight_gradients`): a ``W`` only into a wait as long as
#: itself, or also into shorter ones.
SLACKS = (1.0, 0.5, 0.1)

__all__ = ["ZeroBubble", "ZeroBubbleV", "zero_bubble", "zero_bubble_v"]


@dataclass(frozen=True)
class ZeroBubble:
    """ZB-H1, the memory-efficient handcrafted schedule of the zero-bubble paper, over
    ``chunks`` micro-batches; one stage per worker.

    Why: 1F1B's input gradients travel back at the pace of whole backwards; here they travel
    at the pace of ``I`` alone and the ``W`` actions fill the drain, so with equal F, I and W
    costs the idle time per worker falls from 1F1B's (K-1)(F+I+W) to (K-1)(F+I-W), a third.
    The trade: every worker may hold K live pairs (its stage's micro-batches forwarded, ``W``
    not run), as many as 1F1B's first worker but more than 1F1B's later workers (K-w on worker
    w).
    """

    chunks: int
    remat: RematPolicy = "never"

    def __post_init__(self) -> None:
        check_fields(self)

    def program(self, n_stages: int) -> Program:
        """Worker w of K holds stage w. Its forwards and input gradients are in 1F1B's places
        (K-1-w warm-up forwards, then one forward and one ``I`` in turn, then the ``I`` left),
        which makes the program valid whenever 1F1B's is, as a ``W`` needs only its own ``I``,
        earlier on the same worker. The ``W`` actions follow the ``I`` actions one for one, in
        micro-batch order, but the first comes only after the (w+1)-th ``I``: the delay that
        brings every worker to K live pairs. The ``W`` left go last."""
        stage_count(n_stages)
        workers = [self._worker(w, n_stages) for w in range(n_stages)]
        return apply_remat(Program(workers, n_stages, self.chunks), self.remat)

    def _worker(self, w: int, n_workers: int) -> list[Action]:
        chunks = self.chunks
        warmup = min(n_workers - 1 - w, chunks)
        actions = [Action(w, F, m) for m in range(warmup)]
        weights = 0
        for m in range(chunks):
            if warmup + m < chunks:
                actions.append(Action(w, F, warmup + m))
            actions.append(Action(w, I, m))
            if m >= w:
                actions.append(Action(w, W, weights))
                weights += 1
        actions += [Action(w, W, m) for m in range(weights, chunks)]
        return actions


@dataclass(frozen=True)
class ZeroBubbleV:
    """ZB-V, the V-shaped zero-bubble schedule, over ``chunks`` micro-batches: 2K stages on K
    workers, worker w holding stages w and 2K-1-w.

    Why: the V puts the first and the last stage on worker 0, so the worker that starts a
    micro-batch is also the one that turns it round, and the fill of the pipeline can be spent
    on forwards of the first stage; with the ``W`` actions filling the rest, the bubble nearly
    vanishes when F, I and W cost the same, while every worker holds at most 2K live pairs
    (of half-size stages), the memory 1F1B's first worker needs for K whole micro-batches.
    The trade: twice the transfers of 1F1B, and an order tuned for equal F, I and W costs: with
    an ``I`` much dearer than F and W it can fall behind 1F1B (simulate with your costs;
    ``zero_bubble`` does not have that weakness).

    Without ``costs`` the order is the zero-bubble paper's hand-written V (its Figure 5, the
    order of torch's ``ScheduleZBVZeroBubble`` action for action): in its steady state each
    worker runs an F, an I and a W of each of its stages in turn, and the ``W`` leaves room for
    the next input to arrive. So a hand-off that takes time costs it little (at most torch's
    makespan, as it is torch's order), and with equal F, I and W costs and free hand-offs no
    worker idles inside its busy span once there are 2K-1 micro-batches. The unit-step order
    (:func:`v_shape_order`), which packs forwards tightly, is as fast only when hand-offs are
    free: a hand-off of half a forward makes it 29% longer than torch's (K=4, 32
    micro-batches), so it is not the default. With ``costs`` (a
    :class:`~fpipe.schedules.Costs`, e.g. fitted to a recorded step), the program is the
    fastest under them of: the hand-written V, the unit-step order (shorter with fewer than
    2K-1 micro-batches and short hand-offs), and both with each ``W`` moved into the waits the
    costs predict (:mod:`fpipe.schedules.v_shape`); every one holds at most 2K pairs per
    worker.
    """

    chunks: int
    remat: RematPolicy = "never"
    costs: Costs | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.costs is not None and not isinstance(self.costs, Costs):
            raise TypeError(f"zero_bubble_v's costs must be a Costs value or None, got a "
                            f"{type(self.costs).__name__}")

    def program(self, n_stages: int) -> Program:
        """Worker w's order is :func:`~fpipe.schedules.v_shape.handcrafted_v`'s: 2(K-w)-1
        forwards of its first stage, w pairs of forwards (second stage, then first), K-w rounds
        of F, I, W of its second stage, then the steady state (F, I, W of the first stage, then
        of the second) and the drain. With ``costs``, :func:`fastest_v` of it."""
        stage_count(n_stages)
        if n_stages % 2:
            raise stage_count_error(
                f"zero_bubble_v places 2K stages on K workers in a V (worker w holds stages w "
                f"and 2K-1-w), so it needs an even number of stages, got {n_stages}"
            )
        program = handcrafted_v(self.chunks, n_stages // 2)
        if self.costs is not None:
            program = fastest_v(program, self.costs, n_stages)
        return apply_remat(program, self.remat)


@functools.lru_cache(maxsize=64)
def fastest_v(hand_written: Program, costs: Costs, n_stages: int) -> Program:
    """Of the V orders :class:`ZeroBubbleV` describes, the one with the least simulated
    makespan under ``costs`` (the first of those tied, so costs under which nothing is faster
    keep the hand-written V, torch's order)."""
    costs = costs.for_stages(n_stages)
    chunks, n_workers = hand_written.n_microbatches, n_stages // 2
    return min(v_candidates(hand_written, v_shape_order(chunks, n_workers, cap=n_stages), costs),
               key=lambda program: simulate(program, costs).makespan)


def v_candidates(hand_written: Program, unit_order: Program, costs: Costs) -> list[Program]:
    """The orders :func:`fastest_v` chooses from, in the order ties are broken: the two bases,
    then the hand-written V and the unit-step order with their ``W`` moved at each of
    :data:`SLACKS`."""
    cap = hand_written.n_stages
    return [hand_written, unit_order,
            *(fill_weight_gradients(base, costs, cap=cap, slack=slack)
              for base in (hand_written, unit_order) for slack in SLACKS)]


def v_shape_order(chunks: int, n_workers: int, cap: int) -> Program:
    """The unit-step V: each worker's order is the one it follows when all of them run in unit
    steps (F, I and W cost the same) and, at each step, each worker takes the first of: a
    forward whose input is there, of its second stage first, if it holds fewer than ``cap``
    pairs alive; an ``I`` whose gradient is there, of its first stage first; its oldest pending
    ``W``. A program that records an execution is valid by construction.

    If a step finds no worker able to act, some forward is waiting only for room (the oldest
    micro-batch not yet through the V has one), so the next step lets forwards past the cap;
    with ``cap=2K`` this never happens for the sizes the tests cover, but it keeps any cap
    from hanging.
    """
    n_stages = 2 * n_workers
    ran_at: dict[Action, int] = {}
    next_forward = [0] * n_stages
    next_input = [0] * n_stages
    live = [0] * n_workers
    pending: list[deque[Action]] = [deque() for _ in range(n_workers)]
    order: list[list[Action]] = [[] for _ in range(n_workers)]
    left = 3 * n_stages * chunks
    step = 0
    stalled = False

    def done(action: Action) -> bool:
        return ran_at.get(action, step) < step

    def forward(first: int, second: int, room: bool) -> Action | None:
        if not room:
            return None
        for stage in (second, first):
            m = next_forward[stage]
            if m < chunks and (stage == 0 or done(Action(stage - 1, F, m))):
                return Action(stage, F, m)
        return None

    def input_grad(first: int, second: int) -> Action | None:
        for stage in (first, second):
            m = next_input[stage]
            if (m < chunks and done(Action(stage, F, m))
                    and (stage == n_stages - 1 or done(Action(stage + 1, I, m)))):
                return Action(stage, I, m)
        return None

    while left:
        acted = False
        for w in range(n_workers):
            first, second = w, n_stages - 1 - w
            action = (forward(first, second, live[w] < cap or stalled)
                      or input_grad(first, second)
                      or (pending[w].popleft() if pending[w] else None))
            if action is None:
                continue
            acted = True
            ran_at[action] = step
            order[w].append(action)
            left -= 1
            if action.op is F:
                next_forward[action.stage] += 1
                live[w] += 1
            elif action.op is I:
                next_input[action.stage] += 1
                pending[w].append(Action(action.stage, W, action.microbatch))
            else:
                live[w] -= 1
        stalled = not acted
        step += 1
    return Program(order, n_stages, chunks)


def zero_bubble(chunks: int, remat: object = "never") -> ZeroBubble:
    """ZB-H1 with split backwards; ``remat`` is a policy accepted by :func:`normalize_remat`."""
    return ZeroBubble(chunks, remat)  # type: ignore[arg-type]


def zero_bubble_v(chunks: int, remat: object = "never", costs: Costs | None = None) -> ZeroBubbleV:
    """ZB-V (2K stages on K workers in a V); ``remat`` is a policy accepted by
    :func:`normalize_remat`. Without ``costs``, the paper's hand-written V, torch's
    ``ScheduleZBVZeroBubble`` order, which hand-off latency hurts least; with ``costs``, the
    order fastest under them (see :class:`ZeroBubbleV`)."""
    return ZeroBubbleV(chunks, remat, costs)  # type: ignore[arg-type]
