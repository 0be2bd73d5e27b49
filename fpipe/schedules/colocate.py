"""Put several workers' stages on one worker: a program -> program transform.

A worker is a thread (or a rank), and on a CPU with small stages, handing every value from one
thread to the next costs more than the parallelism gains; torchgpipe, likewise, runs all the
partitions of one device on one thread. :func:`colocate` moves stages onto fewer workers while
keeping what the schedule does: the new workers run their actions in a global order of the
original program (one every dependency and every original worker's order respect), so the
result is valid whenever the original is. An overlapped pair (:class:`Overlap`, DualPipeV's)
stays a pair: its two stages must go to one worker, as a pair is one unit of one worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from fpipe.schedules.actions import Action, B, I, Overlap, Program, R, program_of
from fpipe.schedules.remat import recomputed
from fpipe.schedules.validate import execution_order, validate

__all__ = ["colocate"]


def colocate(schedule: object, workers: Sequence[int]) -> Program:
    """``schedule``'s program with stage ``s`` on worker ``workers[s]`` (workers numbered
    from 0, none left empty), each worker running its stages' actions in one global order of
    that program.

    ``schedule`` is a :class:`Program` or any schedule (a value such as
    ``one_f_one_b(chunks=8)``, a function ``n_stages -> Program``), whose program is taken for
    ``len(workers)`` stages; the result is a program, which ``fpipe.pipeline`` accepts as its
    ``schedule``.

    Each overlapped pair of the program is kept, its backward right after its forward (a
    global order runs a pair as one unit), so given the program's own placement the program
    comes back unchanged. A placement that puts the two stages of a pair on different workers
    is refused, naming the pair: colocate ``program.sequential()`` to run the pair's actions
    one at a time instead.
    """
    workers = list(workers)
    program = (schedule if isinstance(schedule, Program)
               else program_of(schedule, len(workers)))
    if len(workers) != program.n_stages:
        raise ValueError(f"got a worker for {len(workers)} stages but the program has "
                         f"{program.n_stages}")
    used = sorted(set(workers))
    if used != list(range(len(used))) or any(isinstance(w, bool) for w in workers):
        raise ValueError(f"workers must number 0, 1, ... with none left out, got {workers}")
    order = execution_order(validate(program))
    _check_pairs(program, workers)
    redo = recomputed(program)
    pair_of = {o.forward: o for o in program.overlaps}
    paired = {o.backward for o in program.overlaps}
    lists: list[list[Action | Overlap]] = [[] for _ in used]
    for action in order:
        # A global order may run a recompute as soon as its forward is done; it goes back to
        # just before its backward (before the pair of an overlapped one, as apply_remat puts
        # it), where its activations live shortest.
        if action.op is R or action in paired:
            continue
        pair = pair_of.get(action)
        backward = action if pair is None else pair.backward
        actions = lists[workers[action.stage]]
        if backward.op in (B, I) and (backward.stage, backward.microbatch) in redo:
            actions.append(Action(backward.stage, R, backward.microbatch))
        actions.append(action if pair is None else pair)
    return Program(lists, program.n_stages, program.n_microbatches)


def _check_pairs(program: Program, workers: list[int]) -> None:
    """Refuse a placement that puts the two stages of an overlapped pair on two workers."""
    for pair in sorted(program.overlaps, key=str):
        f, b = pair.forward.stage, pair.backward.stage
        if workers[f] != workers[b]:
            raise ValueError(
                f"colocate would split the overlapped pair {pair}: stage {f} goes to worker "
                f"{workers[f]} and stage {b} to worker {workers[b]}, but a pair runs as one "
                f"unit on one worker; put both stages on one worker, or colocate "
                f"program.sequential() to run its actions one at a time")
