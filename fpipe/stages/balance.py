"""Balance: how many layers of an ``nn.Sequential`` each stage should hold.

A pipeline runs at the pace of its slowest stage, so the best contiguous cut is the one whose
most expensive part is cheapest. :func:`partition` finds it exactly for given per-layer costs;
:func:`balance_by_time` and :func:`balance_by_size` measure those costs on a sample batch.
"""

from __future__ import annotations

import bisect
import copy
import math
import numbers
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import optree
import torch
from torch import nn

from fpipe.stages.module_skip import tracking

__all__ = ["partition", "balance_by_time", "balance_by_size"]


def partition(costs: Sequence[float], parts: int) -> list[int]:
    """Split ``costs`` into ``parts`` contiguous non-empty runs so that the largest run's sum is
    as small as possible; return the runs' lengths (a ``balance``).

    Exact, by dynamic programming over prefix sums: ``best[k][i]``, the least largest part of
    ``costs[:i]`` in ``k`` parts, is ``min over j of max(best[k-1][j], sum(costs[j:i]))``. The
    first term grows with ``j`` and the second shrinks, so the minimum sits where they cross,
    found by bisection: O(parts * n log n).
    """
    n = len(costs)
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts!r} non-empty parts: give between "
                         f"1 and {n} partitions")
    for i, c in enumerate(costs):
        if not (isinstance(c, numbers.Real) and math.isfinite(c) and c >= 0):
            raise ValueError(f"costs[{i}] is {c!r}: costs must be finite and non-negative")
    prefix = list(accumulate((float(c) for c in costs), initial=0.0))
    best = prefix[:]  # one part: the whole prefix
    cuts: list[list[int]] = []  # cuts[k-2][i]: where the last of k parts of costs[:i] starts
    for k in range(2, parts + 1):
        new, cut = [math.inf] * (n + 1), [0] * (n + 1)
        for i in range(k, n + 1):
            lo, hi = k - 1, i - 1  # the last part is costs[j:i], j in [lo, hi]
            # The first j at which the first k-1 parts cost at least the last one.
            j = bisect.bisect_left(range(lo, hi + 1), True,
                                   key=lambda j: best[j] >= prefix[i] - prefix[j]) + lo
            for c in (j - 1, j):
                if lo <= c <= hi:
                    value = max(best[c], prefix[i] - prefix[c])
                    if value < new[i]:
                        new[i], cut[i] = value, c
        best = new
        cuts.append(cut)
    sizes, end = [], n
    for cut in reversed(cuts):
        sizes.append(end - cut[end])
        end = cut[end]
    sizes.append(end)
    return sizes[::-1]


