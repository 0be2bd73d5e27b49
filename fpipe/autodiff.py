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
    """Runs one stage, ``fn(params, x) -> y``, on flat leaves.

    A stateful stage is ``fn(params, state, x) -> (y, new_state)``: its state (buffers such as
    running statistics) is an input and an output, never differentiated. ``loss_fn`` is given
    for the last stage of a training program: its forward then returns the micro-batch's loss,
    scaled by the micro-batch's share of the mini-batch, so that the sum over micro-batches is
    the mean over the whole batch.
    """

    def __init__(self, fn: Callable, param_spec: optree.PyTreeSpec, grad_input: bool,
                 loss_fn: Callable | None = None, stateful: bool = False) -> None:
        self.fn = fn
        self.param_spec = param_spec
        self.grad_input = grad_input
        self.loss_fn = loss_fn
        self.stateful = stateful

    def forward(self, params: list, x: Value, state: Any = None, target: Any = None,
                weight: float = 1.0) -> tuple[Value | torch.Tensor, Any]:
        """The output (or the scaled loss) and the new state, with no graph kept: for inference
        and for forwards that will be recomputed."""
        with torch.no_grad():
            y, new_state = self._apply(optree.tree_unflatten(self.param_spec, params), state,
                                       x.tree(), target, weight)
        return (y if self.loss_fn is not None else flatten(y)), new_state

    def forward_vjp(self, params: list, x: Value, state: Any = None, target: Any = None,
                    weight: float = 1.0) -> tuple[Value | torch.Tensor, Any, Callable]:
        """The output (or scaled loss), the new state, and the function mapping the output's
        cotangent to ``(param_grads, input_grads)``, both lists of leaves."""
        index = x.grad_index if self.grad_input else ()
        leaves = x.leaves
        side: list = []  # what leaves the transform beside the differentiated outputs

        def flat(param_leaves: list, grad_leaves: list):
            full = list(leaves)
            for i, leaf in zip(index, grad_leaves):
                full[i] = leaf
            y, new_state = self._apply(optree.tree_unflatten(self.param_spec, param_leaves),
                                       state, optree.tree_unflatten(x.spec, full), target,
                                       weight)
            state_leaves, state_spec = optree.tree_flatten(new_state)
            # Tensors that carry no gradient leave the transform as aux, which unwraps them.
            state_kept = [i for i, leaf in enumerate(state_leaves)
                          if isinstance(leaf, torch.Tensor)]
            if self.loss_fn is not None:
                out, kept, grads = None, [], [y]
            else:
                out = flatten(y)
                grads = [out.leaves[i] for i in out.grad_index]
                if not grads:
                    raise TypeError("the stage returned no floating-point tensor, so no "
                                    "gradient can flow back through it")
                kept = [i for i, leaf in enumerate(out.leaves)
                        if isinstance(leaf, torch.Tensor) and i not in out.grad_index]
            side.extend((out, kept, state_leaves, state_spec, state_kept))
            return grads, ([out.leaves[i] for i in kept] + [state_leaves[i] for i in state_kept])

        primals, vjp_fn, aux = vjp(flat, params, [leaves[i] for i in index], has_aux=True)
        out, kept, state_leaves, state_spec, state_kept = side
        for i, leaf in zip(kept, aux[:len(kept)]):
            out.leaves[i] = leaf
        for i, leaf in zip(state_kept, aux[len(kept):]):
            state_leaves[i] = leaf
        new_state = optree.tree_unflatten(state_spec, state_leaves)
        if out is None:
            return primals[0], new_state, vjp_fn
        for i, leaf in zip(out.grad_index, primals):
            out.leaves[i] = leaf
        return out, new_state, vjp_fn

    def _apply(self, params: Any, state: Any, x: Any, target: Any,
               weight: float) -> tuple[Any, Any]:
        if self.stateful:
            result = self.fn(params, state, x)
            if not isinstance(result, tuple) or len(result) != 2:
                raise TypeError(f"a stateful stage must return (y, new_state), got "
                                f"{type(result).__name__}")
            y, new_state = result
        else:
            y, new_state = self.fn(params, x), None
        if self.loss_fn is not None:
            y = self._loss(y, target, weight)
        return y, new_state

    def _loss(self, y: Any, target: Any, weight: float) -> torch.Tensor:
        loss = self.loss_fn(y, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return a scalar (0-dim) tensor, got {shape}")
        if not differentiable(loss):
            raise TypeError(f"loss_fn must return a floating-point tensor, got {loss.dtype}")
        return loss * weight
