"""An optimiser's hyper-parameters in a DCP checkpoint, per parameter name, in either of the
layouts torch's ``get_state_dict`` writes (``fpipe.saving`` reads both, writes the flat one):

- flat (``flatten_optimizer_state_dict=True``): ``optim.param_groups.<name>.<key>``, one entry
  per parameter and hyper-parameter;
- nested (the default): ``{"param_groups": [{..., "params": [names]}]}``, which DCP stores as
  ``optim.param_groups.<i>.<key>`` per group ``i``, the list of names under
  ``optim.param_groups.<i>.params``.

The optimiser's state (``optim.state.<name>.<key>``) is keyed alike in both. A flat key never
ends in ``.params`` (the names are the keys there), so a ``param_groups.<i>.params`` entry
tells the nested layout apart even for parameters named by digits alone (``nn.ParameterList``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

_NESTED = re.compile(r"param_groups\.(\d+)\.params")


def placeholder(saved: Any) -> Any:
    """What DCP fills for one saved entry: an empty tensor of its size and dtype, or ``None``
    for an object (DCP unpickles it in its place)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(saved, TensorStorageMetadata):
        return torch.empty(saved.size, dtype=saved.properties.dtype)
    return None


def entries(held: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The checkpoint's ``param_groups`` entries, keyed below ``prefix`` (``"optim."``)."""
    return {key[len(prefix):]: saved for key, saved in held.items()
            if key.startswith(f"{prefix}param_groups.")}


def nested_groups(groups: dict[str, Any]) -> set[int]:
    """The indices of the nested layout's groups (none in a flat checkpoint)."""
    return {int(m.group(1)) for key in groups if (m := _NESTED.fullmatch(key))}


def _name(key: str) -> str:
    """The parameter name in a flat entry's key: ``param_groups.<name>.<key>``."""
    return key[len("param_groups."):].rpartition(".")[0]


def flat_names(groups: dict[str, Any]) -> set[str]:
    """The parameter names a flat checkpoint holds hyper-parameters for."""
    return {_name(key) for key in groups}


def request(groups: dict[str, Any], nested: bool, wanted: set[str]) -> dict[str, Any]:
    """What to read: every group of a nested checkpoint (a few entries, and only they say
    which names they hold), or a flat checkpoint's entries for the ``wanted`` names."""
    return {key: placeholder(saved) for key, saved in groups.items()
            if nested or _name(key) in wanted}


def by_name(values: dict[str, Any], nested: bool) -> dict[str, dict[str, Any]]:
    """The read entries as ``{name: {key: value}}``: a nested group's hyper-parameters given
    to each name its ``params`` lists."""
    per: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        head, _, field = key.rpartition(".")
        per.setdefault(head[len("param_groups."):], {})[field] = value
    if not nested:
        return per
    result: dict[str, dict[str, Any]] = {}
    for group in per.values():
        hyper = {k: v for k, v in group.items() if k != "params"}
        result.update({name: hyper for name in group["params"]})
    return result


def module_hyper(optim: dict[str, Any], nested: bool) -> dict[str, dict[str, Any]]:
    """Each parameter's hyper-parameters in an optimiser state dict read as torch's
    ``get_state_dict`` lays it out (``load_module``): flat, or nested with ``param_groups``
    a list of groups that list their names."""
    if not nested:
        return by_name({k: v for k, v in optim.items() if k.startswith("param_groups.")},
                       False)
    return {name: {k: v for k, v in group.items() if k != "params"}
            for group in optim.get("param_groups", []) for name in group["params"]}


def module_order(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The module's name of each parameter ``optimizer`` holds, in its groups' order."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [name_of.get(id(p), "") for group in optimizer.param_groups
            for p in group["params"]]


def check_groups(optimizer: torch.optim.Optimizer, order: list[str],
                 hyper: dict[str, dict[str, Any]]) -> None:
    """Refuse an optimiser group whose parameters were saved with different hyper-parameters
    (a model saved with no weight decay on its biases, loaded into one group): a torch group
    has one value of each, so one of them would be silently lost."""
    i = 0
    for g, group in enumerate(optimizer.param_groups):
        group_names = order[i:i + len(group["params"])]
        i += len(group["params"])
        for name in group_names[1:]:
            if group_names[0] not in hyper or name not in hyper:
                continue  # not saved under this name (a tie's other copy): torch's to say
            first, this = hyper[group_names[0]], hyper[name]
            for key in sorted(first.keys() | this.keys()):
                if not _same(first.get(key), this.get(key)):
                    raise ValueError(
                        f"the optimizer's parameter group {g} holds {group_names[0]!r} and "
                        f"{name!r}, saved with {key}={first.get(key)!r} and "
                        f"{this.get(key)!r}: put them in groups of their own, as when saved")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(a, b))
    return bool(a == b)
