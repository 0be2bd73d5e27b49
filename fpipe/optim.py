"""Optimiser steps for a pipeline's gradient pytrees.

A pipeline returns gradients as pytrees shaped like its parameters, each leaf on its stage's
device. ``torch.optim`` optimisers read ``.grad`` from the parameter tensors, so
:func:`bind_grads` puts each gradient there; torch.func users who keep parameters as values
take :func:`sgd` instead. :func:`clip_grad_norm` clips by one norm over every stage's
gradients, as ``torch.nn.utils.clip_grad_norm_`` does for one model (in place, as it does),
while each stage's gradients stay on their device: only one scalar per device moves.
(``torch.nn.utils.clip_grads_with_norm_`` clips the ``.grad`` of parameters, not gradient
tensors, so the scaling is done here.)
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fpipe._runtime.ranks.gather import collective_device
from fpipe._runtime.trees import leaf_names, stage_items

__all__ = ["bind_grads", "sgd", "global_norm", "clip_grad_norm"]


def bind_grads(params: Any, grads: Any, *, accumulate: bool = False) -> None:
    """Set ``leaf.grad`` of every parameter leaf to its gradient, for ``torch.optim``:

        optimizer = torch.optim.AdamW(optree.tree_leaves(params))
        loss, grads = pipe.value_and_grad(x, target)
        bind_grads(params, grads); optimizer.step()

    A leaf whose gradient is ``None`` (frozen, or used by no stage) gets ``.grad = None``, so
    ``torch.optim`` leaves it alone, weight decay included, as after ``loss.backward()``; a
    ``.grad`` left from an earlier step is cleared. ``.grad`` is then the pipeline's gradient
    tensor itself, not a copy.

    ``accumulate=True`` adds into ``.grad`` as ``loss.backward()`` does, for several calls
    before one optimiser step: a leaf without ``.grad`` gets a copy of its gradient (so a
    later add never writes into a tensor the pipeline returned), one with ``.grad`` has the
    gradient added in place, and a ``None`` gradient leaves ``.grad`` as it is (a leaf that
    call did not use). Clear the sums between steps with ``optimizer.zero_grad()``.
    """
    leaves, spec = optree.tree_flatten(params)
    grad_leaves = spec.flatten_up_to(grads)
    if not accumulate:
        for leaf, grad in zip(leaves, grad_leaves):
            leaf.grad = grad
        return
    with torch.no_grad():
        for leaf, grad in zip(leaves, grad_leaves):
            if grad is None:
                continue
            if leaf.grad is None:
                leaf.grad = grad.detach().clone()
            else:
                leaf.grad.add_(grad)


def sgd(params: Any, grads: Any, lr: float) -> Any:
    """``params - lr * grads``, leaf by leaf, as new tensors: the functional update. A leaf
    whose gradient is ``None`` (frozen, or unused) is kept as it is."""
    with torch.no_grad():
        return optree.tree_map(lambda p, g: p if g is None else p - lr * g, params, grads,
                               none_is_leaf=True)


def global_norm(grads: Any, *, ties: Any = (), group: Any = None) -> torch.Tensor:
    """The 2-norm of all gradient leaves together, on the first leaf's device.

    ``grads`` is a pipeline's: one pytree per stage (a list), or a rank's ``{stage: pytree}``
    (``fpipe.distributed``). ``ties``, the pipeline's ``ties=``: a tied weight's copies hold
    one gradient (the pipeline summed them), so it is counted once, as the model with one
    tensor counts it (its copy on the lowest stage). ``group``: a process group whose ranks
    hold the other stages (the pipeline's ``group=``); the squares are summed over it with one
    all-reduce of one scalar, so every rank gets the norm of the whole model.

    Each device takes the norm of its own leaves, and only those norms, one scalar per device,
    are moved: through ``torch.nn.utils.get_total_norm`` (foreach, grouped by device and
    dtype) where the installed torch has it (2.6 and later). Gradients in float16 or bfloat16
    are summed in float32 instead, which torch's function does not do (its norm would have
    the gradients' precision).

    Sharded gradients (DTensors, as a pipeline built with ``shard="fsdp"`` returns them)
    count each element once: a rank takes the norm of its own shards, whose squares are
    summed over the mesh dimensions they are sharded on (one all-reduce of one scalar per
    dimension), then added to the other leaves' (replicated ones are alike on every rank).
    """
    leaves = _counted(grads, ties)
    if not leaves and group is None:
        raise ValueError("no gradients to take the norm of")
    plain, sharded = _split(leaves)
    norm = _norm(plain) if plain or not sharded else None
    for groups, shards in sharded.items():
        square = _norm(shards).detach().to(torch.float64).square()
        for over in groups:
            square = _summed(square, over)
        found = _norm_like(square, shards[0])
        norm = found if norm is None else _norm_like(
            norm.to(torch.float64).square() + square.to(norm.device), norm)
    if group is None:
        return norm
    return _group_norm(norm, group)


def _norm(leaves: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of plain tensors on this rank (zero if none)."""
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    if _TORCH_TOTAL_NORM and all(leaf.dtype.itemsize >= 4 for leaf in leaves):
        return torch.nn.utils.get_total_norm(leaves, 2.0)
    return _total_norm(leaves)


def _norm_like(square: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``sqrt(square)`` on ``like``'s device, in the dtype its norm would have."""
    dtype = like.dtype if like.dtype.itemsize >= 4 else torch.float32
    return square.sqrt().to(like.device, dtype)


def _split(leaves: list) -> tuple[list[torch.Tensor], dict[tuple, list[torch.Tensor]]]:
    """``(plain leaves, {process groups of the sharded mesh dimensions: local shards})``:
    a DTensor's local shard, by the groups its squares are summed over (none: replicated)."""
    plain: list[torch.Tensor] = []
    sharded: dict[tuple, list[torch.Tensor]] = {}
    for leaf in leaves:
        if not isinstance(leaf, DTensor):
            plain.append(leaf)
            continue
        if any(p.is_partial() for p in leaf.placements):
            raise ValueError(f"a gradient is a DTensor with a pending reduction "
                             f"({leaf.placements}): reduce it before taking its norm")
        groups = tuple(leaf.device_mesh.get_group(dim)
                       for dim, p in enumerate(leaf.placements) if p.is_shard())
        if groups:
            sharded.setdefault(groups, []).append(leaf.to_local())
        else:
            plain.append(leaf.to_local())
    return plain, sharded


def _summed(square: torch.Tensor, group: Any) -> torch.Tensor:
    """``square`` summed over ``group``'s ranks (one all-reduce of one scalar)."""
    square = square.to(collective_device(group))
    dist.all_reduce(square, group=group)
    return square


def _counted(grads: Any, ties: Any) -> list[torch.Tensor]:
    """The gradient leaves a norm counts: every one but the copies of a tie after its first
    (lowest stage) member."""
    # Members as tuples: a tie map written with lists ([[0, "w"], [1, "h"]]) says the same.
    copies = {tuple(member) for tie in ties for member in sorted(map(tuple, tie))[1:]}
    stages = stage_items(grads)
    if not copies:  # (optree skips None, a frozen or unused leaf's gradient)
        return [leaf for _, tree in stages for leaf in optree.tree_leaves(tree)]
    return [leaf for stage, tree in stages
            for name, leaf in zip(leaf_names(tree, none_is_leaf=True),
                                  optree.tree_leaves(tree, none_is_leaf=True))
            if leaf is not None and (stage, name) not in copies]


def _group_norm(norm: torch.Tensor, group: Any) -> torch.Tensor:
    """``norm`` of this rank's leaves -> the norm over every rank of ``group``."""
    square = norm.detach().to(collective_device(group), torch.float64).square()
    dist.all_reduce(square, group=group)
    return square.sqrt().to(norm.device, norm.dtype)


def clip_grad_norm(grads: Any, max_norm: float, eps: float = 1e-6, *, ties: Any = (),
                   group: Any = None) -> tuple[Any, torch.Tensor]:
    """``(grads, norm before clipping)``, every leaf scaled **in place** by
    ``min(1, max_norm / (norm + eps))``, the rule of ``torch.nn.utils.clip_grad_norm_``, with
    one norm over every stage's gradients (:func:`global_norm`, whose ``ties`` and ``group``
    these are: pass the pipeline's, and the norm and the clipping are the whole model's).
    Each device scales its own leaves (one foreach multiply per device and dtype) by the one
    factor, moved once."""
    norm = global_norm(grads, ties=ties, group=group)
    scale = (max_norm / (norm + eps)).clamp(max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for leaf in optree.tree_leaves(grads):
        if isinstance(leaf, DTensor):  # its shard here, scaled where it lies
            leaf = leaf.to_local()
        groups.setdefault((leaf.device, leaf.dtype), []).append(leaf)
    with torch.no_grad():
        for (device, dtype), leaves in groups.items():
            torch._foreach_mul_(leaves, scale.to(device, dtype))
    return grads, norm


# torch.nn.utils' grouped, foreach norm (torch >= 2.6); the code below for older ones.
_TORCH_TOTAL_NORM = hasattr(torch.nn.utils, "get_total_norm")


def _total_norm(leaves: list) -> torch.Tensor:
    """:func:`global_norm` in at least float32: squares summed per device, then added."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for leaf in leaves:
        by_device.setdefault(leaf.device, []).append(leaf)
    first = next(iter(by_device))
    partial = []
    for group in by_device.values():
        dtype = torch.promote_types(group[0].dtype, torch.float32)
        norms = torch._foreach_norm([leaf.to(dtype) for leaf in group])
        partial.append(torch.stack(norms).square().sum().to(first))
    return torch.stack(partial).sum().sqrt()
