"""What every face does alike around a step: its options checked, and a non-finite loss
refused. ``fpipe.pipeline`` and ``fpipe.distributed.pipeline`` both call these, so the two
cannot drift."""

from __future__ import annotations

import torch

from fpipe.errors import NonFiniteLossError

__all__ = ["check_options", "nonfinite_error"]

NONFINITE = ("raise", "ignore")


def check_options(nonfinite: str, grad_dtype: torch.dtype | None) -> None:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be 'raise' or 'ignore', got {nonfinite!r}")
    if grad_dtype is not None and not (isinstance(grad_dtype, torch.dtype)
                                       and grad_dtype.is_floating_point):
        raise TypeError(f"grad_dtype must be a floating-point torch.dtype, got {grad_dtype!r}")


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
