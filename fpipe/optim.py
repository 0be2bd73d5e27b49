"""Optimiser steps for a pipeline's gradient pytrees.

A pipeline returns gradients as pytrees shaped like its parameters, each leaf on its stage's
device. ``torch.optim`` optimisers read ``.grad`` from the parameter tensors, so
:func:`bind_grads` puts each gradient there; torch.func users who keep parameters as values
take :func:`sgd` instead. :func:`clip_grad_norm` clips by one norm over every stage's
gradients, as ``torch.nn.utils.clip_grad_norm_`` does for one model, while each stage's
gradients stay on their device: only one scalar per device moves.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["bind_grads", "sgd", "global_norm", "clip_grad_norm"]


def bind_grads(params: Any, grads: Any) -> None:
    """Set ``leaf.grad`` of every parameter leaf to its gradient, for ``torch.optim``:

        optimizer = torch.optim.AdamW(optree.tree_leaves(params))
        loss, grads = pipe.value_and_grad(x, target)
        bind_grads(params, grads); optimizer.step()
    """
    leaves, spec = optree.tree_flatten(params)
    grad_leaves = spec.flatten_up_to(grads)
    for leaf, grad in zip(leaves, grad_leaves):
        leaf.grad = grad


def sgd(params: Any, grads: Any, lr: float) -> Any:
    """``params - lr * grads``, leaf by leaf, as new tensors: the functional update."""
    with torch.no_grad():
        return optree.tree_map(lambda p, g: p - lr * g, params, grads)


def global_norm(grads: Any) -> torch.Tensor:
    """The 2-norm of all gradient leaves together, on the first leaf's device.

    Each device sums the squares of its own leaves (in at least float32); only those partial
    sums, one scalar per device, are moved and added.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for leaf in optree.tree_leaves(grads):
        by_device.setdefault(leaf.device, []).append(leaf)
    if not by_device:
        raise ValueError("no gradients to take the norm of")
    first = next(iter(by_device))
    partial = []
    for leaves in by_device.values():
        dtype = torch.promote_types(leaves[0].dtype, torch.float32)
        norms = torch._foreach_norm([leaf.to(dtype) for leaf in leaves])
        partial.append(torch.stack(norms).square().sum().to(first))
    return torch.stack(partial).sum().sqrt()


def clip_grad_norm(grads: Any, max_norm: float, eps: float = 1e-6) -> tuple[Any, torch.Tensor]:
    """``(clipped grads, norm before clipping)``: every leaf scaled by
    ``min(1, max_norm / (norm + eps))``, the rule of ``torch.nn.utils.clip_grad_norm_``, with
    one norm over every stage's gradients (:func:`global_norm`)."""
    norm = global_norm(grads)
    scale = (max_norm / (norm + eps)).clamp(max=1.0)
    scales: dict[torch.device, torch.Tensor] = {}

    def clip(grad: torch.Tensor) -> torch.Tensor:
        if grad.device not in scales:
            scales[grad.device] = scale.to(grad.device)
        return grad * scales[grad.device].to(grad.dtype)

    return optree.tree_map(clip, grads), norm
