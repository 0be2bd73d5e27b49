"""Hypothesis strategies for schedules and programs, shared by the schedule tests.

Valid and corrupted programs come from the public :mod:`fpipe.schedules.strategies`; here are
the shipped constructors' cases and the tests' own statement of the dependency rules.
"""

from hypothesis import strategies as st

from fpipe.schedules import (
    Action,
    Op,
    gpipe,
    interleaved_one_f_one_b,
    looped_bfs,
    one_f_one_b,
    zero_bubble,
    zero_bubble_v,
)
from fpipe.schedules.strategies import corruptions, programs, remat_policies

__all__ = ["SCHEDULES", "RESEARCH", "needs", "schedule_cases", "research_cases", "programs",
           "corruptions", "remat_policies"]

#: One stage per worker, stage k on worker k: ``make(chunks, remat)``.
SCHEDULES = (gpipe, one_f_one_b)
#: The research schedules, each with a stage count it accepts for a number of workers.
RESEARCH = ("interleaved_one_f_one_b", "looped_bfs", "zero_bubble", "zero_bubble_v")
F, R, B, I, W = Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def needs(action, program):
    """The test's own statement of the dependency rules: {dependency: rule}."""
    present = {a for w in program.workers for a in w}
    s, m = action.stage, action.microbatch
    if action.op is F:
        return {Action(s - 1, F, m): "forward-order"} if s else {}
    if action.op is R:
        return {Action(s, F, m): "recompute-after-forward"}
    if action.op is W:
        return {Action(s, I, m): "weight-after-input"}
    out = {Action(s, F, m): "backward-after-forward"}
    if Action(s, R, m) in present:
        out[Action(s, R, m)] = "backward-after-recompute"
    for op in (B, I):
        if Action(s + 1, op, m) in present:
            out[Action(s + 1, op, m)] = "backward-order"
    return out


@st.composite
def schedule_cases(draw, max_stages: int = 8, max_chunks: int = 16):
    """(schedule, n_stages) for a random constructor, chunk count and remat policy."""
    n_stages = draw(st.integers(1, max_stages))
    make = draw(st.sampled_from(SCHEDULES))
    schedule = make(draw(st.integers(1, max_chunks)), draw(remat_policies(n_stages)))
    return schedule, n_stages


@st.composite
def research_cases(draw, max_workers: int = 8, max_chunks: int = 16, max_per_worker: int = 4):
    """(schedule, n_stages) for a research schedule: K workers, and v stages per worker for the
    looped ones (n_stages = K*v) or two for ZB-V (n_stages = 2K)."""
    name = draw(st.sampled_from(RESEARCH))
    n_workers = draw(st.integers(1, max_workers))
    chunks = draw(st.integers(1, max_chunks))
    if name in ("interleaved_one_f_one_b", "looped_bfs"):
        per_worker = draw(st.integers(1, max_per_worker))
        n_stages = n_workers * per_worker
        make = interleaved_one_f_one_b if name == "interleaved_one_f_one_b" else looped_bfs
        return make(chunks, per_worker, draw(remat_policies(n_stages))), n_stages
    n_stages = n_workers * (2 if name == "zero_bubble_v" else 1)
    make = zero_bubble_v if name == "zero_bubble_v" else zero_bubble
    return make(chunks, draw(remat_policies(n_stages))), n_stages
