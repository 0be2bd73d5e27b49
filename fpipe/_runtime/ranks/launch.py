"""Joining a job and finding one's place in it: :func:`fpipe.distributed.init` (the process
group ``torchrun`` describes; a pipeline refused before it, :func:`check_joined`) and
:func:`fpipe.distributed.my_stages` (the stages a rank holds, before any parameter is built).
Public through :mod:`fpipe.distributed`."""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

import torch
import torch.distributed as dist

from fpipe._runtime.ranks.data_parallel import mesh_groups
from fpipe._runtime.ranks.driver import backend_for
from fpipe.schedules.actions import program_of
from fpipe.schedules.validate import validate

__all__ = ["init", "check_joined", "my_stages", "LAUNCH_VARIABLES"]


def init(device: torch.device | str | None = None) -> torch.device:
    """Join the process group ``torchrun`` describes (its environment variables) with the
    backend that fits ``device``, and return this rank's device.

    ``device`` defaults to CUDA when there is one; ``"cuda"`` means the GPU of ``LOCAL_RANK``.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _check_launched()
        dist.init_process_group(backend_for(device))
    return device


def check_joined() -> None:
    """Refuse to build a pipeline before this process has joined a process group."""
    if not dist.is_initialized():
        raise RuntimeError("fpipe.distributed needs a process group: call "
                           "fpipe.distributed.init() (or torch.distributed.init_process_group)")


#: What torchrun sets for every rank, and ``init_process_group``'s ``env://`` reads.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_launched() -> None:
    """Started without torchrun, a script gets torch's bare "environment variable RANK
    expected"; say what is missing and the command that starts it."""
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
    if missing:
        command = shlex.join(["torchrun", "--standalone", "--nproc-per-node=2", *sys.argv])
        unset = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
        raise RuntimeError(f"fpipe.distributed.init joins the process group that torchrun "
                           f"starts, but {unset}: launch the script with torchrun, one process "
                           f"per rank, e.g.\n    {command}")


def my_stages(schedule: Any, n_stages: int, rank: int | None = None, *, group: Any = None,
              mesh: Any = None) -> tuple[int, ...]:
    """The stages that ``rank`` (a global rank; this rank by default) holds: worker ``w`` is
    the ``w``-th rank of the pipeline's process group (``group``, or ``mesh["pp"]``, as given
    to :func:`pipeline`; by default the world, where worker ``w`` is rank ``w``).

    Build or load only these stages' parameters and pass them to :func:`pipeline`.
    """
    program = validate(program_of(schedule, n_stages))
    rank = dist.get_rank() if rank is None else rank
    worker = rank
    if group is not None or mesh is not None:
        ranks = tuple(dist.get_process_group_ranks(mesh_groups(group, mesh, None)[0]))
        if rank not in ranks:
            return ()
        worker = ranks.index(rank)
    return tuple(s for s, w in enumerate(program.placement) if w == worker)
