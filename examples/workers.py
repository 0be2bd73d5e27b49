"""One worker thread per CPU core at most, shared by the local examples.

Each worker of a program is a thread. On a machine with fewer cores than stages (a 2-core
laptop or CI box, for these 4-stage examples) the threads would take turns and every value
handed on would wait for a thread to be woken; fpipe warns about it
(``fpipe.OversubscriptionWarning``). So the examples put neighbouring stages on one worker
with ``fpipe.schedules.colocate``, which changes who runs what, never the numbers.
"""

from __future__ import annotations

import os

from fpipe.schedules import colocate, program_of


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def fit(schedule, n_stages: int):
    """``schedule`` as it is where the machine has a core per worker, else its program on
    one worker per core, each holding a run of neighbouring stages."""
    program = program_of(schedule, n_stages)
    workers = min(program.n_workers, cores() or 1)
    if workers == program.n_workers:
        return schedule
    return colocate(program, [s * workers // n_stages for s in range(n_stages)])
