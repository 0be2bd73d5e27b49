"""Saving and loading a pipeline's parameters, state and optimiser, by name, one file per
stage. (The module is ``saving``, not ``checkpoint``: in ``fpipe.GPipe(checkpoint=...)``, as in
torchgpipe, a checkpoint is a recomputation.)

A checkpoint is a directory: ``stage-{i}`` holds stage ``i``'s parameters and state tensors,
``optimizer-{i}`` the optimiser's tensors for them, and ``index.json`` which names each stage
holds, the optimiser's hyper-parameters and its non-tensor state. Tensors are keyed by name,
not by stage, so a checkpoint written by one cut of a model loads into another: a different
balance, or the plain model (``model.load_state_dict(load(directory))``). A leaf's name is its
path in its stage's pytree joined by dots; for stages from ``from_sequential`` that is the
module's own name (``"3.weight"``). Files are safetensors where that package is installed
(no pickle, safe to load from others), ``torch.save`` otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optree
import torch

__all__ = ["save", "load", "load_optimizer", "names"]

_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}


def _has_safetensors() -> bool:
    # An optional dependency (the [hf] extra), imported only when a file is written or read.
    return importlib.util.find_spec("safetensors") is not None


def names(tree: Any) -> list[str]:
    """The name of each leaf of one stage's pytree, in leaf order."""
    paths, _, _ = optree.tree_flatten_with_path(tree)
    return [".".join(str(key) for key in path) for path in paths]


def _named(trees: Sequence[Any], what: str) -> list[dict[str, torch.Tensor]]:
    """Per stage, name -> leaf; a name in two stages is an error (it could not be told apart)."""
    seen: dict[str, int] = {}
    result = []
    for s, tree in enumerate(trees):
        named = dict(zip(names(tree), optree.tree_leaves(tree)))
        for name in named:
            if name in seen:
                raise ValueError(f"{what}[{seen[name]}] and {what}[{s}] both hold {name!r}: a "
                                 f"checkpoint keys tensors by name, so names must be unique "
                                 f"across stages (from_sequential's are)")
            seen[name] = s
        result.append(named)
    return result


