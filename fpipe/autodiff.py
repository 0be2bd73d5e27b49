"""One stage on one micro-batch: its forward, with or without a vjp, and its backward.

Parameters and values cross this module as flat lists of leaves (optree), so any pytree optree
knows works, not only the containers ``torch.func`` flattens itself. Only floating-point tensor
leaves are differentiated; integer tensors (token ids, masks) and Python values travel beside
them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.func import vjp

__all__ = ["Value", "StageCall", "flatten", "differentiable"]


def differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


@dataclass(slots=True)
class Value:
    """A pytree passed between stages, flattened once: its leaves, structure and which leaves
    carry gradients. A cotangent for it is a list aligned with ``grad_index``."""

    leaves: list
    spec: optree.PyTreeSpec
    grad_index: tuple[int, ...]

    def tree(self) -> Any:
        return optree.tree_unflatten(self.spec, self.leaves)


def flatten(tree: Any) -> Value:
    leaves, spec = optree.tree_flatten(tree)
    return Value(leaves, spec, tuple(i for i, leaf in enumerate(leaves) if differentiable(leaf)))


class StageCall:
    """Runs ``fn(params, x)`` for one stage, on flat leaves.

    ``loss_fn`` is given for the last stage of a training program: its forward then returns the
    micro-batch's loss, scaled by the micro-batch's share of the mini-batch, so that the sum over
    micro-batches is the mean over the whole batch.
    """

    def __init__(self, fn: Callable, param_spec: optree.PyTreeSpec, grad_input: bool,
                 loss_fn: Callable | None = None) -> None:
        self.fn = fn
        self.param_spec = param_spec
        self.grad_input = grad_input
        self.loss_fn = loss_fn

    def forward(self, params: list, x: Value, target: Any = None,
                weight: float = 1.0) -> Value | torch.Tensor:
        """The output (or the scaled loss), with no graph kept: for inference and for forwards
        that will be recomputed."""
        with torch.no_grad():
            y = self.fn(optree.tree_unflatten(self.param_spec, params), x.tree())
            return self._loss(y, target, weight) if self.loss_fn is not None else flatten(y)

    def forward_vjp(self, params: list, x: Value, target: Any = None,
                    weight: float = 1.0) -> tuple[Value | torch.Tensor, Callable]:
        """The output (or scaled loss) and the function mapping its cotangent to
        ``(param_grads, input_grads)``, both lists of leaves."""
        index = x.grad_index if self.grad_input else ()
        leaves = x.leaves
        structure: list = []

        def flat(param_leaves: list, grad_leaves: list):
            full = list(leaves)
            for i, leaf in zip(index, grad_leaves):
                full[i] = leaf
            y = self.fn(optree.tree_unflatten(self.param_spec, param_leaves),
                        optree.tree_unflatten(x.spec, full))
            if self.loss_fn is not None:
                return [self._loss(y, target, weight)], []
            out = flatten(y)
            structure.append(out)
            grads = [out.leaves[i] for i in out.grad_index]
            if not grads:
                raise TypeError(
                    "the stage returned no floating-point tensor, so no gradient can flow "
                    "back through it"
                )
            # Tensors that carry no gradient leave the transform as aux, which unwraps them.
            kept = [i for i, leaf in enumerate(out.leaves)
                    if isinstance(leaf, torch.Tensor) and i not in out.grad_index]
            structure.append(kept)
            return grads, [out.leaves[i] for i in kept]

        primals, vjp_fn, aux = vjp(flat, params, [leaves[i] for i in index], has_aux=True)
        if self.loss_fn is not None:
            return primals[0], vjp_fn
        out, kept = structure
        for i, leaf in zip(out.grad_index, primals):
            out.leaves[i] = leaf
        for i, leaf in zip(kept, aux):
            out.leaves[i] = leaf
        return out, vjp_fn

    def _loss(self, y: Any, target: Any, weight: float) -> torch.Tensor:
        loss = self.loss_fn(y, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return a scalar (0-dim) tensor, got {shape}")
        if not differentiable(loss):
            raise TypeError(f"loss_fn must return a floating-point tensor, got {loss.dtype}")
        return loss * weight
