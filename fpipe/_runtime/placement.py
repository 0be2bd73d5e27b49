"""Where stages run: each stage's device, and parameters and state checked against it.

Shared by every face (``fpipe.pipeline``, ``fpipe.distributed``): fpipe never moves parameters or
state, so a leaf on the wrong device is an error naming the stage and the leaf.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import optree
import torch

from fpipe._runtime.values import tensors_of, tensors_only
from fpipe.errors import PlacementError

__all__ = ["device_of", "check_params", "check_state", "stage_devices"]


_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")


def _path(path: tuple) -> str:
    return "".join(f"[{key!r}]" for key in path)


def device_of(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_params(params: Mapping[int, Any],
                 devices: Mapping[int, torch.device] | Sequence[torch.device]) -> None:
    """Every leaf of ``params[s]`` is a tensor on ``devices[s]``; errors name the leaf. (Each
    tree is first checked whole, cheaply; only a tree that fails is walked again with paths,
    for the message: a face checks its parameters at every call.)"""
    for s, tree in params.items():
        leaves = optree.tree_leaves(tree)
        if tensors_only(leaves) and all(dtype.is_floating_point or dtype.is_complex
                                         for dtype in set(map(_DTYPE, leaves))):
            _check_devices(s, tree, devices[s], "params", "parameter", leaves)
            continue
        paths, leaves, _ = optree.tree_flatten_with_path(tree)
        for path, leaf in zip(paths, leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"params[{s}]{_path(path)} is a {type(leaf).__name__}, "
                                f"not a tensor: parameter leaves must be tensors")
            if not (leaf.is_floating_point() or leaf.is_complex()):
                raise TypeError(f"params[{s}]{_path(path)} is a {str(leaf.dtype)[6:]} tensor: "
                                f"parameters are differentiated, so they must be "
                                f"floating-point (pass integer tensors as state=, or close "
                                f"over them in the stage)")
        _check_devices(s, tree, devices[s], "params", "parameter")


def check_state(state: Mapping[int, Any],
                devices: Mapping[int, torch.device] | Sequence[torch.device]) -> None:
    """State leaves may be any value; the tensors of ``state[s]`` must be on ``devices[s]``."""
    for s, tree in state.items():
        _check_devices(s, tree, devices[s], "state", "state tensor")


def _check_devices(stage: int, tree: Any, device: torch.device, name: str, what: str,
                   leaves: list | None = None) -> None:
    leaves = optree.tree_leaves(tree) if leaves is None else leaves
    tensors = tensors_of(leaves)
    if all(device_of(d) == device for d in set(map(_DEVICE, tensors))):
        return
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and device_of(leaf.device) != device:
            raise PlacementError(
                f"stage {stage} runs on {device} but its {what} {name}[{stage}]{_path(path)} "
                f"is on {leaf.device}; fpipe never moves parameters or state: place them on "
                f"the stage's device first"
            )


def stage_devices(params: Mapping[int, Any],
                  devices: Sequence | None) -> tuple[torch.device, ...]:
    """The device of each stage in ``params`` (stage -> pytree), in key order: as given, or
    the one device all its parameters share."""
    if devices is not None:
        return tuple(device_of(d) for d in devices)
    found: list[torch.device | None] = []
    for s, tree in params.items():
        paths, leaves, _ = optree.tree_flatten_with_path(tree)
        seen: dict[torch.device, str] = {}
        for path, leaf in zip(paths, leaves):
            if isinstance(leaf, torch.Tensor):
                seen.setdefault(device_of(leaf.device), f"params[{s}]{_path(path)}")
        if len(seen) > 1:
            listed = ", ".join(f"{where} on {device}" for device, where in seen.items())
            raise PlacementError(f"stage {s}'s parameters are on several devices ({listed}); "
                                 f"a stage runs on one device")
        found.append(next(iter(seen), None))
    # A stage without parameters runs where its neighbour does (the previous one first).
    placed = [d for d in found if d is not None]
    fallback = placed[0] if placed else torch.device("cpu")
    result = []
    for d in found:
        fallback = d if d is not None else fallback
        result.append(fallback)
    return tuple(result)
