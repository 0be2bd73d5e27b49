"""Actions and programs: the plain data a schedule compiles to.

A program says, for each worker, the ordered actions it executes. Nothing here knows about
tensors or devices, so a program can be built, printed, parsed, validated and simulated before
anything runs. Actions print in the spelling of ``torch.distributed.pipelining`` (``2F0`` is
stage 2, forward, micro-batch 0) so schedules can move between the two projects.

An :class:`Overlap` pairs a forward with a backward of another stage on the same worker as one
unit, as DeepSeek's DualPipe runs them: the unit starts once both have their inputs. A
program keeps its workers' actions in a flat order (a pair's forward, then its backward) and
the pairs beside them, so code that only needs the order reads :attr:`Program.workers` and
code that honours the pairs reads :attr:`Program.units`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property


class Op(enum.Enum):
    """What an action does to one (stage, micro-batch)."""

    FORWARD = "F"
    #: Re-run a forward whose activations were dropped, rebuilding what its backward needs.
    RECOMPUTE = "R"
    #: Full backward: gradients with respect to the stage's input and its parameters.
    BACKWARD = "B"
    #: Split backward (zero-bubble schedules): gradient with respect to the input only ...
    BACKWARD_INPUT = "I"
    #: ... and, later, with respect to the parameters.
    BACKWARD_WEIGHT = "W"

    def __repr__(self) -> str:
        return f"Op.{self.name}"


#: :attr:`Op.FORWARD`, for short: ``Action(0, F, 3)``, ``a.op is F``.
F = Op.FORWARD
#: :attr:`Op.RECOMPUTE`, for short.
R = Op.RECOMPUTE
#: :attr:`Op.BACKWARD`, for short.
B = Op.BACKWARD
#: :attr:`Op.BACKWARD_INPUT`, for short.
I = Op.BACKWARD_INPUT  # noqa: E741 (the op's letter, as torch spells it)
#: :attr:`Op.BACKWARD_WEIGHT`, for short.
W = Op.BACKWARD_WEIGHT

_ACTION_RE = re.compile(r"^\s*(\d+)([FRBIW])(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one worker: ``op`` applied to ``stage`` on ``microbatch``."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact spelling, e.g. ``Action.parse("2F0")``."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><op><micro-batch> with op one of "
                f"F, R, B, I, W, e.g. '2F0'"
            )
        stage, op, microbatch = match.groups()
        return cls(int(stage), Op(op), int(microbatch))


_OVERLAP_RE = re.compile(r"^\s*\(([^;()]*);([^;()]*)\)\s*(OVERLAP_F_B)?\s*$")


@dataclass(frozen=True, slots=True)
class Overlap:
    """A forward and a backward (``B`` or ``I``) of two stages on one worker, run as one unit.

    Why: DeepSeek's DualPipe overlaps one micro-batch's forward with another's backward, so
    that each one's communication hides behind the other's compute. The unit starts when the
    inputs of both are there (the forward waits for the backward's gradient too, as DeepSeek's
    runtime receives both before computing), which is what makes its bubble DeepSeek's. The
    two must not depend on each other: other stages, other micro-batches
    (:func:`fpipe.schedules.validate` checks it). It prints as torch spells its overlapped
    action, ``(0F1;1B0)OVERLAP_F_B``.
    """

    forward: Action
    backward: Action

    def __init__(self, forward: ActionLike, backward: ActionLike) -> None:
        object.__setattr__(self, "forward", _as_action(forward))
        object.__setattr__(self, "backward", _as_action(backward))

    @property
    def actions(self) -> tuple[Action, Action]:
        """The forward, then the backward: the order a worker runs them in one at a time."""
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})OVERLAP_F_B"

    def __repr__(self) -> str:
        return f"Overlap({self.forward}, {self.backward})"

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """Parse ``(0F1;1B0)OVERLAP_F_B`` (the suffix may be left out: ``(0F1;1B0)``)."""
        match = _OVERLAP_RE.match(text)
        if match is None:
            raise ValueError(f"cannot parse overlapped pair {text!r}: expected "
                             f"(<forward>;<backward>)OVERLAP_F_B, e.g. '(0F1;1B0)OVERLAP_F_B'")
        return cls(Action.parse(match.group(1)), Action.parse(match.group(2)))


ActionLike = Action | str
#: What a worker's list may hold: actions, and overlapped pairs of them.
Unit = Action | Overlap


def _as_unit(item: object) -> Unit:
    if isinstance(item, (Action, Overlap)):
        return item
    if isinstance(item, str) and item.lstrip().startswith("("):
        return Overlap.parse(item)
    return _as_action(item)  # type: ignore[arg-type]


def _as_action(item: ActionLike) -> Action:
    if isinstance(item, Action):
        return item
    if isinstance(item, str):
        return Action.parse(item)
    raise TypeError(f"expected an Action or a string such as '0F0', got {type(item).__name__}")


@dataclass(frozen=True)
class Program:
    """Per worker, the ordered actions it executes (contract 4 of DESIGN.md).

    ``workers[w]`` is worker ``w``'s tuple of actions. Actions may be given as ``Action`` values
    or as strings like ``"0F0"``, and a forward overlapped with a backward as an
    :class:`Overlap` (or ``"(0F1;1B0)OVERLAP_F_B"``): ``workers`` then holds its two actions in
    order and ``overlaps`` the pair (pairs may also be given there, by their actions). Which
    worker holds which stage follows from the actions; see :attr:`placement`. A program is
    immutable and hashable, and it is its own schedule:
    ``program.program(n_stages)`` returns it, so a hand-written program can be passed wherever a
    schedule is expected.
    """

    workers: tuple[tuple[Action, ...], ...]
    n_stages: int
    n_microbatches: int
    overlaps: frozenset[Overlap]

    def __init__(
        self,
        workers: Iterable[Iterable[ActionLike | Overlap]],
        n_stages: int,
        n_microbatches: int,
        overlaps: Iterable[Overlap] = (),
    ) -> None:
        if isinstance(workers, (str, bytes)):
            raise TypeError("workers must be a sequence of per-worker action sequences")
        pairs = {_as_overlap(o) for o in overlaps}
        flat = []
        for items in workers:
            actions: list[Action] = []
            for unit in map(_as_unit, items):
                if isinstance(unit, Overlap):
                    pairs.add(unit)
                    actions.extend(unit.actions)
                else:
                    actions.append(unit)
            flat.append(tuple(actions))
        object.__setattr__(self, "workers", tuple(flat))
        object.__setattr__(self, "n_stages", positive_int("n_stages", n_stages))
        object.__setattr__(self, "n_microbatches", positive_int("n_microbatches", n_microbatches))
        object.__setattr__(self, "overlaps", frozenset(pairs))

    def __hash__(self) -> int:
        """The fields' hash, computed once: a driver keys its compiled plans by program at
        every step, and hashing every action (and its op, an enum) again was about a tenth
        of a small step's host time in a profile."""
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.workers, self.n_stages, self.n_microbatches, self.overlaps))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self) -> dict:
        """Pickled without the cached hash: an op's hash (its name's) differs between
        processes."""
        return {key: value for key, value in self.__dict__.items() if key != "_hash"}

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @cached_property
    def placement(self) -> tuple[int | None, ...]:
        """The worker holding each stage (``None`` for a stage no action mentions).

        When a stage appears on several workers (an invalid program), the first is reported;
        :func:`fpipe.schedules.validate` rejects such programs.
        """
        where: dict[int, int] = {}
        for worker, actions in enumerate(self.workers):
            for action in actions:
                where.setdefault(action.stage, worker)
        return tuple(where.get(stage) for stage in range(self.n_stages))

    def program(self, n_stages: int) -> Program:
        if n_stages != self.n_stages:
            raise stage_count_error(
                f"this program is for {self.n_stages} stages but the pipeline has {n_stages}"
            )
        return self

    @cached_property
    def units(self) -> tuple[tuple[Unit, ...], ...]:
        """Per worker, what it runs as one: an action, or an :class:`Overlap` where a pair's
        forward is followed at once by its backward (a pair whose actions are not so placed is
        left as two actions here, and :func:`~fpipe.schedules.validate` rejects it)."""
        if not self.overlaps:
            return tuple(tuple(actions) for actions in self.workers)
        partner = {o.forward: o for o in self.overlaps}
        units = []
        for actions in self.workers:
            out: list[Unit] = []
            i = 0
            while i < len(actions):
                pair = partner.get(actions[i])
                if pair is not None and i + 1 < len(actions) and actions[i + 1] == pair.backward:
                    out.append(pair)
                    i += 2
                else:
                    out.append(actions[i])
                    i += 1
            units.append(tuple(out))
        return tuple(units)

    def sequential(self) -> Program:
        """The same order with no pair overlapped: each action a unit of its own, so a pair's
        forward no longer waits for its backward's input."""
        return Program(self.workers, self.n_stages, self.n_microbatches)

    def forward_only(self) -> Program:
        """The same program with every action but the forwards removed (inference)."""
        return Program(
            [[a for a in actions if a.op is Op.FORWARD] for actions in self.workers],
            self.n_stages,
            self.n_microbatches,
        )

    def __str__(self) -> str:
        return "\n".join(
            f"worker {w}: " + " ".join(str(a) for a in units)
            for w, units in enumerate(self.units)
        )

    def __repr__(self) -> str:
        return (
            f"Program(n_stages={self.n_stages}, n_microbatches={self.n_microbatches}, "
            f"workers={[[str(a) for a in units] for units in self.units]})"
        )

    @classmethod
    def parse(cls, text: str, n_stages: int | None = None,
              n_microbatches: int | None = None) -> Program:
        """Parse the output of ``str(program)``: one ``worker N: 0F0 0F1 ...`` line per worker.

        Stage and micro-batch counts default to one more than the largest index mentioned.
        """
        lines = [line for line in text.strip().splitlines() if line.strip()]
        workers: list[list[Action]] = []
        for number, line in enumerate(lines):
            head, sep, body = line.partition(":")
            if not sep or head.split() != ["worker", str(number)]:
                raise ValueError(
                    f"line {number + 1} of the program should start with 'worker {number}:', "
                    f"got {line!r}"
                )
            workers.append([_as_unit(token) for token in body.split()])
        return cls.from_actions(workers, n_stages, n_microbatches)

    @classmethod
    def from_actions(cls, workers: Sequence[Sequence[ActionLike | Overlap]],
                     n_stages: int | None = None,
                     n_microbatches: int | None = None) -> Program:
        """Build a program, inferring stage and micro-batch counts that are not given."""
        actions = [[_as_unit(a) for a in worker] for worker in workers]
        every = [a for worker in actions for unit in worker
                 for a in (unit.actions if isinstance(unit, Overlap) else (unit,))]
        if n_stages is None:
            n_stages = 1 + max((a.stage for a in every), default=0)
        if n_microbatches is None:
            n_microbatches = 1 + max((a.microbatch for a in every), default=0)
        return cls(actions, n_stages, n_microbatches)


