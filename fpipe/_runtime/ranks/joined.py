"""What a rank joins when a distributed pipeline is built, made alike on every rank: the build
agreed (one fingerprint of everything ranks must share, compared in one collective), the
driver and its process groups, the replicas' reduction, FSDP2's shards and the tie groups.
Collective: every rank of the pipeline (and of its replicas) calls :func:`join` together."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fpipe._runtime.interpreter import Interpreter
from fpipe._runtime.ranks.agreement import fingerprint
from fpipe._runtime.ranks.data_parallel import DataParallel
from fpipe._runtime.ranks.driver import RankDriver
from fpipe._runtime.ranks.fsdp import Sharded
from fpipe._runtime.ranks.results import Results
from fpipe._runtime.ranks.tie_groups import TieGroups
from fpipe.schedules.actions import Program

__all__ = ["Joined", "join"]


@dataclass(frozen=True)
class Joined:
    """A rank's share of the built pipeline; ``ties`` is the tie map checked alike on every
    rank, as ``(stage, name)`` pairs, and ``params`` the held parameters as the steps take
    them (FSDP2's ``DTensor`` shards where ``sharded``)."""

    driver: RankDriver
    data_parallel: DataParallel | None
    sharded: Sharded | None
    results: Results
    ties: tuple
    params: Mapping[int, Any]


def join(ranks: tuple[int, ...], worker: int, program: Program, interpreter: Interpreter,
         device: torch.device, timeout: float, compiled: dict, params: Mapping[int, Any],
         specs: dict, state: Mapping[int, Any] | None, data_parallel: Any, options: dict,
         mesh: Any, ties: Any) -> Joined:
    """Agree on the build, then make the driver, the replicas' reduction (checked to run this
    worker of the same program when the groups were made), FSDP2's shards and the tie groups.
    ``options``: the pipeline's options every rank must share (``grad_reduce``,
    ``bucket_mb``, ``state_reduce``, ``shard``, ``grad_dtype``, ...)."""
    replicas = None if data_parallel is None else DataParallel.ranks_of(data_parallel)
    built = fingerprint(ranks, worker, replicas, program,
                        {**options, "data parallel": replicas is not None}, params, state)
    driver = RankDriver(ranks, program, interpreter, device, timeout, compiled, replicas, built)
    reduction = None if data_parallel is None else DataParallel(
        driver.dp_group, replicas, options["grad_reduce"],
        max(1, int(options["bucket_mb"] * 2**20)), driver.wire, options["state_reduce"])
    sharded = None if options["shard"] is None else Sharded(params, mesh["dp"])
    held = params if sharded is None else sharded.params
    tie_groups = TieGroups(ties, params if sharded is None else sharded.local(),
                           program.placement, ranks, ranks[worker], device, driver.wire,
                           options["grad_dtype"], timeout, driver.faults)
    results = Results(reduction, tie_groups, driver.faults, specs, sharded)
    return Joined(driver, reduction, sharded, results,
                  tuple(tuple(tuple(member) for member in tie) for tie in tie_groups.ties), held)

