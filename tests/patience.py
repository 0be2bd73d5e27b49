"""How long the tests wait for the processes they start: in seconds of a fair share of the
machine, not of the wall clock.

A fixed wall-clock limit kills healthy ranks on a loaded machine (a 2-core CI box running the
whole suite beside other jobs took 3 to 4 times as long, and ranks given 60 s were killed while
still working). The tests therefore count time on a clock that runs slower when the machine is
busy: each wall-clock second counts ``1 / load``, ``load`` being the 1-minute load average per
core (at least 1), read as the wait goes on. A hang (ranks blocked on each other) loads nothing,
so it is still found after about the stated time. ``FPIPE_TEST_TIMEOUT_SCALE`` (default 1)
multiplies every limit, for machines slower than any load average shows (emulators, sanitizers).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

SCALE_ENV = "FPIPE_TEST_TIMEOUT_SCALE"
POLL_S = 0.5  # how often a wait looks at the load again


def scale() -> float:
    """The user's factor on every limit (``FPIPE_TEST_TIMEOUT_SCALE``)."""
    text = os.environ.get(SCALE_ENV, "1")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={text!r}: expected a positive number") from None
    if not value > 0:
        raise ValueError(f"{SCALE_ENV}={text!r}: expected a positive number")
    return value


def load() -> float:
    """The machine's 1-minute load average per core, at least 1 (1: not overloaded)."""
    try:
        average = os.getloadavg()[0]
    except OSError:  # not available on this platform: count wall-clock time
        return 1.0
    return max(1.0, average / (os.cpu_count() or 1))


def limit(seconds: float) -> float:
    """A wall-clock limit for a wait that cannot be watched (a store's or a subprocess's
    timeout given to another library): ``seconds`` scaled by the factor and today's load."""
    return seconds * scale() * load()


@dataclass
class Patience:
    """A budget of ``seconds`` (times :func:`scale`) on the load-scaled clock."""

    seconds: float

    def __post_init__(self) -> None:
        self.budget = self.seconds * scale()
        self.used = 0.0
        self.last = time.monotonic()

    def spent(self) -> bool:
        now = time.monotonic()
        self.used += (now - self.last) / load()
        self.last = now
        return self.used >= self.budget


def join(processes, seconds: float) -> None:
    """Wait until every process (``multiprocessing`` ones) has exited or the patience of
    ``seconds`` is spent; the caller kills what is left."""
    patience = Patience(seconds)
    while not patience.spent():
        alive = [p.sentinel for p in processes if p.is_alive()]
        if not alive:
            return
        wait(alive, timeout=POLL_S)


def run(args, seconds: float, **options) -> subprocess.CompletedProcess:
    """``subprocess.run(args, timeout=..., **options)`` with the timeout on the load-scaled
    clock: ``subprocess.TimeoutExpired`` once the patience of ``seconds`` is spent
    (``capture_output`` and ``check`` as ``subprocess.run`` takes them)."""
    check = options.pop("check", False)
    if options.pop("capture_output", False):
        options.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    patience = Patience(seconds)
    with subprocess.Popen(args, **options) as proc:
        out = err = None
        while True:
            try:
                out, err = proc.communicate(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if patience.spent():
                    proc.kill()
                    proc.communicate()
                    raise subprocess.TimeoutExpired(args, seconds) from None
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
