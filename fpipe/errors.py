"""The errors fpipe raises, each naming what is wrong and where.

``ScheduleError`` (an invalid program) lives with the schedules, which know nothing of tensors.
"""

from __future__ import annotations

from typing import NamedTuple


class BatchError(ValueError):
    """A batch cannot be split as asked: too few samples, or leaves disagreeing on dim 0."""


class NonFiniteLossError(FloatingPointError):
    """A step's loss is NaN or infinite; ``microbatches`` lists where."""

    def __init__(self, message: str, microbatches: list[int]) -> None:
        super().__init__(message)
        self.microbatches = microbatches

    def __reduce__(self):
        return type(self), (self.args[0], self.microbatches)


class OversubscriptionWarning(RuntimeWarning):
    """A pipeline runs more worker threads than the process has CPU cores: the workers then
    take turns on the cores, and every value handed from one to the next waits for a thread
    to be woken. ``fpipe.schedules.colocate`` puts several stages on one worker."""


class PlacementError(ValueError):
    """Stages, parameters and devices do not fit together."""


class Where(NamedTuple):
    """Where a step failed: the stage, the micro-batch, the op ("forward", "recompute",
    "backward", "input-gradient backward", "weight-gradient backward", or "loss": inside
    ``loss_fn``, called on the last stage's output) and, in a distributed pipeline, the
    rank."""

    stage: int | None
    microbatch: int | None
    op: str | None
    rank: int | None = None

    def __str__(self) -> str:
        on = "" if self.rank is None else f" on rank {self.rank}"
        if self.op == LOSS:
            return f"loss_fn of micro-batch {self.microbatch} (on stage {self.stage}'s " \
                   f"output{on})"
        return f"stage {self.stage}, {self.op} of micro-batch {self.microbatch}{on}"

    def failed(self) -> str:
        """What failed, where, as a message starts: "stage 2 failed in the forward of
        micro-batch 0", or "loss_fn failed on micro-batch 0 (on stage 2's output)"."""
        if self.op == LOSS:
            return f"loss_fn failed on micro-batch {self.microbatch} (on stage {self.stage}'s " \
                   f"output)"
        return f"stage {self.stage} failed in the {self.op} of micro-batch {self.microbatch}"


#: :attr:`Where.op` of a failure inside ``loss_fn``.
LOSS = "loss"


def where(error: BaseException) -> Where | None:
    """Where in a pipeline step ``error`` was raised, or ``None`` if not in a stage.

    A stage's own exception reaches the caller as itself (``except torch.OutOfMemoryError``
    still catches it), with this attached and a note saying it; fpipe's own detections are
    :class:`StageError`, whose fields say the same."""
    if isinstance(error, StageError):
        return Where(error.stage, error.microbatch, error.op, error.rank)
    return getattr(error, "fpipe_where", None)


def locate(error: BaseException, at: Where) -> BaseException:
    """Attach ``at`` to a stage's own exception (once: the first place it was seen wins), with a
    PEP 678 note for the traceback. Exceptions that take no attributes keep only the note."""
    if where(error) is not None:
        return error
    try:
        error.fpipe_where = at  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    note = f"fpipe: raised in {at}"
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: the attribute PEP 678 names, printed by 3.11+ and by pytest
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]
    return error


class StageError(RuntimeError):
    """A stage returned something the pipeline cannot carry (fpipe's own detection: a bad
    output, a loss that is not a scalar, a write into its inputs), or, on a distributed rank
    that only learnt of it, another rank's failure.

    ``stage``, ``microbatch`` and ``op`` ("forward", "recompute", "backward", ...) say where. A
    stage's own exception is not wrapped: it reaches the caller as itself, see :func:`where`.
    In a distributed pipeline ``rank`` is the rank where the stage failed.
    """

    def __init__(self, message: str, stage: int | None = None, microbatch: int | None = None,
                 op: str | None = None, rank: int | None = None) -> None:
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


class CheckpointError(RuntimeError):
    """A checkpoint could not be loaded whole (a file missing, cut short or with bytes other
    than those saved, an entry that is not data, a refusal on another rank): nothing was
    written into the caller's tensors or optimiser. The message names the file. (DCP's own
    ``CheckpointException`` derives from ``BaseException``; fpipe raises this instead, from
    it.)"""
