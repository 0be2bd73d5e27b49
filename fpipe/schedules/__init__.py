"""Schedules as values: programs of per-worker actions, checked and simulated before running.

Nothing here knows about tensors: a schedule compiles to a :class:`Program`, which can be
printed, validated, transformed (rematerialisation) and simulated on its own.
"""

from fpipe.schedules.actions import Action, Op, Program
from fpipe.schedules.colocate import colocate
from fpipe.schedules.gpipe import GPipe, gpipe
from fpipe.schedules.interleaved import (
    InterleavedOneFOneB,
    LoopedBFS,
    interleaved_one_f_one_b,
    looped_bfs,
)
from fpipe.schedules.one_f_one_b import OneFOneB, one_f_one_b
from fpipe.schedules.remat import apply_remat, normalize_remat
from fpipe.schedules.simulate import Costs, Simulation, in_flight, simulate
from fpipe.schedules.validate import ScheduleError, validate
from fpipe.schedules.zero_bubble import ZeroBubble, ZeroBubbleV, zero_bubble, zero_bubble_v

__all__ = [
    "Action", "Op", "Program", "ScheduleError", "validate", "gpipe", "one_f_one_b", "GPipe",
    "OneFOneB", "Costs", "simulate", "Simulation", "apply_remat", "normalize_remat", "in_flight",
    "colocate", "interleaved_one_f_one_b", "looped_bfs", "zero_bubble", "zero_bubble_v",
    "InterleavedOneFOneB", "LoopedBFS", "ZeroBubble", "ZeroBubbleV",
]
