"""Values crossing stage boundaries, flattened once: a pytree's leaves, its structure and which
leaves carry gradients. Parameters and values cross the runtime as flat lists of leaves
(optree), so any pytree optree knows works, not only the containers ``torch.func`` flattens
itself. Only floating-point (and complex) tensor leaves are differentiated; integer tensors
(token ids, masks) and Python values travel beside them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, methodcaller
from typing import Any

import optree
import torch

from fpipe._runtime.trees import tree_flatten
from fpipe.errors import StageError

__all__ = ["Value", "flatten", "differentiable", "frozen", "param_leaves", "placed", "tensors_only",
           "tensors_of",
           "trainable", "check_output", "describe"]


_REQUIRES_GRAD = attrgetter("requires_grad")
_REQUIRE_GRAD = methodcaller("requires_grad_")


def differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def frozen(leaf: Any) -> bool:
    """A parameter leaf fpipe does not differentiate: an ``nn.Parameter`` whose
    ``requires_grad`` is False, PyTorch's frozen parameter. Every other floating-point leaf is
    differentiated, as ``torch.func`` differentiates plain tensors whatever their flag: so
    a model's convention holds for its parameters (``from_modules`` and ``fpipe.GPipe`` pass
    them as ``nn.Parameter``s) and the functional one for plain tensors, and neither can be
    half-applied."""
    # (requires_grad first: Parameter's isinstance runs Python code, and most leaves train)
    return not getattr(leaf, "requires_grad", True) and isinstance(leaf, torch.nn.Parameter)


def param_leaves(tree: Any, training: bool = False) -> list:
    """One stage's parameter leaves as a step takes them: detached where they require grad
    (the step differentiates its own leaves), a frozen ``nn.Parameter`` as it is, so that
    :func:`trainable` still sees it. In ``training``, each detached one is made to require
    grad again, a leaf of the step's own, which :meth:`~fpipe._runtime.step.GradSums.leaves`
    takes as it is: one new tensor a parameter a step, not two (a model of 800 tensors made
    1,700 a step, each tracked by Python's garbage collector, whose full collections, over
    everything the process holds, then came every few steps)."""
    leaves = optree.tree_leaves(tree)
    try:  # (every leaf a tensor that requires grad, the usual case: one loop in C)
        if all(map(_REQUIRES_GRAD, leaves)):
            detached = map(torch.Tensor.detach, leaves)
            return list(map(_REQUIRE_GRAD, detached) if training else detached)
    except AttributeError:  # a leaf that is not a tensor
        pass
    return [(leaf.detach().requires_grad_() if training else leaf.detach())
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf
            for leaf in leaves]


def tensors_only(leaves: list) -> bool:
    """Whether every leaf is a tensor: one look per type, not per leaf (a face checks the
    hundreds of leaves of its parameters, and a stateful stage those of its state, at every
    call)."""
    return all(issubclass(kind, torch.Tensor) for kind in set(map(type, leaves)))


def tensors_of(leaves: list) -> list:
    """The tensors among ``leaves``: ``leaves`` itself where every one is (:func:`tensors_only`)."""
    return leaves if tensors_only(leaves) else \
        [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def placed(base: list, index: tuple[int, ...] | None, leaves: list) -> list:
    """``base`` with ``leaves`` put at ``index`` (a stage's trainable leaves among all its
    parameter leaves; ``None``: ``leaves`` are all of them, returned as they are)."""
    if index is None:
        return leaves
    full = list(base)
    for i, leaf in zip(index, leaves):
        full[i] = leaf
    return full


def trainable(leaves: list) -> tuple[int, ...] | None:
    """The indices of the differentiated leaves of one stage's parameters, or ``None`` when
    all of them are (the common case, which costs nothing downstream)."""
    if not any(issubclass(kind, torch.nn.Parameter) for kind in set(map(type, leaves))):
        return None  # (no leaf is a Parameter, so none is frozen: one look per type)
    index = tuple(i for i, leaf in enumerate(leaves) if not frozen(leaf))
    return None if len(index) == len(leaves) else index


@dataclass(slots=True)
class Value:
    """A pytree passed between stages, flattened once: its leaves, structure and which leaves
    carry gradients. A cotangent for it is a list aligned with ``grad_index``."""

    leaves: list
    spec: optree.PyTreeSpec
    grad_index: tuple[int, ...]

    def tree(self) -> Any:
        return optree.tree_unflatten(self.spec, self.leaves)


_TENSOR = optree.tree_structure(torch.empty(0))  # the structure of a lone tensor


def flatten(tree: Any) -> Value:
    if type(tree) is torch.Tensor:  # the common case, without a walk
        return Value([tree], _TENSOR, (0,) if differentiable(tree) else ())
    leaves, spec = tree_flatten(tree)
    return Value(leaves, spec, tuple(i for i, leaf in enumerate(leaves) if differentiable(leaf)))


def check_output(out: Value, size: int, what: str) -> None:
    """A stage's ``what`` carries a tensor, and every tensor keeps the micro-batch's ``size``
    on dim 0 (0-dim tensors excepted)."""
    seen = False
    for leaf in out.leaves:
        if isinstance(leaf, torch.Tensor):
            seen = True
            if leaf.dim() > 0 and leaf.shape[0] != size:
                raise StageError(f"the stage's {what} {describe(out.tree())} does not keep "
                                 f"the micro-batch size {size} on dim 0 of every tensor")
    if not seen:
        raise StageError(f"the stage returned no tensor in its {what} (got {out.tree()!r}); it "
                         f"must be a tensor or a pytree with tensor leaves")


def describe(tree: Any) -> str:
    """Shapes and dtypes of a pytree's tensor leaves, for error messages."""
    def one(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            return f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
        return repr(leaf)
    return str(optree.tree_map(one, tree, none_is_leaf=True))
