"""Hypothesis strategies for schedules and programs, shared by the schedule tests."""

from hypothesis import strategies as st

from fpipe.schedules import Action, Op, Program, gpipe, one_f_one_b
from fpipe.schedules.remat import POLICIES
from fpipe.schedules.validate import execution_order

SCHEDULES = (gpipe, one_f_one_b)
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


def remat_policies(n_stages: int) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(POLICIES), st.frozensets(st.integers(0, n_stages - 1)))


@st.composite
def schedule_cases(draw, max_stages: int = 8, max_chunks: int = 16):
    """(schedule, n_stages) for a random constructor, chunk count and remat policy."""
    n_stages = draw(st.integers(1, max_stages))
    make = draw(st.sampled_from(SCHEDULES))
    schedule = make(draw(st.integers(1, max_chunks)), draw(remat_policies(n_stages)))
    return schedule, n_stages


@st.composite
def programs(draw, max_stages: int = 6, max_chunks: int = 6):
    """Any valid training program, not only the constructors' shapes.

    A schedule's program is flattened to a global order, its backwards optionally split into
    I and W (W right after I, or deferred to the end), and the order projected onto a random
    placement of stages on workers: a projection of a global order cannot deadlock.
    """
    schedule, n_stages = draw(schedule_cases(max_stages, max_chunks))
    program = schedule.program(n_stages)
    order = list(execution_order(program))
    if draw(st.booleans()):
        deferred = []
        split = []
        for action in order:
            if action.op is not B:
                split.append(action)
                continue
            split.append(Action(action.stage, I, action.microbatch))
            weight = Action(action.stage, W, action.microbatch)
            (deferred if draw(st.booleans()) else split).append(weight)
        order = split + deferred
    n_workers = draw(st.integers(1, n_stages))
    placement = draw(st.lists(st.integers(0, n_workers - 1), min_size=n_stages,
                              max_size=n_stages))
    workers = [[a for a in order if placement[a.stage] == w] for w in range(n_workers)]
    return Program(workers, n_stages, program.n_microbatches)