def balance_by_time(module: nn.Sequential, sample: Any, partitions: int | None = None, *,
                    device: torch.device | str | None = None, repeat: int = 3,
                    timeout: float | None = None) -> list[int]:
    """Balance ``module``'s layers by the time of their forward and backward on ``sample``.

    Each layer runs on ``device`` (default: where its parameters are, or the CPU) on the
    previous layer's output, forward then backward with a cotangent of ones; its cost is the
    fastest of ``repeat`` runs after one warm-up, or, given ``timeout`` (seconds, torchgpipe's
    keyword), of as many runs as fit in the layer's share of it (one at least). A copy of the
    module is profiled, so the module's parameters, gradients and buffers (BatchNorm's
    statistics) are left as they were. torchgpipe's argument order, ``(partitions, module,
    sample)``, is accepted too. The layers run in training mode, as the pipeline's training
    steps run them.
    """
    module, sample, partitions = _arguments("balance_by_time", module, sample, partitions)
    if sample is None:
        raise TypeError("balance_by_time needs a sample input to time the layers on")
    if _meta_device(module, sample, device) is not None:
        raise ValueError("balance_by_time times real runs, and a meta module, sample or device "
                         "has no data to run on: balance a meta-built model by size "
                         "(balance_by_size, shapes only), or time a materialised one")
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    budget = None if timeout is None else timeout / max(len(module), 1)

    def measure(layer: nn.Module, x: Any, device: torch.device) -> tuple[float, Any]:
        fastest, run, begun = math.inf, 0, time.perf_counter()
        while run <= repeat if budget is None else \
                (run < 2 or time.perf_counter() - begun < budget):
            _synchronize(device)
            start = time.perf_counter()
            y = layer(x)
            outputs = [t for t in optree.tree_leaves(y)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            _synchronize(device)
            if run:
                fastest = min(fastest, time.perf_counter() - start)
            run += 1
        return fastest, y

    return partition(_profile(module, sample, partitions, device, measure), partitions)


def balance_by_size(module: nn.Sequential, sample: Any = None, partitions: int | None = None,
                    *, device: torch.device | str | None = None, param_scale: float | None = None,
                    chunks: int = 1, input: Any = None) -> list[int]:
    """Balance ``module``'s layers by the memory they hold.

    A layer's cost is ``param_scale`` times the bytes of its parameters (each tensor counted
    once, in the first layer holding it) plus the bytes of its output on ``sample``: the
    activation a stage keeps per micro-batch, so give a sample of micro-batch size, or a
    mini-batch and its ``chunks`` (the first micro-batch is measured). Buffers, gradients and
    temporaries inside a layer are not counted; set ``param_scale`` to cover gradients and
    optimiser state (2 for SGD with gradients, 4 for Adam; by default 1).

    Shapes are all it needs, so it balances a model built on the ``meta`` device (no process
    holds the whole model): a meta module, or a meta sample, runs on meta. Without a sample
    (``sample=None``) only the parameters are counted.

    torchgpipe's argument order, ``(partitions, module, input, chunks=..., param_scale=...)``,
    is accepted too, with its default ``param_scale=2.0``.
    """
    torchgpipe_order = not isinstance(module, nn.Module)
    if input is not None:  # torchgpipe's name for the third argument, its sample
        if (partitions if torchgpipe_order else sample) is not None:
            raise TypeError("balance_by_size got a sample twice: as an argument and as input=")
        if torchgpipe_order:
            partitions = input
        else:
            sample = input
    module, sample, partitions = _arguments("balance_by_size", module, sample, partitions)
    if param_scale is None:
        param_scale = 2.0 if torchgpipe_order else 1.0
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if chunks > 1 and sample is not None:
        sample = _first_microbatch(sample, chunks)
    device = _meta_device(module, sample, device) or device
    counted: set[int] = set()

    def measure(layer: nn.Module, x: Any, device: torch.device) -> tuple[float, Any]:
        y = None
        if sample is not None:
            with torch.no_grad():
                y = layer(x)
        params = [p for p in layer.parameters() if id(p) not in counted]
        counted.update(id(p) for p in params)
        return param_scale * _bytes(params) + _bytes(optree.tree_leaves(y)), y

    return partition(_profile(module, sample, partitions, device, measure), partitions)


def _meta_device(module: nn.Module, sample: Any, device: Any) -> torch.device | None:
    """The meta device, where the module, the sample or ``device`` is on it."""
    tensors = [*module.parameters(), *module.buffers(), *optree.tree_leaves(sample)]
    if (device is not None and torch.device(device).type == "meta") or any(
            isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return torch.device("meta")
    return None


def _arguments(name: str, first: Any, second: Any, third: Any) -> tuple[Any, Any, int]:
    """``(module, sample, partitions)`` from fpipe's order, or from torchgpipe's
    ``(partitions, module, sample)``."""
    if not isinstance(first, nn.Module) and isinstance(second, nn.Module):
        first, second, third = second, third, first
    if third is None:
        raise TypeError(f"{name} needs the number of partitions: {name}(module, sample, "
                        f"partitions=...) or torchgpipe's {name}(partitions, module, sample)")
    return first, second, third


def _first_microbatch(sample: Any, chunks: int) -> Any:
    """The first of ``chunks`` micro-batches of ``sample``, as ``torch.chunk`` cuts it."""
    def cut(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return leaf
        return leaf[:math.ceil(leaf.shape[0] / chunks)]
    return optree.tree_map(cut, sample)


def _profile(module: nn.Sequential, sample: Any, partitions: int,
             device: torch.device | str | None,
             measure: Callable[[nn.Module, Any, torch.device], tuple[float, Any]]) -> list[float]:
    """``measure(layer, x, device) -> (cost, output)`` each layer of a copy of ``module``, on
    the sample run through the layers before it."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing needs an nn.Sequential of layers, got "
                        f"{type(module).__name__}")
    if not 1 <= partitions <= len(module):
        raise ValueError(f"cannot split {len(module)} layers into {partitions} non-empty parts: "
                         f"give between 1 and {len(module)} partitions")
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    device = torch.device(device)
    # In training mode, as torchgpipe profiles: what the partitions will run (dropout on,
    # BatchNorm on batch statistics), whatever mode the module is in.
    model = copy.deepcopy(module).to(device).train()
    x = _to(sample, device)
    costs = []
    with tracking({}) as skips:  # torchgpipe-style skippable layers stash and pop through it
        for layer in model:
            # Each layer starts its own graph, so its backward is measured alone.
            x = optree.tree_map(_leaf_input, x)
            cost, x = measure(_Replayed(layer, skips), x, device)
            costs.append(float(cost))
    return costs


class _Replayed:
    """A layer whose every run finds the skips stashed before it, each run anew (a pop takes a
    skip away), as leaves of their own graphs."""

    def __init__(self, layer: nn.Module, skips: Any) -> None:
        self.layer, self.skips, self.stashed = layer, skips, dict(skips.values)

    def __call__(self, x: Any) -> Any:
        self.skips.values = {key: optree.tree_map(_leaf_input, value)
                             for key, value in self.stashed.items()}
        return self.layer(x)

    def parameters(self) -> Any:
        return self.layer.parameters()


def _leaf_input(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
        return leaf.detach().requires_grad_()
    return leaf


def _to(tree: Any, device: torch.device) -> Any:
    return optree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _bytes(tensors: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
