"""Stages compiled with ``torch.compile``: how fpipe differentiates and feeds them.

``torch.func.vjp`` does not compose with a compiled function called from eager code: dynamo
meets the functorch transform, reports "Unsupported functorch tracing attempt" (PyTorch issue
#128711) and silently runs the function uncompiled. So a stage that ``torch.compile``
returned is differentiated with ``torch.autograd`` instead, through
:func:`fpipe._runtime.vjp.autograd_vjp`, which computes ``torch.func.vjp``'s result; dynamo
then captures the stage and AOTAutograd compiles its backward too. The gradients are the
same; only the machinery differs.

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

__all__ = ["is_compiled", "batch_dynamic"]


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
        stage = getattr(stage, "__wrapped__", None)
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
