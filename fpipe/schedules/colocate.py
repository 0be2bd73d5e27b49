"""Put several workers' stages on one worker: a program -> program transform.

A worker is a thread (or a rank), and on a CPU with small stages, handing every value from one
thread to the next costs more than the parallelism gains; torchgpipe, likewise, runs all the
partitions of one device on one thread. :func:`colocate` moves stages onto fewer workers while
keeping what the schedule does: the new workers run their actions in a global order of the
original program (one every dependency and every original worker's order respect), so the
result is valid whenever the original is.
"""

from __future__ import annotations

from collections.abc import Sequence

from fpipe.schedules.actions import Action, B, I, Program, R, program_of
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
    redo = recomputed(program)
    lists: list[list[Action]] = [[] for _ in used]
    for action in order:
        # A global order may run a recompute as soon as its forward is done; it goes back to
        # just before its backward, where its activations live shortest.
        if action.op is R:
            continue
        actions = lists[workers[action.stage]]
        if action.op in (B, I) and (action.stage, action.microbatch) in redo:
            actions.append(Action(action.stage, R, action.microbatch))
        actions.append(action)
    return Program(lists, program.n_stages, program.n_microbatches)
