"""The orders :func:`fpipe.schedules.strategies.programs` projects onto workers: a shipped
family's, reshaped, or any order at all; the sizes and placements it draws; the overlapped pairs
it adds. Needs hypothesis, like :mod:`fpipe.schedules.strategies`, which alone imports it.

Why these draws: a strategy that mostly drew one busy worker, two stages or one micro-batch
would leave the interesting programs (several busy workers, each holding several stages over
several micro-batches, pairs overlapped) to luck, so sizes lean large and placements keep
workers busy, while every small case stays reachable (and is where shrinking goes).
"""

from __future__ import annotations

from hypothesis import strategies as st

from fpipe.schedules.actions import Action, B, F, I, Overlap, Program, R, W
from fpipe.schedules.search import FAMILIES
from fpipe.schedules.validate import dependencies, execution_order

__all__: list[str] = []

#: The sizes the strategies lean to: at least this many stages, micro-batches (and workers,
#: below) in three draws of four, where the bounds allow.
LARGE_STAGES, LARGE_MICROBATCHES, LARGE_WORKERS = 4, 4, 2


def size(draw, most: int, large: int) -> int:
    """1 to ``most``, at least ``large`` (where ``most`` allows) in three draws of four."""
    if draw(st.integers(0, 3)):
        return draw(st.integers(min(large, most), most))
    return draw(st.integers(1, most))


def fitting_families(n_stages: int, n_mb: int) -> dict[str, Program]:
    """Each shipped family (:data:`~fpipe.schedules.search.FAMILIES`) that can build a program
    of these sizes, with it: on the most workers the family allows (looped ones, two stages or
    more per worker; V shapes, 2K stages on K)."""
    found = {}
    for name, family in FAMILIES.items():  # the most workers that fit
        for n_workers in range(n_stages, 0, -1):
            schedule = family(n_mb, "never", n_stages, n_workers)
            if schedule is not None:
                found[name] = schedule.program(n_stages)
                break
    return found


@st.composite
def shipped(draw, n_stages: int, n_mb: int) -> tuple[str, Program]:
    """A shipped family that fits these sizes, drawn, and its program."""
    found = fitting_families(n_stages, n_mb)
    name = draw(st.sampled_from(sorted(found)))
    return name, found[name]


def drawn_pairs(draw, choice: bool | None, pairs: list) -> set:
    """All pairs, none, or (``choice`` None) all, none or a random subset."""
    if choice is None:
        choice = draw(st.sampled_from([True, False, None]))
    if choice is None:
        return {p for p in pairs if draw(st.booleans())}
    return set(pairs) if choice else set()


def reshaped(draw, program: Program, split: bool | None, remat: bool | None) -> list[Action]:
    """A global order of ``program`` with its backwards split as drawn (a full ``B`` becomes
    ``I`` with its ``W`` right after or deferred to the end; a split one not drawn becomes
    ``B`` where its ``I`` was, its ``W`` dropped) and recomputes right before backwards."""
    n_stages, n_mb = program.n_stages, program.n_microbatches
    pairs = [(s, m) for s in range(n_stages) for m in range(n_mb)]
    splits = drawn_pairs(draw, split, pairs)
    redo = drawn_pairs(draw, remat, pairs)
    order, deferred = [], []
    for action in execution_order(program):
        pair = (action.stage, action.microbatch)
        if action.op is W:
            if pair in splits:
                order.append(action)
            continue
        if action.op not in (B, I):
            order.append(action)
            continue
        if pair in redo:
            order.append(Action(action.stage, R, action.microbatch))
        if pair not in splits:
            order.append(Action(action.stage, B, action.microbatch))
            continue
        order.append(Action(action.stage, I, action.microbatch))
        if action.op is B:
            weight = Action(action.stage, W, action.microbatch)
            (deferred if draw(st.booleans()) else order).append(weight)
    return order + deferred


@st.composite
def any_order(draw, n_stages: int, n_mb: int, split: bool | None,
              remat: bool | None) -> list[Action]:
    """Any order of the actions that respects every dependency: at each step, one of the
    actions whose dependencies are done, drawn."""
    pairs = [(s, m) for s in range(n_stages) for m in range(n_mb)]
    splits = drawn_pairs(draw, split, pairs)
    redo = drawn_pairs(draw, remat, pairs)
    actions = []
    for s, m in pairs:
        actions.append(Action(s, F, m))
        if (s, m) in redo:
            actions.append(Action(s, R, m))
        actions += [Action(s, I, m), Action(s, W, m)] if (s, m) in splits else [Action(s, B, m)]
    present = frozenset(actions)
    waiting = {a: len(dependencies(a, present, n_stages)) for a in actions}
    unlocks: dict[Action, list[Action]] = {a: [] for a in actions}
    for action in actions:
        for need, _ in dependencies(action, present, n_stages):
            unlocks[need].append(action)
    ready = [a for a in actions if waiting[a] == 0]
    order = []
    while ready:
        action = ready.pop(draw(st.integers(0, len(ready) - 1)))
        order.append(action)
        for later in unlocks[action]:
            waiting[later] -= 1
            if waiting[later] == 0:
                ready.append(later)
    return order


def placement(draw, n_stages: int, most: int) -> tuple[int, list[int]]:
    """A number of workers and a worker per stage: contiguous blocks on workers none of which
    is empty (a model cut in order), or any worker for each stage (several stages may share
    one, and one may hold none)."""
    n_workers = size(draw, most, LARGE_WORKERS)
    if draw(st.booleans()):
        k = min(n_workers, n_stages)
        cuts = draw(st.lists(st.integers(1, n_stages - 1), min_size=k - 1, max_size=k - 1,
                             unique=True)) if k > 1 else []
        return k, [sum(c <= s for c in cuts) for s in range(n_stages)]
    return n_workers, [draw(st.integers(0, n_workers - 1)) for _ in range(n_stages)]


def with_pairs(draw, order: list[Action], placement: list[int], n_stages: int,
               choice: bool | None) -> tuple[list[Action], set[Overlap]]:
    """``order`` with overlapped pairs made in it: a forward, and right after it a backward
    (``B`` or ``I``) of another stage and micro-batch on the same worker, moved up from later
    in ``order``; only a backward whose inputs all come before the forward, so that ``order``
    stays a valid execution running each pair as one unit. ``choice``: pair each forward that
    can be (``True``), none (``False``), or draw all, none or each forward (``None``)."""
    if choice is None:  # pairs are rare where the order allows them: every one, half the time
        choice = draw(st.sampled_from([True, True, None, False]))
    if choice is False:
        return order, set()
    order, present, pairs, used = list(order), frozenset(order), set(), set()
    for i, f in enumerate(order):
        if f.op is not F or f in used:
            continue
        at = {a: k for k, a in enumerate(order)}
        partners = [b for b in order[i + 1:]
                    if b.op in (B, I) and b not in used and placement[b.stage] ==
                    placement[f.stage] and b.stage != f.stage and b.microbatch != f.microbatch
                    and all(at[need] < i for need, _ in dependencies(b, present, n_stages))]
        if not partners or (choice is None and not draw(st.booleans())):
            continue
        b = partners[draw(st.integers(0, len(partners) - 1))]
        order.remove(b)
        order.insert(i + 1, b)
        used |= {f, b}
        pairs.add(Overlap(f, b))
    return order, pairs
