"""What each spawned rank runs in tests/test_culprit.py: a rank late for a step."""

from __future__ import annotations

import time

from distributed_ranks import data
from models import block, mlp_params, mse

import fpipe.distributed as fdist
from fpipe.schedules import one_f_one_b

#: The pipeline's timeout, and how long the late rank sleeps before its second step (far more).
TIMEOUT, LATE = 5, 12


def late(rank: int, world: int) -> dict:
    """One step on every rank; then the last rank sleeps :data:`LATE` s before its second."""
    x, target = data(4, 8, seed=60)
    pipe = fdist.pipeline([block] * world, {rank: mlp_params(world)[rank]},
                          schedule=one_f_one_b(2), loss_fn=mse, timeout=TIMEOUT)
    first, last = rank == 0, rank == world - 1
    pipe.value_and_grad(x if first else None, target if last else None)
    if last:
        time.sleep(LATE)
    started = time.monotonic()
    try:
        pipe.value_and_grad(x if first else None, target if last else None)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return {"type": type(exc).__name__, "message": str(exc),
                "rank": getattr(exc, "rank", None), "elapsed": time.monotonic() - started}
    return {"type": None}
