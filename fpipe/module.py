"""``fpipe.GPipe``: torchgpipe's ``nn.Module`` face, built on the functional core.

For code written against torchgpipe: wrap an ``nn.Sequential`` with ``balance``, ``devices``,
``chunks`` and ``checkpoint``, call it, and ``loss.backward()`` fills the module's ``.grad``s as
the plain module would. Underneath, the partitions become stateful stages (buffers are their
state), the checkpoint mode a GPipe remat policy, and the forward an autograd function around
:meth:`fpipe.Pipeline.vjp`: forwards when the module is called, recomputes and backwards when
autograd asks for the input's and parameters' gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import optree
import torch
from torch import nn

from fpipe.pipeline import Pipeline
from fpipe.schedules.colocate import colocate
from fpipe.schedules.gpipe import gpipe
from fpipe.stages.batchnorm import DeferredBatchNorm
from fpipe.stages.sequential import StatefulModuleStage, check_balance

__all__ = ["GPipe"]

CHECKPOINTS = ("always", "except_last", "never")


class GPipe(nn.Module):
    """An ``nn.Sequential`` pipelined over ``devices`` in ``len(balance)`` partitions.

    Args:
        module: the ``nn.Sequential`` to pipeline; its layers are moved to their devices.
        balance: the number of layers of each partition.
        devices: a device per partition (default: the CUDA devices in order when there are
            enough, else the CPU for every partition).
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which micro-batches drop
            their activations and recompute them in the backward (torchgpipe's modes).
        deferred_batch_norm: replace BatchNorm layers by :class:`DeferredBatchNorm`, so their
            running statistics are updated once per mini-batch, from all of its samples.

    Partitions on one device share one worker thread, as in torchgpipe. In eval mode, or under
    ``torch.no_grad()``, the forward runs without keeping anything for a backward, and without
    recomputes. The partitions stay on their devices: moving the whole
    module with ``.to(device)``, ``.cuda()`` or ``.cpu()`` is refused.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int],
                 devices: Sequence[torch.device | str | int] | None = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"GPipe takes an nn.Sequential, got {type(module).__name__}")
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINTS))}, "
                             f"got {checkpoint!r}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
        self.balance = check_balance(balance, len(module))
        self.devices = _devices(devices, len(self.balance))
        self.chunks = chunks
        self.checkpoint = checkpoint
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module, chunks)
        bounds = [0]
        for size in self.balance:
            bounds.append(bounds[-1] + size)
        self.partitions = nn.ModuleList(
            nn.Module.to(module[a:b], device)
            for a, b, device in zip(bounds, bounds[1:], self.devices))
        # One worker per device, as torchgpipe has one thread per device: partitions sharing a
        # device gain nothing from separate threads but pay for every hand-off between them.
        worker_of: dict[torch.device, int] = {}
        workers = [worker_of.setdefault(d, len(worker_of)) for d in self.devices]
        program = colocate(gpipe(chunks, remat=checkpoint).program(len(self.balance)), workers)
        self._pipe = Pipeline([StatefulModuleStage(p) for p in self.partitions], self._params(),
                              state=self._buffers_by_stage(), devices=self.devices,
                              schedule=program)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"GPipe takes a tensor input, got {type(x).__name__}")
        params, state = self._params(), self._buffers_by_stage()
        if self.training and torch.is_grad_enabled():
            leaves = optree.tree_leaves(params)
            y = _Run.apply(self._pipe, params, state, self._commit, x, *leaves)
        else:
            y, new_state = self._pipe(x, params=params, state=state)
            self._commit(new_state)
        return y

    def __len__(self) -> int:
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        return layers[index]

    def cuda(self, device: Any = None) -> GPipe:
        raise _moving_denied()

    def cpu(self) -> GPipe:
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            raise _moving_denied()
        return super().to(*args, **kwargs)

    def _params(self) -> list[dict[str, torch.Tensor]]:
        return [dict(p.named_parameters()) for p in self.partitions]

    def _buffers_by_stage(self) -> list[dict[str, torch.Tensor]]:
        return [dict(p.named_buffers()) for p in self.partitions]

    def _commit(self, new_state: list[dict[str, torch.Tensor]]) -> None:
        """The stages' new buffers become the module's, in place (as a plain forward would)."""
        with torch.no_grad():
            for partition, buffers in zip(self.partitions, new_state):
                for name, buffer in partition.named_buffers():
                    buffer.copy_(buffers[name])


class _Run(torch.autograd.Function):
    """The pipeline as one autograd node: its inputs are the batch and every parameter."""

    @staticmethod
    def forward(ctx: Any, pipe: Pipeline, params: list, state: list, commit: Any,
                x: torch.Tensor, *leaves: torch.Tensor) -> torch.Tensor:
        y, ctx.vjp_fn, new_state = pipe.vjp(x, params=params, state=state)
        commit(new_state)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        grads, x_grad = ctx.vjp_fn(grad_y)
        del ctx.vjp_fn
        return (None, None, None, None, x_grad, *optree.tree_leaves(grads))


def _devices(devices: Sequence | None, n: int) -> list[torch.device]:
    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= n:
            return [torch.device("cuda", i) for i in range(n)]
        return [torch.device("cpu")] * n
    devices = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
               for d in devices]
    if len(devices) < n:
        raise ValueError(f"{n} partitions but only {len(devices)} devices: give at least one "
                         f"device per partition")
    return devices[:n]


def _moving_denied() -> TypeError:
    return TypeError("GPipe places its partitions on their devices; moving the whole module is "
                     "refused (build it with the devices you want instead)")
