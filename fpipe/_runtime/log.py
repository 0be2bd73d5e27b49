"""What fpipe tells a user through ``logging.getLogger("fpipe")``, silent unless configured:

- INFO: a pipeline built (stages, devices, the program it runs), worker threads started and
  stopped;
- DEBUG: every step, with its duration;
- WARNING: a step that failed (before its exception reaches the caller) and a step much slower
  than the recent ones (a recompile, a straggler, a machine that got busy).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["logger", "StepTimes"]

logger = logging.getLogger("fpipe")

SLOW = 3.0  # a step this many times the median of the recent ones is reported
RECENT = 20  # how many recent steps the median is taken over (at least 5 before any report)


class StepTimes:
    """The durations of a pipeline's recent steps, and the log lines of each new one."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=RECENT)

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            logger.warning("%s failed after %.3f s: %s: %s", what,
                           time.perf_counter() - start, type(exc).__name__, exc)
            raise
        seconds = time.perf_counter() - start
        logger.debug("%s took %.3f ms", what, seconds * 1e3)
        if len(self.recent) >= 5:
            median = statistics.median(self.recent)
            if seconds > SLOW * median:
                logger.warning("%s took %.1f ms, %.1fx the median of the last %d steps "
                               "(%.1f ms)", what, seconds * 1e3, seconds / median,
                               len(self.recent), median * 1e3)
        self.recent.append(seconds)
