"""The rules every program obeys (contract 6 of DESIGN.md), checked before anything runs.

A broken program would otherwise surface as a hang or a wrong gradient deep inside a driver;
here it surfaces as a :class:`ScheduleError` that names the rule, the action and the worker.
All checks are linear in the number of actions, so programs of thousands of actions are cheap.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Container

from fpipe.schedules.actions import Action, B, F, I, Op, Overlap, Program, R, W


class ScheduleError(ValueError):
    """A program breaks ``rule`` (short, kebab-case) at ``action`` on ``worker``.

    ``action`` and ``worker`` are ``None`` where the rule concerns no single one of them (a
    program without workers) or where no worker holds the action (a missing action of a stage
    that appears nowhere). ``context`` is the program as written around the action, which is
    marked ``[like this]`` (see :func:`fpipe.schedules.render.listing`); the message shows it
    below its first line.
    """

    def __init__(self, rule: str, explanation: str, action: Action | None = None,
                 worker: int | None = None, context: str = "") -> None:
        where = "".join([
            f" at action {action}" if action is not None else "",
            f" on worker {worker}" if worker is not None else "",
        ])
        message = f"schedule rule '{rule}' broken{where}: {explanation}"
        if context:
            message += "\n" + "\n".join("  " + line for line in context.splitlines())
        super().__init__(message)
        self.rule = rule
        self.explanation = explanation
        self.action = action
        self.worker = worker
        self.context = context

    def __reduce__(self):
        return type(self), (self.rule, self.explanation, self.action, self.worker, self.context)


class StageCountError(ScheduleError, TypeError):
    """A schedule cannot give a program for the stage count asked (rule ``stage-count``),
    whatever its form: a ``Program`` for another count, a schedule value whose placement
    cannot hold that many stages, a function returning a program for another count, or a
    count that is not a positive integer.

    It is a :class:`ScheduleError` (so a ValueError) and a TypeError, so code catching either
    for a wrong stage count keeps working.
    """

    def __init__(self, explanation: str, *args: object, **kwargs: object) -> None:
        if args or kwargs:  # unpickling passes ScheduleError's fields
            super().__init__(explanation, *args, **kwargs)  # type: ignore[arg-type]
        else:
            super().__init__("stage-count", explanation)

    def __reduce__(self):
        return type(self), (self.explanation,)


def dependencies(action: Action, present: Container[Action],
                 n_stages: int) -> tuple[tuple[Action, str], ...]:
    """What must finish before ``action`` can run, each with the rule that names the need.

    ``present`` holds the program's actions: a backward waits for its recompute only if there
    is one, and for the next stage's full backward or, in a split backward, its input part.
    """
    stage, mb = action.stage, action.microbatch
    if action.op is F:
        return ((Action(stage - 1, F, mb), "forward-order"),) if stage > 0 else ()
    if action.op is R:
        return ((Action(stage, F, mb), "recompute-after-forward"),)
    if action.op is W:
        return ((Action(stage, I, mb), "weight-after-input"),)
    needs = [(Action(stage, F, mb), "backward-after-forward")]
    if Action(stage, R, mb) in present:
        needs.append((Action(stage, R, mb), "backward-after-recompute"))
    if stage + 1 < n_stages:
        later = Action(stage + 1, B, mb)
        needs.append((later if later in present else Action(stage + 1, I, mb), "backward-order"))
    return tuple(needs)


def validate(program: Program, *, training: bool = True) -> Program:
    """Return ``program`` unchanged if it obeys every rule, else raise the first broken one.

    With ``training=False`` (inference, e.g. ``program.forward_only()``) only the forwards are
    required, and any other action is an error.
    """
    if program.n_workers == 0:
        raise ScheduleError("no-workers", "a program needs at least one worker")
    try:
        _check_ranges(program)
        _check_overlaps(program)
        _check_placement(program)
        _check_exactly_once(program, training)
        _check_worker_order(program)
        execution_order(program)
    except ScheduleError as error:
        if error.context:
            raise
        raise _in_context(error, program) from None
    return program


def _in_context(error: ScheduleError, program: Program,
                marks: list[tuple[int, int]] | None = None) -> ScheduleError:
    """``error`` again, showing ``program`` around the marked positions (by default, every
    place its action appears on its worker)."""
    # render imports simulate, which imports this module: import it when an error needs it.
    from fpipe.schedules.render import listing

    if marks is None:
        marks = []
        if error.worker is not None and error.action is not None:
            actions = program.workers[error.worker]
            marks = [(error.worker, i) for i, a in enumerate(actions) if a == error.action]
    return ScheduleError(error.rule, error.explanation, error.action, error.worker,
                         context=listing(program, marks))


def execution_order(program: Program) -> tuple[Action, ...]:
    """A global order of all actions that respects every worker's order and every dependency.

    Each worker advances while its next action's dependencies are done; a worker that waits is
    woken by the action it waits for, so each action is looked at a bounded number of times.
    Assumes the other rules hold; raises the ``deadlock`` rule when no such order exists.
    """
    present = frozenset(a for actions in program.workers for a in actions)
    needs = unit_needs(program, present)
    position = [0] * program.n_workers
    done: set[Action] = set()
    order: list[Action] = []
    waiting: dict[Action, list[int]] = defaultdict(list)
    ready = deque(range(program.n_workers))
    while ready:
        worker = ready.popleft()
        actions = program.workers[worker]
        while position[worker] < len(actions):
            action = actions[position[worker]]
            need = next((d for d in needs(action) if d not in done), None)
            if need is not None:
                waiting[need].append(worker)
                break
            done.add(action)
            order.append(action)
            position[worker] += 1
            ready.extend(waiting.pop(action, ()))
    if len(order) < len(present):
        _raise_deadlock(program, position, present, done)
    return tuple(order)


def _raise_deadlock(program: Program, position: list[int], present: frozenset[Action],
                    done: set[Action]) -> None:
    blocked = {}
    waits_on = {}
    for worker, actions in enumerate(program.workers):
        if position[worker] < len(actions):
            action = actions[position[worker]]
            waiting = [d for d in unit_needs(program, present)(action) if d not in done]
            waits_on[worker] = program.placement[waiting[0].stage]
            blocked[worker] = (action, ", ".join(
                f"{d} (worker {program.placement[d.stage]})" for d in waiting))
    # Each blocked worker waits on another blocked one: following the waits finds a cycle.
    worker = next(iter(blocked))
    path: list[int] = []
    while worker not in path:
        path.append(worker)
        worker = waits_on[worker]
    cycle = path[path.index(worker):]
    shown = sorted(blocked) if len(blocked) <= _MAX_BLOCKED else sorted(cycle)[:_MAX_BLOCKED]
    detail = "; ".join(f"worker {w} is stuck at {blocked[w][0]} waiting for {blocked[w][1]}"
                       for w in shown)
    if len(shown) < len(blocked):
        detail += f"; and {len(blocked) - len(shown)} more workers wait behind them"
    first = min(cycle)
    error = ScheduleError("deadlock", f"the per-worker orders admit no global order: {detail}",
                          blocked[first][0], first)
    marks = [(w, position[w]) for w in [first, *shown, *blocked]]
    raise _in_context(error, program, marks)


def unit_needs(program: Program, present: Container[Action]):
    """``action -> what must finish before it starts``: its dependencies, and for the forward
    of an :class:`~fpipe.schedules.Overlap` its backward's too, since the pair starts as one
    unit (DeepSeek's runtime receives both inputs before computing either)."""
    partner = {o.forward: o.backward for o in program.overlaps}

    def needs(action: Action) -> list[Action]:
        own = [d for d, _ in dependencies(action, present, program.n_stages)]
        paired = partner.get(action)
        if paired is not None:
            own += [d for d, _ in dependencies(paired, present, program.n_stages)]
        return own

    return needs


#: A deadlock names at most this many stuck workers (those on the cycle, when there are more).
_MAX_BLOCKED = 6


def _check_ranges(program: Program) -> None:
    for worker, actions in enumerate(program.workers):
        for action in actions:
            if not 0 <= action.stage < program.n_stages:
                raise ScheduleError(
                    "index-range",
                    f"stage {action.stage} is outside [0, {program.n_stages})", action, worker,
                )
            if not 0 <= action.microbatch < program.n_microbatches:
                raise ScheduleError(
                    "index-range",
                    f"micro-batch {action.microbatch} is outside [0, {program.n_microbatches})",
                    action, worker,
                )


def _check_placement(program: Program) -> None:
    """One worker per stage: its parameters, and the activations it keeps, live in one place."""
    for worker, actions in enumerate(program.workers):
        for action in actions:
            home = program.placement[action.stage]
            if home != worker:
                raise ScheduleError(
                    "stage-placement",
                    f"stage {action.stage} is held by worker {home}, but this action of it is "
                    f"on worker {worker}; all actions of a stage must be on one worker",
                    action, worker,
                )


def _check_exactly_once(program: Program, training: bool) -> None:
    seen: set[Action] = set()
    for worker, actions in enumerate(program.workers):
        for action in actions:
            if not training and action.op is not F:
                raise ScheduleError(
                    "forward-only",
                    f"an inference program holds only forwards, not {action.op.name.lower()}",
                    action, worker,
                )
            if action in seen:
                raise ScheduleError(
                    "exactly-once", f"{action} appears more than once", action, worker
                )
            seen.add(action)

    def missing(stage: int, mb: int, op: Op, why: str) -> ScheduleError:
        action = Action(stage, op, mb)
        return ScheduleError("exactly-once", f"{action} is missing: {why}", action,
                             program.placement[stage])

    def mixed(stage: int, mb: int, op: Op) -> ScheduleError:
        action = Action(stage, op, mb)
        return ScheduleError(
            "exactly-once",
            f"stage {stage}, micro-batch {mb} has both a full backward {stage}B{mb} and a split "
            f"backward part {action}; use either B, or I and W",
            action, program.placement[stage],
        )

    for stage in range(program.n_stages):
        for mb in range(program.n_microbatches):
            if Action(stage, F, mb) not in seen:
                raise missing(stage, mb, F, "every (stage, micro-batch) runs forward once")
            if not training:
                continue
            has = {op: Action(stage, op, mb) in seen for op in (B, I, W)}
            if has[B] and has[I]:
                raise mixed(stage, mb, I)
            if has[B] and has[W]:
                raise mixed(stage, mb, W)
            if not (has[B] or has[I] or has[W]):
                raise missing(stage, mb, B, "every (stage, micro-batch) runs backward once")
            if has[I] and not has[W]:
                raise missing(stage, mb, W, "a split backward needs its weight-gradient part")
            if has[W] and not has[I]:
                raise missing(stage, mb, I, "a split backward needs its input-gradient part")


def _check_overlaps(program: Program) -> None:
    """Each pair is one forward and one backward (``B`` or ``I``) that do not depend on each
    other (other stages, other micro-batches: a backward needs every forward of its
    micro-batch), run back to back on one worker, each action in one pair at most."""
    if not program.overlaps:
        return
    where = {a: (w, i) for w, actions in enumerate(program.workers)
             for i, a in enumerate(actions)}
    seen: dict[Action, Overlap] = {}
    for pair in sorted(program.overlaps, key=lambda o: where.get(o.forward, (-1, -1))):
        f, b = pair.forward, pair.backward
        worker = where.get(f, (None,))[0]
        if f.op is not F or b.op not in (B, I):
            raise ScheduleError("overlap", f"{pair} must pair a forward (F) with a backward "
                                f"(B or I), got {f.op.name.lower()} and {b.op.name.lower()}",
                                f, worker)
        if f.stage == b.stage or f.microbatch == b.microbatch:
            raise ScheduleError(
                "overlap", f"{pair} pairs actions that are not independent: the forward and "
                f"the backward must be of different stages and of different micro-batches (a "
                f"backward needs every forward of its micro-batch)", f, worker)
        for action in pair.actions:
            if action in seen:
                raise ScheduleError("overlap", f"{action} is in two pairs, {seen[action]} and "
                                    f"{pair}", action, where.get(action, (None,))[0])
            seen[action] = pair
            if action not in where:
                raise ScheduleError("overlap", f"{pair} names {action}, which no worker runs",
                                    action, None)
        (wf, i), (wb, j) = where[f], where[b]
        if wf != wb or j != i + 1:
            raise ScheduleError("overlap", f"{pair} must run on one worker, its backward right "
                                f"after its forward", f, wf)


def _check_worker_order(program: Program) -> None:
    """A dependency held by the same worker must come earlier in that worker's list."""
    present = frozenset(a for actions in program.workers for a in actions)
    for worker, actions in enumerate(program.workers):
        index = {action: i for i, action in enumerate(actions)}
        for i, action in enumerate(actions):
            for need, rule in dependencies(action, present, program.n_stages):
                if index.get(need, -1) > i:
                    raise ScheduleError(
                        rule,
                        f"{action} needs {need}, which worker {worker} runs later",
                        action, worker,
                    )
