"""The errors fpipe raises, each naming what is wrong and where.

``ScheduleError`` (an invalid program) lives with the schedules, which know nothing of tensors.
"""

from __future__ import annotations


class BatchError(ValueError):
    """A batch cannot be split as asked: too few samples, or leaves disagreeing on dim 0."""


class NonFiniteLossError(FloatingPointError):
    """A step's loss is NaN or infinite; ``microbatches`` lists where."""

    def __init__(self, message: str, microbatches: list[int]) -> None:
        super().__init__(message)
        self.microbatches = microbatches

    def __reduce__(self):
        return type(self), (self.args[0], self.microbatches)


class PlacementError(ValueError):
    """Stages, parameters and devices do not fit together."""


class StageError(RuntimeError):
    """A stage raised, or returned something the pipeline cannot carry.

    ``stage``, ``microbatch`` and ``op`` ("forward", "recompute", "backward", ...) say where; the
    original exception, if any, is the ``__cause__``. In a distributed pipeline ``rank`` is the
    rank where the stage failed; other ranks raise it too, with the message but not the cause.
    """

    def __init__(self, message: str, stage: int | None, microbatch: int | None, op: str | None,
                 rank: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
        self.op = op
        self.rank = rank

    def __reduce__(self):
        return type(self), (self.args[0], self.stage, self.microbatch, self.op, self.rank)


class PeerError(RuntimeError):
    """A distributed step could not go on: another rank sent nothing within the timeout, or its
    connection was lost (the process died). ``rank`` is that other rank; ``stage`` and
    ``microbatch`` say what was awaited, where known."""

    def __init__(self, message: str, rank: int | None, stage: int | None = None,
                 microbatch: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage
        self.microbatch = microbatch

    def __reduce__(self):
        return type(self), (self.args[0], self.rank, self.stage, self.microbatch)
