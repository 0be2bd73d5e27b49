"""What every face does alike around a step: its options checked, and a non-finite loss
refused. ``fpipe.pipeline`` and ``fpipe.distributed.pipeline`` both call these, so the two
cannot drift."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from fpipe.errors import NonFiniteLossError

__all__ = ["check_options", "check_stages", "nonfinite_error", "returned_loss"]

NONFINITE = ("raise", "ignore")


def check_options(nonfinite: str, grad_dtype: torch.dtype | None) -> None:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be 'raise' or 'ignore', got {nonfinite!r}")
    if grad_dtype is not None and not (isinstance(grad_dtype, torch.dtype)
                                       and grad_dtype.is_floating_point):
        raise TypeError(f"grad_dtype must be a floating-point torch.dtype, got {grad_dtype!r}")


def check_stages(stages: Sequence[Any]) -> None:
    """Every stage is a function ``stage(params, x)``; an ``nn.Module`` (whose parameters would
    be neither trained nor returned) is refused, pointing to the adapter that makes stages of
    modules."""
    for s, stage in enumerate(stages):
        module = getattr(stage, "_orig_mod", stage)  # what torch.compile(module) wraps
        if isinstance(module, torch.nn.Module) and not _takes_params(module):
            raise TypeError(
                f"stage {s} is an nn.Module ({type(module).__name__}); fpipe stages are "
                f"functions stage(params, x) -> y of explicit parameters, which fpipe "
                f"differentiates and returns gradients for. Make stages of modules with "
                f"fpipe.stages.from_modules([...]) (or from_sequential for an nn.Sequential) "
                f"and pass its .stages and .params; or use fpipe.GPipe, the nn.Module face")
        if not callable(stage):
            raise TypeError(f"stage {s} is a {type(stage).__name__}, not a callable "
                            f"stage(params, x) -> y")


def _takes_params(module: torch.nn.Module) -> bool:
    """A module without parameters or buffers whose forward takes ``(params, x)``: a pure
    stage written as a module."""
    if next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
        return False
    try:
        inspect.signature(module.forward).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


def nonfinite_error(losses: torch.Tensor) -> NonFiniteLossError | None:
    """The error for a step whose micro-batch losses (a 1-d tensor) are not all finite; one
    host synchronisation on CUDA."""
    bad = (~torch.isfinite(losses)).nonzero().flatten().tolist()
    if not bad:
        return None
    return NonFiniteLossError(
        f"the loss is not finite on micro-batch(es) {bad} (values "
        f"{[losses[m].item() for m in bad]}); no gradient was returned. Build the pipeline with "
        f"nonfinite='ignore' to handle this yourself", bad)


class _GradientsAreReturned(torch.autograd.Function):
    """The identity, whose backward explains that there is nothing to differentiate here."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise RuntimeError(
            "loss.backward() on a loss fpipe returned: the pipeline has already computed the "
            "gradients and returned them (loss, grads = pipe.value_and_grad(x, target)); "
            "nothing is stored in .grad. Bind them to your tensors for a torch.optim "
            "optimiser with fpipe.optim.bind_grads(params, grads)")


def returned_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss a step returns: its value, and a ``backward()`` that says the gradients were
    returned rather than raising torch's "does not require grad" (outside ``no_grad``)."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return loss
    # The anchor, a leaf that requires grad, gives the result a grad_fn; it is never written.
    return _GradientsAreReturned.apply(loss, _ANCHOR)


_ANCHOR = torch.empty(0, requires_grad=True)
