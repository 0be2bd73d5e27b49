"""Parameter leaves that follow the tensors they were cut from: freezing and gradient hooks.

A stage cut from an ``nn.Module`` (``fpipe.stages``) holds copies of the model's parameters,
but its user keeps thinking in the model: ``model.backbone.requires_grad_(False)`` after some
steps, or ``weight.register_hook(mask)`` for pruning. Plain PyTorch honours both at the next
backward. So each step reads, for every leaf that has one, its *source* (the model's
parameter) and the leaf itself:

- a leaf is frozen when it or its source no longer requires grad (an ``nn.Parameter`` copy
  frozen with ``requires_grad_(False)`` too: see :func:`fpipe._runtime.values.frozen`);
- its gradient goes through the source's tensor hooks (``register_hook``), then the leaf's own,
  in registration order, once per step on the step's whole gradient (ties summed first), as
  autograd runs a leaf's hooks on the gradient it accumulates.

Sources are data: one list per stage, aligned with its leaves, ``None`` for a leaf without one,
read once from the stages that name them (``stage.sources()``, as ``fpipe.stages``' module
stages do); the runtime knows nothing of modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

__all__ = ["sources_of", "follow", "hooked", "hooked_by_stage"]

Sources = Sequence[Sequence[torch.Tensor | None] | None]


def sources_of(stages: Sequence[Any], params: Sequence[Any]) -> list:
    """Per stage, the tensor each of its parameter leaves was cut from (``None`` where none,
    and for a stage whose ``params`` is ``None``: not held here): a leaf of a dict of
    parameters whose stage's ``sources()`` names it."""
    found: list = []
    for stage, tree in zip(stages, params):
        named = getattr(stage, "sources", None)
        if named is None or not isinstance(tree, Mapping):
            found.append(None)
            continue
        by_name = named()
        paths, _, _ = optree.tree_flatten_with_path(tree)
        aligned = [by_name.get(path[0]) if len(path) == 1 else None for path in paths]
        found.append(aligned if any(t is not None for t in aligned) else None)
    return found


def follow(leaves: list[list], sources: Sources) -> list[list]:
    """``leaves`` (a step's, per stage) with each leaf whose source no longer requires grad
    made a frozen ``nn.Parameter`` (the runtime's mark of a leaf it does not differentiate)."""
    out = leaves
    for s, stage_sources in enumerate(sources):
        if not stage_sources:
            continue
        for i, source in enumerate(stage_sources):
            if source is None or source.requires_grad:
                continue
            leaf = leaves[s][i]
            if isinstance(leaf, torch.nn.Parameter) and not leaf.requires_grad:
                continue
            if out is leaves:
                out = [None if stage is None else list(stage) for stage in leaves]
            out[s][i] = torch.nn.Parameter(leaf.detach(), requires_grad=False)
    return out


def hooked(grads: list[list], params: list[list], sources: Sources) -> list[list]:
    """``grads`` (per stage, aligned with ``params``' leaves) through each leaf's gradient
    hooks: its source's, then its own. A hook returning ``None`` leaves the gradient as it
    is, as in PyTorch; a ``None`` gradient (frozen, unused) runs no hook."""
    out = grads
    for s, stage_grads in enumerate(grads):
        stage_sources = sources[s] if s < len(sources) else None
        for i, grad in enumerate(stage_grads):
            if grad is None:
                continue
            leaf = params[s][i]
            hooks = [*_hooks(stage_sources[i] if stage_sources else None), *_hooks(leaf)]
            if not hooks:
                continue
            for hook in hooks:
                changed = hook(grad)
                if changed is not None:
                    grad = changed
            if out is grads:
                out = [list(g) for g in grads]
            out[s][i] = grad
    return out


def hooked_by_stage(grads: Mapping[int, Any], params: Mapping[int, Any],
                    sources: Sources) -> dict[int, Any]:
    """:func:`hooked` on a rank's ``{stage: gradient pytree}`` (``fpipe.distributed``), with
    ``params`` its ``{stage: parameter pytree}`` and ``sources`` per stage of the pipeline."""
    held = sorted(grads)
    if not any(_hooks(leaf) for s in held for leaf in optree.tree_leaves(params[s])) and \
            not any(_hooks(source) for s in held for source in sources[s] or ()):
        return dict(grads)  # no hook anywhere (the common case): nothing to run
    flat = [optree.tree_flatten(grads[s], none_is_leaf=True) for s in held]
    through = hooked([leaves for leaves, _ in flat], [optree.tree_leaves(params[s]) for s in held],
                     [sources[s] for s in held])
    return {s: optree.tree_unflatten(spec, leaves)
            for s, (_, spec), leaves in zip(held, flat, through)}


def _hooks(tensor: object) -> list:
    table = getattr(tensor, "_backward_hooks", None) if isinstance(tensor, torch.Tensor) \
        else None
    return list(table.values()) if table else []
