"""The errors fpipe raises, each naming what is wrong and where.

``ScheduleError`` (an invalid program) lives with the schedules, which know nothing of tensors.
"""

from __future__ import annotations


class BatchError(ValueError):
    """A batch cannot be split as asked: too few samples, or leaves disagreeing on dim 0."""


class PlacementError(ValueError):
    """Stages, parameters and devices do not fit together."""


class StageError(RuntimeError):
    """A stage raised, or returned something the pipeline cannot carry.

    ``stage``, ``microbatch`` and ``op`` ("forward", "recompute", "backward", ...) say where; the
    original exception, if any, is the ``__cause__``.
    """

    def __init__(self, message: str, stage: int, microbatch: int, op: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
        self.op = op

    def __reduce__(self):
        return type(self), (self.args[0], self.stage, self.microbatch, self.op)
