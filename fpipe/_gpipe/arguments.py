"""``fpipe.GPipe``'s arguments, taken as torchgpipe takes them and refused as it refuses them:
the same exception types, each message opening with torchgpipe's own sentence (code and tests
written against torchgpipe match on it), then saying what is wrong here and what to do."""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__: list[str] = []

CHECKPOINTS = ("always", "except_last", "never")

AUTO_BALANCE = (
    "torchgpipe.balance's automatic balancing is fpipe.stages here: "
    "balance = fpipe.stages.balance_by_time(partitions, model, sample) (by time) or "
    "fpipe.stages.balance_by_size(partitions, model, sample, chunks=8) (by memory); both also "
    "take fpipe's order, (model, sample, partitions)")

NO_BALANCE = ("balance is required: the number of layers of each partition, as in "
              "GPipe(model, balance=[2, 2], chunks=8). " + AUTO_BALANCE)


def whole(name: str, value: Any) -> int:
    """``value`` as torchgpipe's ``int(value)`` reads it, refusing what it would truncate
    (``2.5``) or misread (``True``)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name} must be a positive integer, got {value!r}") from None
    if isinstance(value, numbers.Real) and value != number:
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return number


def chunks_of(value: Any) -> int:
    chunks = whole("chunks", value)
    if chunks <= 0:
        raise ValueError(f"chunks must be a positive integer (the number of micro-batches), got "
                         f"{value!r}")
    return chunks


def checkpoint_of(value: Any) -> str:
    mode = str(value)
    if mode not in CHECKPOINTS:
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never': "
                         f"checkpoint must be one of {', '.join(map(repr, CHECKPOINTS))}, got "
                         f"{value!r}")
    return mode


def verify_module(module: Any) -> None:
    """torchgpipe's rules: an ``nn.Sequential`` whose layers are distinct modules and share no
    parameter (each partition trains its own layers)."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential to be partitioned: GPipe takes an "
                        f"nn.Sequential to cut into partitions, got "
                        f"{type(module).__name__}; write the model as a sequence of layers")
    first: dict[int, str] = {}
    for name, layer in module._modules.items():
        if id(layer) in first:
            raise ValueError(f"module with duplicate children is not supported: the module "
                             f"holds the same layer twice, as {first[id(layer)]!r} "
                             f"and {name!r}: every layer must be a distinct module (use "
                             f"copy.deepcopy, or untie the layers)")
        first[id(layer)] = name
    owner: dict[int, tuple[str, str]] = {}
    for name, layer in module.named_children():
        for param_name, param in layer.named_parameters():
            if id(param) in owner and owner[id(param)][0] != name:
                other, other_param = owner[id(param)]
                raise ValueError(f"module with duplicate parameters in distinct children is not "
                                 f"supported: layers {other!r} and {name!r} share a parameter "
                                 f"({other}.{other_param} is {name}.{param_name}): each "
                                 f"partition would train its own copy; keep tied weights in "
                                 f"one layer")
            owner.setdefault(id(param), (name, param_name))


def balance_of(balance: Iterable[Any], n_layers: int) -> list[int]:
    balance = [whole(f"balance[{i}]", size) for i, size in enumerate(balance)]
    if sum(balance) != n_layers:
        raise ValueError(f"module and sum of balance have different length (module: "
                         f"{n_layers}, sum of balance: {sum(balance)}): balance {balance} sums "
                         f"to {sum(balance)} layers but the module has {n_layers}; give the "
                         f"number of layers of each partition. " + AUTO_BALANCE)
    for i, size in enumerate(balance):
        if size <= 0:
            raise ValueError(f"balance[{i}] is {size}: every partition needs at least one "
                             f"layer (balance {balance})")
    return balance


def devices_of(devices: Iterable[Any] | None, n: int) -> list[torch.device]:
    """A device per partition: the given ones in order, or by default every CUDA device (the
    CPU for every partition on a machine without CUDA)."""
    if devices is None:
        if not torch.cuda.is_available():
            return [torch.device("cpu")] * n
        devices = range(torch.cuda.device_count())
    devices = [torch.device(d) for d in devices]
    if len(devices) < n:
        raise IndexError(f"too few devices for {n} partitions: got {len(devices)} "
                         f"({', '.join(map(str, devices)) or 'none'}); give one device per "
                         f"partition, e.g. devices=['cpu'] * {n}")
    return devices[:n]


def split(module: nn.Sequential, balance: Sequence[int],
          devices: Sequence[torch.device]) -> list[nn.Sequential]:
    """The partitions: runs of ``module``'s layers, keeping their names, moved to their devices
    (in place, as torchgpipe moves them)."""
    layers = list(module._modules.items())
    partitions, start = [], 0
    for size, device in zip(balance, devices):
        part = nn.Sequential(OrderedDict(layers[start:start + size]))
        partitions.append(nn.Module.to(part, device))
        start += size
    return partitions
