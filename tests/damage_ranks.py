"""What each spawned rank runs in tests/test_saving_distributed.py's damaged-checkpoint test:
two ranks save one stage each, then (after the parent damages rank 1's tensor) load."""

from __future__ import annotations

import os

import torch

from fpipe import saving


def _names(rank: int) -> dict:
    return {rank: {"w": f"layer{rank}.w"}}


def save_two(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    params = {rank: {"w": torch.randn(64, 64, generator=g, dtype=torch.float64)}}
    saving.save(os.environ["FPIPE_SAVING_DIR"], params, names=_names(rank))
    return {}


def load_two(rank: int, world: int) -> dict:
    params = {rank: {"w": torch.zeros(64, 64, dtype=torch.float64)}}
    try:
        saving.load(os.environ["FPIPE_SAVING_DIR"], params, names=_names(rank))
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        error = (type(exc).__name__, str(exc))
    return {"error": error, "untouched": bool((params[rank]["w"] == 0).all())}
