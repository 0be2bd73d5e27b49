"""An optimiser in a checkpoint, by the model's names (``fpipe.saving``'s ``"optim"`` part).

Saved in torch's flattened layout (``state.<name>.<key>``, ``param_groups.<name>.<key>``), so
each value belongs to one parameter and each rank of a pipeline writes its own; read back from
either layout (the nested one through :mod:`fpipe._runtime.ranks.saved_groups`) into the
optimiser's own ``state_dict`` form, its groups as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fpipe._runtime.ranks import saved_groups

__all__ = ["OPTIM", "optimizer_names", "flat_optimizer", "state_request", "hyper_parameters",
           "optimizer_state_dict"]

#: The top-level key of the optimiser's part of a checkpoint.
OPTIM = "optim"
def optimizer_names(optimizer: torch.optim.Optimizer,
                     model: dict[str, tuple[int, torch.Tensor]]) -> list[str]:
    """The model name of each tensor the optimiser holds, in its ``state_dict``'s order."""
    name_of = {id(leaf): name for name, (_, leaf) in model.items()}
    result = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(f"the optimizer's parameter group {g} holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a leaf of params")
            result.append(name_of[id(p)])
    return result



def flat_optimizer(optimizer: torch.optim.Optimizer, order: list[str]) -> dict[str, Any]:
    """The optimiser's ``state_dict`` in torch's flattened layout, keyed by model names."""
    saved = optimizer.state_dict()
    flat: dict[str, Any] = {}
    for i, values in saved["state"].items():
        for key, value in values.items():
            if isinstance(value, Mapping):
                raise TypeError(f"the optimizer's state {key!r} of {order[i]!r} is nested; "
                                f"fpipe.saving takes optimisers with flat per-parameter state")
            flat[f"state.{order[i]}.{key}"] = value
    for group in saved["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for i in group["params"]:
            flat.update({f"param_groups.{order[i]}.{k}": v for k, v in hyper.items()})
    return flat



def state_request(order: list[str], held: dict[str, Any],
                  like: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The optimiser state the checkpoint holds for these parameters (``state.<name>.<key>``,
    alike in both layouts), as DCP fills it. ``like``: the parameter each name's state is
    for; a state tensor of a sharded parameter's shape (Adam's moments of FSDP2's
    ``DTensor``) is read as the parameter is held, into a ``DTensor`` placed as it is, so the
    optimiser's state lands sharded as its parameters are (torch's ``step`` stays plain)."""
    wanted, prefix = set(order), f"{OPTIM}.state."
    like = like or {}
    return {key[len(OPTIM) + 1:]: _as_held(saved_groups.placeholder(saved),
                                           like.get(key[len(prefix):].rpartition(".")[0]))
            for key, saved in held.items()
            if key.startswith(prefix) and key[len(prefix):].rpartition(".")[0] in wanted}


def _as_held(empty: Any, param: torch.Tensor | None) -> Any:
    """``empty`` (a placeholder), or a ``DTensor`` like ``param`` in ``empty``'s dtype where
    ``param`` is one and ``empty`` has its whole shape."""
    from torch.distributed.tensor import DTensor

    if (isinstance(param, DTensor) and isinstance(empty, torch.Tensor)
            and empty.shape == param.shape):
        return torch.empty_like(param, dtype=empty.dtype)
    return empty



def hyper_parameters(read: Any, agree: Any, optimizer: torch.optim.Optimizer,
                     order: list[str], held: dict[str, Any], ties: Any,
                     rename: Any) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Each parameter's saved hyper-parameters, from either layout (read before any tensor:
    only a nested checkpoint's groups say which names they hold), and ``order`` with each
    tied name the checkpoint lacks replaced by its tie's. Raises, before the tensors are
    read, for a name without any, and for a group of ``optimizer`` mixing values.

    ``read(entries)`` reads (collective: every rank calls it as often, in the same order);
    ``agree(check)`` runs a check whose failure every rank raises alike, so a refusal on one
    rank (the one holding a bias) never leaves the others in a read it left."""
    groups = saved_groups.entries(held, f"{OPTIM}.")
    nested = bool(saved_groups.nested_groups(groups))
    if nested:
        values = read(saved_groups.request(groups, True, set()))
        hyper = agree(lambda: saved_groups.by_name(values, True))
    known = set(hyper) if nested else saved_groups.flat_names(groups)
    order = agree(lambda: _known(_tie_sources(order, ties, rename, known), known))
    if not nested:
        values = read(saved_groups.request(groups, False, set(order)))
        hyper = agree(lambda: saved_groups.by_name(values, False))
    agree(lambda: saved_groups.check_groups(optimizer, order, hyper))
    return order, hyper


def _known(order: list[str], known: set[str]) -> list[str]:
    for name in order:
        if name not in known:
            raise KeyError(f"the checkpoint holds no optimizer state for {name!r}")
    return order


def _tie_sources(order: list[str], ties: Any, rename: Any, known: set[str]) -> list[str]:
    """``order`` with each tied name whose optimiser state the checkpoint lacks replaced by
    the name of a member of its tie that has some."""
    def model_name(stage: int, local: str) -> str | None:
        if rename is None:
            return local
        try:
            return rename[stage].get(local)
        except (KeyError, IndexError):
            return None

    source: dict[str, str] = {}
    for tie in ties:
        members = [n for n in (model_name(s, local) for s, local in tie) if n is not None]
        found = next((n for n in members if n in known), None)
        source.update({n: found for n in members if found is not None and n not in known})
    return [source.get(name, name) for name in order]



def optimizer_state_dict(optimizer: torch.optim.Optimizer, order: list[str],
                          flat: dict[str, Any],
                          hyper: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The read state (``state.<name>.<key>``) and ``hyper`` (by name) mapped back to
    ``optimizer``'s own ``state_dict`` form: its parameter groups as they are, each with its
    parameters' saved hyper-parameters (one value each: ``check_groups``)."""
    per_name: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        name, _, field = key[len("state."):].rpartition(".")
        per_name.setdefault(name, {})[field] = value
    state, groups, i = {}, [], 0
    for group in optimizer.param_groups:
        ids = list(range(i, i + len(group["params"])))
        for j in ids:
            if per_name.get(order[j]):
                # A copy each: two tied copies may read one saved state, and the optimiser
                # updates its state tensors in place.
                state[j] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in per_name[order[j]].items()}
        saved = hyper[order[ids[0]]] if ids else {}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **saved,
                       "params": ids})
        i += len(ids)
    return {"state": state, "param_groups": groups}
