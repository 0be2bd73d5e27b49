"""Schedules as values: programs of per-worker actions, checked and simulated before running.

Nothing here knows about tensors: a schedule compiles to a :class:`Program`, which can be
printed, validated, transformed (rematerialisation) and simulated on its own (time under
:class:`Costs`, which can be fitted to a recorded step; memory in bytes under
:class:`Memory`), exchanged with ``torch.distributed.pipelining`` as CSV, drawn, and traced
for Perfetto. :func:`list_schedule` builds programs from a priority rule and an in-flight
cap; :func:`choose_schedule` picks the fastest program that fits a memory budget.
Hypothesis strategies for testing schedules are in :mod:`fpipe.schedules.strategies` (not
imported here).
"""

from fpipe.schedules.actions import (
    Action,
    B,
    F,
    I,
    Op,
    Overlap,
    Program,
    R,
    W,
    placement_of,
    program_of,
)
from fpipe.schedules.builder import ListScheduled, backward_first, forward_first, list_schedule
from fpipe.schedules.colocate import colocate
from fpipe.schedules.controllable_v import ControllableV, v_half, v_min
from fpipe.schedules.csv_format import from_csv, to_csv
from fpipe.schedules.dualpipe import DualPipeV, dual_pipe_v
from fpipe.schedules.gpipe import GPipeSchedule, gpipe
from fpipe.schedules.interleaved import (
    InterleavedOneFOneB,
    InterleavedZeroBubble,
    LoopedBFS,
    interleaved_one_f_one_b,
    interleaved_zero_bubble,
    looped_bfs,
)
from fpipe.schedules.memory import Memory, check_memory, peak_bytes
from fpipe.schedules.one_f_one_b import OneFOneB, one_f_one_b
from fpipe.schedules.remat import apply_remat, normalize_remat
from fpipe.schedules.render import draw, listing, render
from fpipe.schedules.search import FAMILIES, Choice, Trial, choose_schedule
from fpipe.schedules.simulate import (
    Breakdown,
    Costs,
    Simulation,
    Span,
    UnmeasuredCostWarning,
    in_flight,
    simulate,
)
from fpipe.schedules.trace import chrome_trace, write_chrome_trace
from fpipe.schedules.validate import ScheduleError, StageCountError, validate
from fpipe.schedules.zero_bubble import ZeroBubble, ZeroBubbleV, zero_bubble, zero_bubble_v

__all__ = [
    "Action", "Op", "Program", "ScheduleError", "validate", "gpipe", "one_f_one_b", "GPipeSchedule",
    "OneFOneB", "Costs", "simulate", "Simulation", "Span", "apply_remat", "normalize_remat",
    "in_flight", "colocate", "program_of", "to_csv", "from_csv", "render", "draw", "listing",
    "chrome_trace", "write_chrome_trace", "interleaved_one_f_one_b", "looped_bfs",
    "zero_bubble", "zero_bubble_v", "InterleavedOneFOneB", "LoopedBFS", "ZeroBubble",
    "ZeroBubbleV", "Breakdown",
    "Memory", "peak_bytes", "check_memory", "choose_schedule", "Choice", "Trial", "FAMILIES",
    "StageCountError", "list_schedule", "ListScheduled", "backward_first", "forward_first",
    "dual_pipe_v", "DualPipeV", "interleaved_zero_bubble", "InterleavedZeroBubble",
    "placement_of", "F", "R", "B", "I", "W", "Overlap", "UnmeasuredCostWarning",
    "v_half", "v_min", "ControllableV",
]
