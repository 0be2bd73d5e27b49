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

Sources are data handed over by the face (one list per stage, aligned with its leaves, ``None``
for a leaf without one); the runtime knows nothing of modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["follow", "hooked"]

Sources = Sequence[Sequence[torch.Tensor | None] | None]


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
                out = [list(stage) for stage in leaves]
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


def _hooks(tensor: object) -> list:
    table = getattr(tensor, "_backward_hooks", None) if isinstance(tensor, torch.Tensor) \
        else None
    return list(table.values()) if table else []
