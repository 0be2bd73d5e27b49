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


def _layer(rank: int, fill: float | None = None) -> dict:
    """Rank 0's stage holds a weight, rank 1's a weight and a bias."""
    g = torch.Generator().manual_seed(rank)
    shapes = {"w": (8, 8)} if rank == 0 else {"w": (8, 8), "b": (8,)}
    return {rank: {k: torch.randn(*s, generator=g, dtype=torch.float64) if fill is None
                   else torch.full(s, fill, dtype=torch.float64) for k, s in shapes.items()}}


def _layer_names(rank: int) -> dict:
    return {rank: {k: f"layer{rank}.{k}" for k in ("w", "b")[:rank + 1]}}


def _scheduled(optimizer) -> dict:
    return {"step": 3, "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}


def save_grouped(rank: int, world: int) -> dict:
    """One AdamW step with decay on the weights and none (another lr) on the bias, three
    scheduler steps, saved: step 3, the scheduler's last_epoch 3."""
    params = _layer(rank)
    leaves = list(params[rank].values())
    optimizer = torch.optim.AdamW([{"params": leaves[:1]},
                                   {"params": leaves[1:], "lr": 0.03, "weight_decay": 0.0}],
                                  lr=0.01, weight_decay=0.1)
    for leaf in leaves:
        leaf.grad = torch.ones_like(leaf)
    optimizer.step()
    extra = _scheduled(optimizer)
    for _ in range(3):
        extra["scheduler"].step()
    saving.save(os.environ["FPIPE_SAVING_DIR"], params, optimizer=optimizer,
                names=_layer_names(rank), extra=extra)
    return {}


def load_grouped(rank: int, world: int) -> dict:
    """The checkpoint loaded with the saved groups (``FPIPE_ONE_GROUP``: one group for all)."""
    params = _layer(rank, fill=0.0)
    leaves = list(params[rank].values())
    if os.environ.get("FPIPE_ONE_GROUP"):
        optimizer = torch.optim.AdamW(leaves, lr=0.01, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW([{"params": leaves[:1]}, {"params": leaves[1:]}])
    extra = {"step": 0, "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}
    try:
        saving.load(os.environ["FPIPE_SAVING_DIR"], params, optimizer=optimizer,
                    names=_layer_names(rank), extra=extra)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        error = (type(exc).__name__, str(exc))
    return {"error": error, "untouched": all(bool((p == 0).all()) for p in leaves),
            "optimizer_state": len(optimizer.state), "step": extra["step"],
            "last_epoch": extra["scheduler"].last_epoch}


def save_misnamed(rank: int, world: int) -> dict:
    """Rank 1's names= lacks its bias (``FPIPE_SAVE_REFUSAL=names``) or its extra holds a value
    that is not data (``extra``); rank 0's call is sound. Each rank reports what it raised and
    how long it took, and whether anything was written."""
    import time

    params = _layer(rank)
    names = _layer_names(rank)
    extra: dict = {"step": 3}
    if rank == 1 and os.environ["FPIPE_SAVE_REFUSAL"] == "names":
        names = {rank: {"w": "layer1.w"}}
    if rank == 1 and os.environ["FPIPE_SAVE_REFUSAL"] == "extra":
        extra = {"step": 3, "hook": _layer}  # a function: not data
    start = time.monotonic()
    try:
        saving.save(os.environ["FPIPE_SAVING_DIR"], params, names=names, extra=extra)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        error = (type(exc).__name__, str(exc))
    return {"error": error, "seconds": time.monotonic() - start,
            "written": sorted(os.listdir(os.environ["FPIPE_SAVING_DIR"]))}