def _write(tensors: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    if fmt == "safetensors":
        importlib.import_module("safetensors.torch").save_file(tensors, str(path))
    else:
        torch.save(tensors, path)


def _read(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        if not _has_safetensors():
            raise ImportError(f"{path} is a safetensors file: pip install safetensors")
        return importlib.import_module("safetensors.torch").load_file(str(path))
    return torch.load(path, weights_only=True)


def save(directory: str | os.PathLike, params: Sequence[Any], state: Sequence[Any] | None = None,
         *, optimizer: torch.optim.Optimizer | None = None, format: str | None = None) -> None:
    """Write ``params`` (one pytree per stage), ``state`` and ``optimizer`` to ``directory``.

    ``optimizer`` must have been built on the leaves of ``params`` (any order, any groups).
    ``format`` is ``"safetensors"`` or ``"torch"``; by default safetensors when installed.
    """
    fmt = format or ("safetensors" if _has_safetensors() else "torch")
    if fmt not in _SUFFIX:
        raise ValueError(f"format must be 'safetensors' or 'torch', got {fmt!r}")
    if fmt == "safetensors" and not _has_safetensors():
        raise ImportError("format='safetensors' needs the safetensors package")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    named_params = _named(params, "params")
    named_state = _named(state, "state") if state is not None else [{} for _ in params]
    index: dict[str, Any] = {"format": fmt, "stages": []}
    for s, (p, b) in enumerate(zip(named_params, named_state)):
        clash = set(p) & set(b)
        if clash:
            raise ValueError(f"stage {s} has {sorted(clash)} in both params and state")
        _write({**p, **b}, directory / f"stage-{s}{_SUFFIX[fmt]}", fmt)
        index["stages"].append({"params": list(p), "state": list(b)})
    if optimizer is not None:
        index["optimizer"] = _save_optimizer(directory, optimizer, named_params, fmt)
    (directory / "index.json").write_text(json.dumps(index, indent=1))


def _save_optimizer(directory: Path, optimizer: torch.optim.Optimizer,
                    named_params: list[dict[str, torch.Tensor]], fmt: str) -> dict:
    where = {id(leaf): (s, name) for s, named in enumerate(named_params)
             for name, leaf in named.items()}
    saved = optimizer.state_dict()
    order = [p for group in optimizer.param_groups for p in group["params"]]
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in named_params]
    other: dict[str, dict[str, Any]] = {}
    for i, values in saved["state"].items():
        if id(order[i]) not in where:
            raise ValueError("the optimizer holds a tensor that is not a leaf of params")
        s, name = where[id(order[i])]
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[s][f"{name}/{key}"] = value
            else:
                other.setdefault(name, {})[key] = value
    for s, stage_tensors in enumerate(tensors):
        _write(stage_tensors, directory / f"optimizer-{s}{_SUFFIX[fmt]}", fmt)
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [where[id(p)][1] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"groups": groups, "other": other}


def _index(directory: Path) -> dict:
    return json.loads((directory / "index.json").read_text())


def load(directory: str | os.PathLike, like: Sequence[Any] | None = None) -> Any:
    """What :func:`save` wrote. Without ``like``: one flat dict, name -> tensor (on the CPU),
    of every stage's parameters and state, as ``nn.Module.load_state_dict`` takes. With
    ``like`` (one pytree per stage, e.g. another balance's ``params`` or ``state``): pytrees
    shaped like it, each leaf the tensor of the same name, on the device of ``like``'s leaf."""
    directory = Path(directory)
    index = _index(directory)
    suffix = _SUFFIX[index["format"]]
    flat: dict[str, torch.Tensor] = {}
    for s in range(len(index["stages"])):
        flat.update(_read(directory / f"stage-{s}{suffix}", index["format"]))
    if like is None:
        return flat
    result = []
    for s, named in enumerate(_named(like, "like")):
        missing = sorted(set(named) - set(flat))
        if missing:
            raise KeyError(f"like[{s}] has {missing}, which the checkpoint does not hold")
        for name, leaf in named.items():
            if flat[name].shape != leaf.shape:
                raise ValueError(f"{name!r} is {tuple(flat[name].shape)} in the checkpoint but "
                                 f"{tuple(leaf.shape)} in like[{s}]")
        leaves = [flat[name].to(leaf.device, leaf.dtype) for name, leaf in named.items()]
        result.append(optree.tree_unflatten(optree.tree_structure(like[s]), leaves))
    return result


def load_optimizer(directory: str | os.PathLike, optimizer: torch.optim.Optimizer,
                   params: Sequence[Any]) -> None:
    """Restore ``optimizer``, built on the leaves of ``params`` (any cut of the model, with its
    parameter groups in the saved order), from a checkpoint :func:`save` wrote with one."""
    directory = Path(directory)
    index = _index(directory)
    if "optimizer" not in index:
        raise KeyError(f"the checkpoint in {directory} has no optimizer state")
    saved = index["optimizer"]
    suffix = _SUFFIX[index["format"]]
    tensors: dict[str, torch.Tensor] = {}
    for s in range(len(index["stages"])):
        tensors.update(_read(directory / f"optimizer-{s}{suffix}", index["format"]))
    name_of = {id(leaf): name for named in _named(params, "params")
               for name, leaf in named.items()}
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(saved['groups'])} parameter groups but the "
                         f"optimizer has {len(optimizer.param_groups)}")
    by_name: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        name, field = key.rsplit("/", 1)
        by_name.setdefault(name, {})[field] = t
    state: dict[int, dict[str, Any]] = {}
    groups, i = [], 0
    for g, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["groups"])):
        if sorted(name_of[id(p)] for p in group["params"]) != sorted(saved_group["params"]):
            raise ValueError(f"parameter group {g} of the optimizer holds other parameters "
                             f"than the checkpoint's")
        ids = []
        for p in group["params"]:
            name = name_of[id(p)]
            values = {**by_name.get(name, {}), **saved["other"].get(name, {})}
            if values:
                state[i] = values
            ids.append(i)
            i += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                       "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
