"""What one rank of a distributed pipeline is given, checked: its stages' parameters and state
(at build time and per call), and the one device they live on. Errors name the rank and the
stages, before any message is exchanged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch

from fpipe._runtime.placement import check_params, check_state, stage_devices
from fpipe._runtime.sources import follow
from fpipe._runtime.values import param_leaves
from fpipe.errors import PlacementError
from fpipe.schedules.actions import Program

__all__ = ["Held", "held_by", "held_device", "seat", "to"]


def seat(ranks: tuple[int, ...], rank: int, program: Program,
         given: Mapping[int, Any]) -> tuple[int, tuple[int, ...]]:
    """``(worker, stages)``: where ``rank`` sits in a pipeline whose worker ``w`` runs on
    ``ranks[w]``, and the stages it holds there, which ``given`` (its parameters) must be."""
    if rank not in ranks:
        raise PlacementError(f"rank {rank} is not in the pipeline's process group "
                             f"(ranks {list(ranks)})")
    n_workers = program.n_workers
    if n_workers != len(ranks):
        raise PlacementError(f"the program has {n_workers} workers but the process group has "
                             f"{len(ranks)} ranks: run one rank per worker")
    worker = ranks.index(rank)
    stages = tuple(s for s, w in enumerate(program.placement) if w == worker)
    if set(given) != set(stages):
        raise PlacementError(f"rank {rank} holds stages {list(stages)} but got parameters for "
                             f"stages {sorted(given)}")
    return worker, stages


def held_by(ranks: tuple[int, ...], rank: int, program: Program, given: Mapping[int, Any],
            device: torch.device | str | None, n_stages: int) -> tuple[int, dict, Held]:
    """``(worker, params, held)``: where ``rank`` sits (:func:`seat`), its stages' parameters
    and what it holds (:class:`Held`: the stages, their one device and parameter
    structures), checked."""
    worker, stages = seat(ranks, rank, program, given)
    params = {s: given[s] for s in stages}
    on = held_device(params, device, rank)
    check_params(params, {s: on for s in stages})
    specs = {s: optree.tree_structure(p) for s, p in params.items()}
    return worker, params, Held(rank, stages, on, specs, n_stages)


def held_device(params: Mapping[int, Any], device: torch.device | str | None,
                rank: int) -> torch.device:
    """The one device of this rank: its parameters' and ``device``'s (the CPU if neither)."""
    found = set(stage_devices(dict(params), None)) if params else set()
    if device is not None:
        found.add(torch.device(device))
    if len(found) > 1:
        raise PlacementError(f"rank {rank} runs on one device, but its stages' parameters and "
                             f"device= name {sorted(map(str, found))}")
    return found.pop() if found else torch.device("cpu")


class Held(NamedTuple):
    """The stages a rank holds (of ``n_stages``), their device and parameter structures."""

    rank: int
    stages: tuple[int, ...]
    device: torch.device
    specs: dict
    n_stages: int

    def param_leaves(self, params: Mapping[int, Any] | None, built: Mapping[int, Any],
                     sources: list | None = None, training: bool = False) -> list:
        """Per stage of the whole pipeline, this rank's parameter leaves (``None`` for the
        others): ``params`` of a call, checked, or the ones the pipeline was ``built`` with;
        with ``sources``, those that follow a model parameter (:func:`~fpipe._runtime.sources.
        follow`) follow it; in ``training``, the step's own leaves (see
        :func:`~fpipe._runtime.values.param_leaves`)."""
        if params is None:
            params = built
        else:
            if set(params) != set(self.stages):
                raise ValueError(f"rank {self.rank} holds stages {list(self.stages)} but got "
                                 f"parameters for stages {sorted(params)}")
            for s in self.stages:
                if optree.tree_structure(params[s]) != self.specs[s]:
                    raise ValueError(f"params[{s}] has structure "
                                     f"{optree.tree_structure(params[s])}, but the pipeline was "
                                     f"built with {self.specs[s]}")
            check_params(params, {s: self.device for s in self.stages})
        leaves = [param_leaves(params[s], training) if s in params else None
                  for s in range(self.n_stages)]
        return follow(leaves, sources) if sources and any(sources) else leaves

    def states(self, state: Mapping[int, Any] | None, built: Mapping[int, Any] | None) -> list:
        """Per stage of the whole pipeline, the state this rank passes (``None`` for others):
        ``state`` of a call, checked, or the one the pipeline was ``built`` with (``None``:
        the pipeline has no state)."""
        if built is None:
            if state is not None:
                raise ValueError("this pipeline has no state: build it with state=... to pass "
                                 "state to its stages")
            return [None] * self.n_stages
        if state is None:
            state = built
        else:
            self.check_state(state)
        return [state.get(s) for s in range(self.n_stages)]

    def built_state(self, state: Mapping[int, Any] | None) -> dict | None:
        """The state of this rank's stages that the pipeline is built with, checked (``None``:
        the pipeline has no state)."""
        if state is None:
            return None
        self.check_state(state, PlacementError)
        return {s: state[s] for s in self.stages}

    def check_state(self, state: Mapping[int, Any], error: type = ValueError) -> None:
        if set(state) != set(self.stages):
            raise error(f"rank {self.rank} holds stages {list(self.stages)} but got state for "
                        f"stages {sorted(state)}")
        check_state(state, {s: self.device for s in self.stages})


def to(tree: Any, device: torch.device) -> Any:
    """``tree`` with its tensors on ``device``."""
    return optree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, tree)
