"""One step's figures, measured while it runs (:class:`fpipe.timeline.StepFigures`): what
the step needs from its face (batch size, token count, the recorder of its timeline) and what
it reads from the devices (peak memory on CUDA).

The measurement costs two clock reads and, on CUDA, a peak reset and read per device; the
bubble needs the step's timeline, recorded only when asked for (``StepLog(bubble=True)``) or
when the caller passes ``record=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fpipe.timeline import Recorder, StepFigures, StepLog, bubble

__all__ = ["Measure", "tokens_of"]


def tokens_of(x: Any, given: int | None) -> int | None:
    """The step's token count: ``given``, else the element count of an input that is one
    integer tensor (token ids) of at least 2 dimensions; ``None`` otherwise."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 0:
            raise ValueError(f"tokens= must be a count (an int >= 0), got {given!r}")
        return given
    if (isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point()
            and not x.is_complex() and x.dtype != torch.bool):
        return x.numel()
    return None


class Measure:
    """One step being measured: its face sets :attr:`samples` and :attr:`tokens` and passes
    :attr:`record` to the driver; :meth:`figures` reads the rest when the step has ended."""

    def __init__(self, what: str, devices: Sequence[torch.device], log: StepLog,
                 record: Recorder | None, workers: tuple[int, ...] | None = None) -> None:
        self.what, self.workers = what, workers  # the workers this process runs (None: all)
        self.record = Recorder() if record is None and log.bubble else record
        self.recorded = 0 if self.record is None else len(self.record.steps)
        self.cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        if self.cuda and torch.cuda.is_initialized():
            for device in self.cuda:
                torch.cuda.reset_peak_memory_stats(device)
        self.samples = 0
        self.tokens: int | None = None

    def count(self, samples: int, x: Any, tokens: int | None) -> None:
        self.samples, self.tokens = samples, tokens_of(x, tokens)

    def figures(self, seconds: float) -> StepFigures:
        peaks = {}
        if self.cuda and torch.cuda.is_initialized():
            peaks = {str(d): torch.cuda.max_memory_allocated(d) for d in self.cuda}
        timeline = None
        if self.record is not None and len(self.record.steps) > self.recorded:
            timeline = self.record.timeline  # this step's
        return StepFigures(self.what, seconds, self.samples, self.tokens, peaks,
                           None if timeline is None else bubble(timeline, self.workers))
