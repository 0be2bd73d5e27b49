"""Hypothesis strategies for property-testing schedules: valid programs, and broken ones.

``programs()`` draws valid training programs of many shapes: the shipped families' and any
order the rules allow, several stages per worker, idle workers, split backwards (``I`` and
``W``), recomputes (``R``), overlapped pairs; most of them with several busy workers, stages
and micro-batches.
``corruptions(programs())`` draws ``(program, rule)`` pairs: a valid program with one small
fault that :func:`fpipe.schedules.validate` rejects naming ``rule``. A schedule constructor can
be held to the rules with them::

    from hypothesis import given
    from fpipe.schedules.strategies import programs, corruptions

    @given(corruptions(my_programs()))
    def test_my_checker_agrees(case):
        program, rule = case
        assert my_checker(program) == rule

This module needs hypothesis, which fpipe does not: ``fpipe.schedules`` never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - exercised without hypothesis installed
    raise ImportError(
        "fpipe.schedules.strategies needs hypothesis: pip install hypothesis"
    ) from error

from fpipe.schedules import _orders
from fpipe.schedules.actions import Action, B, F, I, Program, R, W
from fpipe.schedules.remat import POLICIES
from fpipe.schedules.validate import dependencies, execution_order, validate

__all__ = ["programs", "corruptions", "remat_policies", "CORRUPTIONS"]

#: Each kind of corruption, with the rule :func:`~fpipe.schedules.validate` names for it
#: (``None``: the rule depends on the actions involved).
CORRUPTIONS: dict[str, str | None] = {
    "deadlock": "deadlock",                 # each worker's order fine, together circular
    "reorder": None,                        # an action moved before a dependency on its worker
    "weight-before-input": "weight-after-input",
    "wrong-worker": "stage-placement",      # an action moved to another worker
    "stage-out-of-range": "index-range",    # an action of a stage beyond n_stages
    "microbatch-out-of-range": "index-range",
    "drop": "exactly-once",                 # an action (not a recompute) removed
    "duplicate": "exactly-once",            # an action repeated on its worker
    "full-and-split": "exactly-once",       # a pair with both B and I/W
    "missing-stage": "exactly-once",        # one more stage declared than the actions cover
    "missing-microbatch": "exactly-once",   # one more micro-batch declared
    "no-workers": "no-workers",
}


def remat_policies(n_stages: int) -> st.SearchStrategy:
    """A rematerialisation policy for ``n_stages`` stages: a named one or a set of stages."""
    return st.one_of(st.sampled_from(POLICIES), st.frozensets(st.integers(0, n_stages - 1)))


@st.composite
def programs(draw, max_stages: int = 6, max_microbatches: int = 6, *,
             max_workers: int | None = None, split: bool | None = None,
             remat: bool | None = None, overlap: bool | None = None,
             training: bool = True) -> Program:
    """A valid program for 1 to ``max_stages`` stages and 1 to ``max_microbatches``
    micro-batches, on 1 to ``max_workers`` workers (default: as many as stages).

    An order of all actions that respects every dependency (the order of a shipped schedule of
    any family that fits the sizes, or any order at all) is projected onto workers: the
    family's own placement, contiguous blocks of stages, or a random placement, so several
    stages may share a worker and a worker may hold none; a projection of one global order
    cannot deadlock. Sizes lean large: at least 4 stages, 4 micro-batches and 2 workers in
    three draws of four each, where the bounds allow.

    ``split`` makes every backward a split one (``True``), none (``False``), or draws per
    program, all, none or some (``None``); ``remat`` likewise adds recomputes, and
    ``overlap`` overlapped pairs (:class:`~fpipe.schedules.Overlap`: a forward and a backward
    of another stage and micro-batch on its worker, moved right after it where that keeps the
    order valid). With ``training=False`` the program holds only its forwards (inference).
    """
    n_stages = _orders.size(draw, max_stages, _orders.LARGE_STAGES)
    n_mb = _orders.size(draw, max_microbatches, _orders.LARGE_MICROBATCHES)
    most = max(1, max_workers or n_stages)
    own = None
    if draw(st.booleans()):
        _, base = draw(_orders.shipped(n_stages, n_mb))
        order = _orders.reshaped(draw, base, split, remat)
        if base.n_workers <= most and draw(st.booleans()):
            own = (base.n_workers, list(base.placement))
    else:
        order = draw(_orders.any_order(n_stages, n_mb, split, remat))
    n_workers, placement = own or _orders.placement(draw, n_stages, most)
    pairs: set = set()
    if training:
        order, pairs = _orders.with_pairs(draw, order, placement, n_stages, overlap)
    workers = [[a for a in order if placement[a.stage] == w] for w in range(n_workers)]
    program = Program(workers, n_stages, n_mb, pairs)
    return program if training else program.forward_only()


@st.composite
def corruptions(draw, base: st.SearchStrategy[Program] | None = None, *,
                kinds: Iterable[str] | None = None) -> tuple[Program, str]:
    """``(program, rule)``: a program drawn from ``base`` (default :func:`programs`) with one
    fault, and the rule :func:`~fpipe.schedules.validate` names for it.

    ``base`` must draw valid training programs. ``kinds`` limits the faults to some of
    :data:`CORRUPTIONS`; examples where none of them applies are rejected.
    """
    kinds = tuple(CORRUPTIONS) if kinds is None else tuple(kinds)
    unknown = [k for k in kinds if k not in CORRUPTIONS]
    if unknown or not kinds:
        raise ValueError(f"unknown corruption kinds {unknown}: expected some of "
                         f"{', '.join(CORRUPTIONS)}")
    program = validate(draw(programs() if base is None else base))
    assume(any(a.op is not F for actions in program.workers for a in actions))
    applicable = [k for k in kinds if _APPLIES[k](program)]
    assume(applicable)
    kind = draw(st.sampled_from(applicable))
    return _CORRUPT[kind](draw, program)


# Each corruption: whether it applies to a program, and how to apply it. The comments say why
# validate() names exactly the rule returned, given the order it checks the rules in (ranges,
# placement, exactly-once, each worker's order, deadlock) and that the program was valid.

def _where(program: Program, keep=lambda a: True) -> list[tuple[int, int]]:
    return [(w, i) for w, actions in enumerate(program.workers)
            for i, a in enumerate(actions) if keep(a)]


def _edit(program: Program, worker: int, actions: list[Action]) -> Program:
    workers = list(program.workers)
    workers[worker] = tuple(actions)
    return Program(workers, program.n_stages, program.n_microbatches)


def _drop(draw, program):
    # Dropping a recompute leaves a valid program; any other action leaves its pair short.
    worker, index = draw(st.sampled_from(_where(program, lambda a: a.op is not R)))
    actions = list(program.workers[worker])
    del actions[index]
    return _edit(program, worker, actions), "exactly-once"


def _duplicate(draw, program):
    # On its own worker, so placement still holds.
    worker, index = draw(st.sampled_from(_where(program)))
    actions = list(program.workers[worker])
    actions.insert(draw(st.integers(0, len(actions))), actions[index])
    return _edit(program, worker, actions), "exactly-once"


def _full_and_split(draw, program):
    worker, index = draw(st.sampled_from(_where(program, lambda a: a.op in (B, I))))
    actions = list(program.workers[worker])
    a = actions[index]
    extra = ([Action(a.stage, I, a.microbatch), Action(a.stage, W, a.microbatch)]
             if a.op is B else [Action(a.stage, B, a.microbatch)])
    actions[index + 1:index + 1] = extra
    return _edit(program, worker, actions), "exactly-once"


def _missing_stage(draw, program):
    return Program(program.workers, program.n_stages + 1, program.n_microbatches), "exactly-once"


def _missing_microbatch(draw, program):
    return Program(program.workers, program.n_stages, program.n_microbatches + 1), "exactly-once"


def _out_of_range(field: str):
    def corrupt(draw, program):
        worker, index = draw(st.sampled_from(_where(program)))
        actions = list(program.workers[worker])
        a = actions[index]
        beyond = draw(st.integers(0, 3))
        actions[index] = (Action(program.n_stages + beyond, a.op, a.microbatch)
                          if field == "stage" else
                          Action(a.stage, a.op, program.n_microbatches + beyond))
        return _edit(program, worker, actions), "index-range"
    return corrupt


def _wrong_worker(draw, program):
    # Every stage of a training program has at least two actions: one stays behind.
    workers = [list(actions) for actions in program.workers]
    if len(workers) == 1:
        workers.append([])
    source, index = draw(st.sampled_from(_where(program)))
    target = draw(st.sampled_from([w for w in range(len(workers)) if w != source]))
    moved = workers[source].pop(index)
    workers[target].insert(draw(st.integers(0, len(workers[target]))), moved)
    return Program(workers, program.n_stages, program.n_microbatches), "stage-placement"


def _local_needs(program: Program, keep=lambda a: True) -> list[tuple[int, Action, Action]]:
    """(worker, action, the latest dependency of it on the same worker)."""
    present = frozenset(a for actions in program.workers for a in actions)
    out = []
    for worker, actions in enumerate(program.workers):
        index = {a: i for i, a in enumerate(actions)}
        for action in actions:
            local = [d for d, _ in dependencies(action, present, program.n_stages) if d in index]
            if local and keep(action):
                out.append((worker, action, max(local, key=index.__getitem__)))
    return out


def _move_before(program: Program, worker: int, action: Action, need: Action) -> Program:
    # Put ``action`` right before ``need``: every other same-worker dependency of it stays
    # earlier, nothing between depended on it (the program was valid), and the actions before
    # it are untouched, so the first broken order rule is the one between it and ``need``.
    actions = [a for a in program.workers[worker] if a != action]
    actions.insert(actions.index(need), action)
    return _edit(program, worker, actions)


def _reorder(draw, program):
    worker, action, need = draw(st.sampled_from(_local_needs(program)))
    present = frozenset(a for actions in program.workers for a in actions)
    rule = dict(dependencies(action, present, program.n_stages))[need]
    return _move_before(program, worker, action, need), rule


def _weight_before_input(draw, program):
    worker, action, need = draw(st.sampled_from(_local_needs(program, lambda a: a.op is W)))
    return _move_before(program, worker, action, need), "weight-after-input"


@lru_cache(maxsize=32)
def _deadlock_moves(program: Program) -> list[tuple[int, int, int]]:
    """(worker, i, j): moving the worker's action i to just after its action j deadlocks.

    Consider the graph of dependencies and of each worker's order. Action ``d`` at i, and
    ``x`` at j > i on the same worker, with ``x`` reachable from ``d`` through a dependency on
    another worker. Moving ``d`` after ``x`` keeps that path (the other actions keep their
    order) and adds ``x -> d``: a cycle, so no global order. No worker-order rule breaks as
    long as no action at i+1..j depends on ``d`` directly.
    """
    present = frozenset(a for actions in program.workers for a in actions)
    worker_of = {a: w for w, actions in enumerate(program.workers) for a in actions}
    bit = {a: 1 << n for n, a in enumerate(present)}
    users: dict[Action, list[Action]] = {a: [] for a in present}
    for a in present:
        for need, _ in dependencies(a, present, program.n_stages):
            users[need].append(a)
    following = {actions[i]: actions[i + 1] for actions in program.workers
                 for i in range(len(actions) - 1)}
    reach: dict[Action, int] = {}
    for a in reversed(execution_order(program)):
        after = users[a] + ([following[a]] if a in following else [])
        reach[a] = 0
        for b in after:
            reach[a] |= bit[b] | reach[b]
    moves = []
    for w, actions in enumerate(program.workers):
        for i, d in enumerate(actions):
            around = 0
            for user in users[d]:
                if worker_of[user] != w:
                    around |= bit[user] | reach[user]
            direct = set(users[d])
            for j in range(i + 1, len(actions)):
                if actions[j] in direct:
                    break
                if around & bit[actions[j]]:
                    moves.append((w, i, j))
    return tuple(moves)


def _deadlock(draw, program):
    worker, i, j = draw(st.sampled_from(_deadlock_moves(program)))
    actions = list(program.workers[worker])
    moved = actions[i]
    actions.insert(j + 1, moved)
    del actions[i]
    return _edit(program, worker, actions), "deadlock"


def _no_workers(draw, program):
    return Program([], program.n_stages, program.n_microbatches), "no-workers"


def _has(op):
    return lambda p: any(a.op is op for actions in p.workers for a in actions)


_APPLIES = {
    "drop": lambda p: True,
    "duplicate": lambda p: True,
    "full-and-split": lambda p: True,
    "missing-stage": lambda p: True,
    "missing-microbatch": lambda p: True,
    "stage-out-of-range": lambda p: True,
    "microbatch-out-of-range": lambda p: True,
    "wrong-worker": lambda p: True,
    "reorder": lambda p: True,
    "weight-before-input": _has(W),
    "deadlock": lambda p: bool(_deadlock_moves(p)),
    "no-workers": lambda p: True,
}

_CORRUPT = {
    "drop": _drop,
    "duplicate": _duplicate,
    "full-and-split": _full_and_split,
    "missing-stage": _missing_stage,
    "missing-microbatch": _missing_microbatch,
    "stage-out-of-range": _out_of_range("stage"),
    "microbatch-out-of-range": _out_of_range("microbatch"),
    "wrong-worker": _wrong_worker,
    "reorder": _reorder,
    "weight-before-input": _weight_before_input,
    "deadlock": _deadlock,
    "no-workers": _no_workers,
}