def _as_overlap(item: object) -> Overlap:
    if isinstance(item, Overlap):
        return item
    if isinstance(item, str):
        return Overlap.parse(item)
    raise TypeError(f"overlaps holds Overlap values or strings such as '(0F1;1B0)OVERLAP_F_B', "
                    f"got {type(item).__name__}")


def program_of(schedule: object, n_stages: int) -> Program:
    """The program of ``schedule`` for ``n_stages`` stages.

    A schedule is anything with a ``program(n_stages) -> Program`` method (the shipped
    constructors' values, a ``Program`` itself), or a plain function ``n_stages -> Program``.
    """
    if hasattr(schedule, "program"):
        make, name = schedule.program, "schedule.program"
    elif callable(schedule):
        make, name = schedule, getattr(schedule, "__name__", "schedule")
    else:
        raise TypeError(f"schedule must be a schedule value such as gpipe(chunks=8), a Program, "
                        f"or a function n_stages -> Program, got {type(schedule).__name__}")
    program = make(n_stages)
    if hasattr(program, "program") and not isinstance(program, Program):
        raise TypeError(f"schedule={name} is a schedule's constructor, not a schedule: call it, "
                        f"e.g. schedule={name}(chunks=8) (calling it with the stage count "
                        f"gave {program!r})")
    if not isinstance(program, Program):
        raise TypeError(f"{name}({n_stages}) must return a Program for {n_stages} stages, "
                        f"got {program!r}")
    if program.n_stages != n_stages:
        raise stage_count_error(f"{name}({n_stages}) must return a Program for {n_stages} "
                                f"stages, got one for {program.n_stages}: {program!r}")
    return program


def placement_of(schedule: object, n_stages: int) -> tuple[int | None, ...]:
    """The worker of each stage in ``schedule``'s program for ``n_stages`` stages, whatever
    the schedule's form (see :func:`program_of` and :attr:`Program.placement`)."""
    return program_of(schedule, n_stages).placement


def stage_count_error(explanation: str) -> ValueError:
    """A :class:`~fpipe.schedules.validate.StageCountError` (imported here on demand: the
    validator imports this module)."""
    from fpipe.schedules.validate import StageCountError

    return StageCountError(explanation)


def stage_count(n_stages: object) -> int:
    """``n_stages`` if it is a positive integer, else a StageCountError saying so."""
    try:
        return positive_int("n_stages", n_stages)
    except ValueError as error:
        raise stage_count_error(str(error)) from None


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int of at least 1 (a bool is not), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
