"""Stages compiled with ``torch.compile``: how fpipe differentiates and feeds them.

``torch.func.vjp`` does not compose with a compiled function called from eager code: dynamo
meets the functorch transform, reports "Unsupported functorch tracing attempt" (PyTorch issue
#128711) and silently runs the function uncompiled. So a stage that ``torch.compile``
returned is differentiated with ``torch.autograd`` instead, through :func:`autograd_vjp`,
which has ``torch.func.vjp``'s signature; dynamo then captures the stage and AOTAutograd
compiles its backward too. The gradients are the same; only the machinery differs.

Micro-batches of one step may differ in size (10 samples in 4 chunks: 3, 3, 2, 2), and a
compiled graph specialises on shapes, so the uneven last micro-batch would cost a recompile.
:func:`batch_dynamic` marks dim 0 of a compiled stage's inputs dynamic before each call,
so one graph serves every micro-batch size. Micro-batches of the first stage's input are
views into the batch, and dynamo also specialises a view at offset 0 (the first micro-batch)
apart from the others; such views are copied, so every call sees offset 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fpipe.stages.skip import Skippable

__all__ = ["is_compiled", "autograd_vjp", "batch_dynamic"]


def is_compiled(stage: Callable) -> bool:
    """Whether ``stage`` is what ``torch.compile`` returns (for a function or a module), or
    wraps it: a ``skippable`` declaration, or any wrapper that names what it wraps in
    ``__wrapped__`` (``functools.wraps``, :func:`fpipe.amp.autocast`)."""
    seen: set[int] = set()
    while stage is not None and id(stage) not in seen:
        if (isinstance(stage, torch._dynamo.eval_frame.OptimizedModule)
                or hasattr(stage, "_torchdynamo_orig_callable")):
            return True
        seen.add(id(stage))
        stage = stage.fn if isinstance(stage, Skippable) else getattr(stage, "__wrapped__", None)
    return False


def batch_dynamic(tree: Any) -> Any:
    """``tree`` with dim 0 of every tensor leaf marked dynamic, and leaves at a storage offset
    copied, so that any micro-batch size runs the same graph (dynamo may still specialise a
    size of 0 or 1)."""
    def one(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return leaf
        if leaf.storage_offset():
            leaf = leaf.clone()
        torch._dynamo.maybe_mark_dynamic(leaf, 0)
        return leaf
    return optree.tree_map(one, tree)


def autograd_vjp(fn: Callable, *primals: Any, has_aux: bool = False) -> tuple:
    """``torch.func.vjp(fn, *primals, has_aux=...)``, computed with ``torch.autograd``.

    The primals (pytrees of tensors) are detached leaves that require grad; the outputs and
    aux are returned detached, and ``vjp_fn(cotangents)`` returns one gradient pytree per
    primal, zeros where an input did not reach the outputs. It may be called once.
    """
    inputs = optree.tree_map(lambda t: t.detach().requires_grad_(), primals)
    with torch.enable_grad():
        result = fn(*inputs)
    out, aux = result if has_aux else (result, None)
    out_leaves, out_spec = optree.tree_flatten(out)
    in_leaves, in_spec = optree.tree_flatten(inputs)

    def vjp_fn(cotangents: Any) -> tuple:
        pairs = [(o, c) for o, c in zip(out_leaves, optree.tree_leaves(cotangents))
                 if o.requires_grad]
        if not pairs or not in_leaves:  # nothing to differentiate (a stage without parameters
            # and inputs without gradient, or outputs that depend on none of them)
            return optree.tree_unflatten(in_spec, [torch.zeros_like(t) for t in in_leaves])
        grads = torch.autograd.grad([o for o, _ in pairs], in_leaves, [c for _, c in pairs],
                                    allow_unused=True, materialize_grads=True)
        return optree.tree_unflatten(in_spec, list(grads))

    detached = optree.tree_unflatten(out_spec, [o.detach() for o in out_leaves])
    if not has_aux:
        return detached, vjp_fn
    aux = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)
    return detached, vjp_fn, aux
