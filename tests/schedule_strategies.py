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

__all__ = ["SCHEDULES", "RESEARCH", "needs", "run_by_hand", "schedule_cases", "research_cases",
           "programs", "corruptions", "remat_policies"]

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


def run_by_hand(program, training: bool = True) -> str | None:
    """Run ``program`` in a tiny event loop that knows nothing of fpipe's validator: each
    worker runs its next action once the values it needs exist. Returns None if every action
    runs, exactly the actions a step needs are there, each stage stays on one worker; else what
    went wrong, in words.

    What an action needs: a forward, the previous stage's activation (its forward); a
    recompute, the input its forward saved; a backward (``B`` or ``I``), the graph of the
    forward (or of the recompute, when there is one) and, but on the last stage, the cotangent
    from the next stage's backward (``B`` or ``I``); a ``W``, the ``I`` it finishes."""
    if not program.workers:
        return "no workers"
    n, k = program.n_stages, program.n_microbatches
    count: dict = {}
    worker_of: dict = {}
    for w, actions in enumerate(program.workers):
        for a in actions:
            if not (0 <= a.stage < n and 0 <= a.microbatch < k):
                return f"{a} out of range"
            if worker_of.setdefault(a.stage, w) != w:
                return f"stage {a.stage} on workers {worker_of[a.stage]} and {w}"
            count[a] = count.get(a, 0) + 1
    if any(c > 1 for c in count.values()):
        return "an action twice"
    for s in range(n):
        for m in range(k):
            have = {op for op in (F, R, B, I, W) if Action(s, op, m) in count}
            if not training:
                if have != {F}:
                    return f"{s}:{m} has {have} for inference"
            elif have - {R} not in ({F, B}, {F, I, W}):
                return f"{s}:{m} has {sorted(op.name for op in have)}"

    def inputs(a):
        s, m = a.stage, a.microbatch
        if a.op is F:
            return [Action(s - 1, F, m)] if s else []
        if a.op is R:
            return [Action(s, F, m)]
        if a.op is W:
            return [Action(s, I, m)]
        graph = Action(s, R, m) if Action(s, R, m) in count else Action(s, F, m)
        if s == n - 1:
            return [graph]
        cotangent = Action(s + 1, B, m) if Action(s + 1, B, m) in count else Action(s + 1, I, m)
        return [graph, cotangent]

    done: set = set()
    next_of = [0] * len(program.workers)
    progress = True
    while progress:
        progress = False
        for w, actions in enumerate(program.workers):
            while next_of[w] < len(actions) and all(d in done for d in inputs(actions[next_of[w]])):
                done.add(actions[next_of[w]])
                next_of[w] += 1
                progress = True
    if len(done) < len(count):
        return "stuck: " + ", ".join(str(actions[i]) for actions, i in
                                     zip(program.workers, next_of) if i < len(actions))
    return None


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
