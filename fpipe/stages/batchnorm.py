"""BatchNorm whose running statistics see the whole mini-batch, not each micro-batch.

Plain BatchNorm in a pipeline updates its running statistics once per micro-batch, from that
micro-batch alone, so a model trained with ``chunks=8`` ends with other statistics than the
same model trained on whole batches. :class:`DeferredBatchNorm` still normalises each
micro-batch by its own statistics (the forward and the gradients are those of plain BatchNorm
on the micro-batch), but only accumulates sums, and updates the running statistics once, when
the last of the mini-batch's ``chunks`` micro-batches has passed: as one whole-batch pass would.

It is an ``nn.Module`` whose accumulators are buffers, so as a pipeline stage's state it flows
through the forwards in micro-batch order, and a recompute (which sees the state its forward
saw, and whose new state is dropped) never counts a micro-batch twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeferredBatchNorm"]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Normalise per micro-batch; update running statistics once per ``chunks`` micro-batches.

    Works for inputs of BatchNorm1d, 2d and 3d (channels on dim 1). Sums are accumulated in
    the buffers' dtype.
    """

    def __init__(self, num_features: int, chunks: int = 1, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True,
                         device=device, dtype=dtype)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r} (chunks is the "
                             f"second argument, before eps, momentum and affine; torchgpipe's "
                             f"DeferredBatchNorm takes it last: pass it by keyword)")
        self.chunks = chunks
        factory = {"device": device, "dtype": dtype}
        self.register_buffer("sum", torch.zeros(num_features, **factory))
        self.register_buffer("sum_squares", torch.zeros(num_features, **factory))
        # Zero between mini-batches, so left out of state_dict: its keys are torchgpipe's.
        self.register_buffer("count", torch.zeros((), **factory), persistent=False)
        self.register_buffer("tracked", torch.zeros((), dtype=torch.long, device=device),
                             persistent=False)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input with channels on dim 1, got shape "
                             f"{tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            self.sum.add_(x.sum(dims))
            self.sum_squares.add_((x * x).sum(dims))
            self.count.add_(x.numel() // x.shape[1])
            self.tracked.add_(1)
            if int(self.tracked) >= self.chunks:
                self._commit()
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _commit(self) -> None:
        mean = self.sum / self.count
        var = (self.sum_squares / self.count - mean * mean).clamp_min(0)
        unbiased = var * (self.count / (self.count - 1).clamp_min(1))
        self.num_batches_tracked.add_(1)
        momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                    else self.momentum)
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        for buffer in (self.sum, self.sum_squares, self.count, self.tracked):
            buffer.zero_()

    @classmethod
    def convert(cls, module: nn.Module, chunks: int) -> nn.Module:
        """``module`` with every tracking BatchNorm1d/2d/3d replaced, in place, by a
        DeferredBatchNorm holding the very same parameters and buffers (running statistics and
        ``num_batches_tracked``, which ``momentum=None`` averages by): an optimiser built
        before the conversion still trains them. As torchgpipe's, the swap happens in the
        given module, and a DeferredBatchNorm of the same ``chunks`` is returned as it is."""
        if isinstance(module, cls) and module.chunks == chunks:
            return module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            module = cls._take_over(module, chunks)
        for name, child in module.named_children():
            module.add_module(name, cls.convert(child, chunks))
        return module

    @classmethod
    def _take_over(cls, old: nn.modules.batchnorm._BatchNorm, chunks: int) -> DeferredBatchNorm:
        new = cls(old.num_features, chunks, old.eps, old.momentum, old.affine,
                  device=old.running_mean.device, dtype=old.running_mean.dtype)
        for name in ("weight", "bias"):
            new.register_parameter(name, getattr(old, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            new.register_buffer(name, getattr(old, name))
        new.train(old.training)
        return new

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """:meth:`convert` under torchgpipe's name and default (``chunks=1``)."""
        return cls.convert(module, chunks)
