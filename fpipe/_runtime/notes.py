"""What an error's notes say about a step's values: the shapes, dtypes and devices of the
tensors a stage (or ``loss_fn``) was given, and, for the mistakes these explain, what to do. A
stage's own exception reaches the caller as itself; these notes say why it may have failed."""

from __future__ import annotations

from typing import Any

import optree
import torch

from fpipe._runtime.values import Value

__all__ = ["summary", "dtype_hint", "device_hint"]


def summary(tree: Any) -> str:
    """Shapes, dtypes and devices of a pytree's tensor leaves, for error messages: a device
    mismatch names the devices involved."""
    def one(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            return f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')} on " \
                   f"{leaf.device}"
        return repr(leaf)
    return str(optree.tree_map(one, tree, none_is_leaf=True))


def dtype_hint(stage: int, x: Value | None, params: list | None) -> str | None:
    """Why a stage whose input and parameters differ in floating dtype may have failed, and
    the remedies: fpipe hands values between stages as they are and casts nothing."""
    def floating(leaves: list | None) -> set:
        return {str(t.dtype).removeprefix("torch.") for t in leaves or ()
                if isinstance(t, torch.Tensor) and t.is_floating_point()}

    given, held = floating(None if x is None else x.leaves), floating(params)
    if not given or not held or given & held:
        return None
    return (f"stage {stage}'s input is {'/'.join(sorted(given))} but its parameters are "
            f"{'/'.join(sorted(held))}; fpipe hands tensors between stages as they are: cast "
            f"the parameters alike (fpipe.amp.cast(params, dtype)), cast the input in the stage, "
            f"or run the step under torch.autocast")


def device_hint(stage: int, exc: BaseException, params: list | None) -> str | None:
    """For an error about devices: where the stage's parameters are (its input is moved there
    before it runs; tensors the stage makes itself are not)."""
    held = sorted({str(t.device) for t in params or () if isinstance(t, torch.Tensor)})
    if "device" not in str(exc) or not held:
        return None
    return (f"stage {stage}'s parameters are on {'/'.join(held)}, where fpipe moves its input; "
            f"a tensor the stage makes itself must be made there too (e.g. device=x.device)")
