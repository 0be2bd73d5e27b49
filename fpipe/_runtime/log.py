"""What fpipe tells a user through ``logging.getLogger("fpipe")``, silent unless configured:

- INFO: a pipeline built (stages, devices, the program it runs), worker threads started and
  stopped;
- DEBUG (or the level of the pipeline's ``step_log``): every step, with its figures
  (:class:`fpipe.timeline.StepFigures`: duration, samples and tokens per second, peak memory,
  bubble);
- WARNING: a step that failed (before its exception reaches the caller) and a step much slower
  than the recent ones (a recompile, a straggler, a machine that got busy).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fpipe._runtime.figures import Measure
from fpipe.timeline import StepLog

__all__ = ["logger", "StepTimes"]

logger = logging.getLogger("fpipe")

SLOW = 3.0  # a step this many times the median of the recent ones is reported
RECENT = 20  # how many recent steps the median is taken over (at least 5 before any report)


class StepTimes:
    """The durations of a pipeline's recent steps, the figures of the last one, and the log
    lines of each new one."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.last: Any = None  # the last step's StepFigures

    @contextmanager
    def step(self, what: str, devices: Sequence[torch.device] = (), log: Any = None,
             record: Any = None, workers: tuple[int, ...] | None = None) -> Iterator[Any]:
        """Measure one step; yields its :class:`~fpipe._runtime.figures.Measure`, whose
        ``record`` the step records its timeline into and whose counts the face sets;
        ``workers``: those whose bubble the step's figures give (``None``: all)."""
        log = StepLog() if log is None else log
        measure = Measure(what, devices, log, record, workers)
        start = time.perf_counter()
        try:
            yield measure
        except BaseException as exc:
            logger.warning("%s failed after %.3f s: %s: %s", what,
                           time.perf_counter() - start, type(exc).__name__, exc)
            raise
        seconds = time.perf_counter() - start
        self.last = measure.figures(seconds)
        logger.log(log.level, "%s", self.last)
        if len(self.recent) >= 5:
            median = statistics.median(self.recent)
            if seconds > SLOW * median:
                logger.warning("%s took %.1f ms, %.1fx the median of the last %d steps "
                               "(%.1f ms)", what, seconds * 1e3, seconds / median,
                               len(self.recent), median * 1e3)
        self.recent.append(seconds)
