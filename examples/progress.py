"""The examples' progress bar: one line, rewritten in place."""

from __future__ import annotations

import sys
import time


def show(step: int, total: int, loss: float, started: float) -> None:
    """Draw ``step`` of ``total`` with the loss and the steps per second since ``started``."""
    done = int(30 * step / total)
    rate = step / max(time.perf_counter() - started, 1e-9)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{total} "
                     f"loss {loss:.4f} ({rate:.1f} steps/s)")
    sys.stdout.flush()
