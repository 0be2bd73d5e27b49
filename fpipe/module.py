"""``fpipe.GPipe``: torchgpipe's ``nn.Module`` face, built on the functional core.

Code written against torchgpipe 0.0.7 runs with ``from fpipe import GPipe`` in place of
``from torchgpipe import GPipe``: wrap an ``nn.Sequential`` with ``balance``, ``devices``,
``chunks`` and ``checkpoint``, call it, and ``loss.backward()`` fills the module's ``.grad``s as
the plain module would. Underneath, the partitions become stateful stages (buffers are their
state), the checkpoint mode a remat policy of a GPipe program, and a training call one autograd
node around :meth:`fpipe.Pipeline.vjp` (see :mod:`fpipe._gpipe.run`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from operator import is_
from typing import Any

import optree
import torch
from torch import nn

from fpipe._gpipe import arguments
from fpipe._gpipe.run import Pipelines, Run, check_input, microbatches, recomputes, remat_of
from fpipe._runtime.engine import check_untransformed
from fpipe._runtime.step import Donated
from fpipe.recompute import run as one_run
from fpipe.recompute import run_serial
from fpipe.stages.batchnorm import DeferredBatchNorm
from fpipe.stages.module_skip import verify_skippables
from fpipe.stages.swap import Swap

__all__ = ["GPipe"]


class GPipe(nn.Module):
    """An ``nn.Sequential`` pipelined over ``devices`` in ``len(balance)`` partitions.

    Args:
        module: the ``nn.Sequential`` to pipeline; its layers are moved to their devices.
        balance: the number of layers of each partition (``fpipe.stages.balance_by_time`` and
            ``balance_by_size`` find one).
        devices: a device per partition (default: every CUDA device in order; on a machine
            without CUDA, the CPU for every partition).
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which micro-batches drop
            their activations in training and recompute them in the backward.
        deferred_batch_norm: replace BatchNorm layers by :class:`DeferredBatchNorm`, so their
            running statistics are updated once per mini-batch, from all of its samples.

    The input and output are a tensor or a tuple of tensors, and so is what each partition
    passes to the next. Partitions on one device share one worker thread, as in torchgpipe. In
    eval mode nothing is recomputed; under ``torch.no_grad()`` (in either mode) nothing is kept
    for a backward. The partitions stay on their devices: moving the whole module with
    ``.to(device)``, ``.cuda()`` or ``.cpu()`` is refused (a dtype alone is fine).
    """

    def __init__(self, module: nn.Sequential, balance: Iterable[int] | None = None,
                 devices: Iterable[torch.device | str | int] | None = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False) -> None:
        super().__init__()
        chunks, checkpoint = arguments.chunks_of(chunks), arguments.checkpoint_of(checkpoint)
        if balance is None:
            raise ValueError(arguments.NO_BALANCE)
        arguments.verify_module(module)
        verify_skippables(module)
        self.chunks: int = chunks
        self.checkpoint: str = checkpoint
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module, chunks)
        self.balance: list[int] = arguments.balance_of(balance, len(module))
        self.devices: list[torch.device] = arguments.devices_of(devices, len(self.balance))
        self.partitions = nn.ModuleList(arguments.split(module, self.balance, self.devices))
        self._pipelines = Pipelines()

    def forward(self, input: Any) -> Any:
        # One run from here to the return (see fpipe.recompute.run): nothing of the caller's
        # runs in between, so the partitions' structure is checked once for the whole call.
        with one_run():
            return self._forward(input)

    def _forward(self, input: Any) -> Any:
        params, buffers = self._named_tensors()
        check_untransformed("fpipe.GPipe's forward", input, params=params)
        check_input(input)
        if not self.partitions:
            return input  # an empty nn.Sequential: the identity, as in torchgpipe
        m = microbatches(input, self.chunks)
        # The step updates the normalisation layers' running statistics where they are, as a
        # plain forward does (see fpipe.stages.running); other buffers through copies.
        state = [Donated(named) for named in buffers]
        if torch.is_inference_mode_enabled() or not self._needs_grad(input, params):
            # Nothing could need a backward (no_grad, or nothing requires grad), in training
            # mode too: every micro-batch runs without a graph on every partition.
            pipe = self._pipeline(m, "never", params, state)
            y, new_state = pipe(input, params=params, state=state)
            _commit(buffers, new_state)
            return y
        # Training forwards (and eval ones under grad) as torchgpipe runs them: checkpointed
        # micro-batches drop their activations, the rest keep what a backward needs.
        remat = remat_of(self.checkpoint, self.chunks, m) if self.training else "never"
        pipe = self._pipeline(m, remat, params, state)
        if recomputes(remat, m) and any(buffers):
            # A recompute runs on the buffers its forward saw, which _commit below overwrites
            # in place (as a plain forward would): it gets copies of those it reads.
            state = [Donated(named if unread.issuperset(named) else
                             {name: b if name in unread else b.clone()
                              for name, b in named.items()})
                     for named, unread in zip(buffers, self._pipelines.unread_by_recomputes())]

        def run(input: Any) -> tuple[Any, Any]:
            y, vjp_fn, new_state = pipe.vjp(input, params=params, state=state)
            _commit(buffers, new_state)
            return y, vjp_fn

        inputs = input if isinstance(input, tuple) else (input,)
        return Run.apply(run, isinstance(input, tuple), len(inputs), *inputs,
                         *optree.tree_leaves(params))

    def __len__(self) -> int:
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    def __getitem__(self, index: int) -> nn.Module:
        return list(self)[index]

    def cuda(self, device: Any = None) -> GPipe:
        raise _moving_denied()

    def cpu(self) -> GPipe:
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        # Refused before torch parses the arguments: .to(0) on a machine without CUDA says so.
        if "device" in kwargs or "tensor" in kwargs or (
                args and isinstance(args[0], (torch.device, int, str, torch.Tensor))):
            raise _moving_denied()
        return super().to(*args, **kwargs)

    def _named_tensors(self) -> tuple[list[dict], list[dict]]:
        """Each partition's ``dict(named_parameters())`` and ``dict(named_buffers())``, as of
        now, without walking the partitions at every call where their structure is as it was
        (:meth:`fpipe.stages.swap.Swap.named`): on a model of 800 tensors the two walks cost
        more than the rest of the face's per-call work."""
        readers = self._pipelines.swaps(self.partitions) or self.__dict__.get("_readers")
        if readers is None or [r.module for r in readers] != list(self.partitions):
            readers = self.__dict__["_readers"] = [Swap(p) for p in self.partitions]
        params, buffers, serial = [], [], run_serial()
        for reader, partition in zip(readers, self.partitions):
            named = reader.named(serial)
            if named is None:
                named = dict(partition.named_parameters()), dict(partition.named_buffers())
            params.append(named[0])
            buffers.append(named[1])
        return params, buffers

    @staticmethod
    def _needs_grad(input: Any, params: list[dict[str, torch.Tensor]]) -> bool:
        """Whether autograd would record the call (an output that could need a backward)."""
        inputs = input if isinstance(input, tuple) else (input,)
        return torch.is_grad_enabled() and (
            any(t.requires_grad for t in inputs) or
            any(p.requires_grad for named in params for p in named.values()))

    def _pipeline(self, m: int, remat: str, params: list, state: list) -> Any:
        return self._pipelines.get(self.partitions, self.devices, m, remat, params, state)



def _commit(buffers: list[dict[str, torch.Tensor]],
            new_state: list[dict[str, torch.Tensor]]) -> None:
    """The stages' new buffers become the module's (``buffers``, as the call found them), in
    place, as a plain forward would leave them."""
    with torch.no_grad():
        for held, new in zip(buffers, new_state):
            if all(map(is_, map(new.__getitem__, held), held.values())):
                continue  # (every buffer updated where it is: the usual case, a loop in C)
            for name, buffer in held.items():
                if new[name] is not buffer:  # not updated where it is
                    buffer.copy_(new[name])


def _moving_denied() -> TypeError:
    return TypeError("GPipe places its partitions on their devices; moving the whole module is "
                     "refused (build it with the devices you want; a dtype alone, as in "
                     ".to(torch.float64), is fine)")
