"""``nn.Module`` -> fpipe stages: pure functions over a model's partitions.

A partition's module is kept only as the code to run. Its parameters and buffers are copied out
into plain tensors on the stage's device and come back in as arguments, swapped in for the call
by ``torch.func.functional_call``; so a stage is a pure function of its arguments, the original
module is never read or written during training, and ``load_into`` hands the results back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

from fpipe.stages.module_skip import route_module_skips

__all__ = ["Stages", "ModuleStage", "StatefulModuleStage", "from_sequential", "from_modules",
           "load_into"]

Tensors = dict[str, torch.Tensor]


class Stages(NamedTuple):
    """What ``fpipe.pipeline`` takes: ``fpipe.pipeline(s.stages, s.params, state=s.state, ...)``.

    ``params[i]`` and ``state[i]`` map the names of stage ``i``'s parameters and buffers (as
    ``named_parameters()`` of its module spells them) to detached tensors on its device.
    ``state`` is None for stateless stages (``stateful=False``).
    """

    stages: tuple
    params: list[Tensors]
    state: list[Tensors] | None


class ModuleStage:
    """``stage(params, x) -> y``: the module run on ``params``, for modules without buffers.

    ``x`` is passed as the module's one positional argument, as ``nn.Sequential`` passes values
    between its layers: a stage returning a tuple hands the whole tuple to the next one.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, params: Tensors, x: Any) -> Any:
        return functional_call(self.module, params, (x,), strict=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.module!r})"


class StatefulModuleStage(ModuleStage):
    """``stage(params, state, x) -> (y, new_state)``: the module run on ``params`` and buffers.

    The buffers are cloned before the call, so in-place updates (BatchNorm's running statistics)
    land on the clones, which are returned: the caller's ``state`` is never written, which lets
    the driver replay a forward from the state it saw.
    """

    def __call__(self, params: Tensors, state: Tensors, x: Any) -> tuple[Any, Tensors]:
        new_state = {name: buffer.clone() for name, buffer in state.items()}
        y = functional_call(self.module, (params, new_state), (x,), strict=True)
        return y, new_state


def from_sequential(module: nn.Sequential, balance: Sequence[int],
                    devices: Sequence[torch.device | str] | None = None, *,
                    stateful: bool = True) -> Stages:
    """Cut ``module`` into ``len(balance)`` contiguous partitions of ``balance[i]`` layers.

    Partition ``i`` is the slice ``module[a:b]`` (an ``nn.Sequential`` that keeps the layer
    names, so ``params[i]`` keys read ``"3.weight"`` as in ``module.named_parameters()``), run
    on ``devices[i]`` (default: all on the CPU; extra devices are left unused). Parameters and
    buffers are copied there: this is the placement call, the one place fpipe moves tensors.

    With ``stateful=True`` stages take ``(params, state, x) -> (y, new_state)``; with
    ``stateful=False`` they take ``(params, x) -> y`` and a module with buffers is an error.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"from_sequential takes an nn.Sequential, got {type(module).__name__}; "
                        f"cut other models with from_modules([...])")
    balance = check_balance(balance, len(module))
    bounds = [0]
    for size in balance:
        bounds.append(bounds[-1] + size)
    parts = [module[a:b] for a, b in zip(bounds, bounds[1:])]
    return from_modules(parts, devices, stateful=stateful)


def from_modules(modules: Sequence[nn.Module],
                 devices: Sequence[torch.device | str] | None = None, *,
                 stateful: bool = True) -> Stages:
    """One stage per module: ``modules[i]`` runs on ``devices[i]`` and its forward takes the
    previous stage's output as its one argument.

    This is how a model that is not an ``nn.Sequential`` is cut: write small adapter modules
    that hold references to the model's submodules (``Embed(model)``, ``Head(model)``) and
    list them with the blocks between. A parameter shared by two stages (tied weights) is an
    error naming it and both stages: each stage would train its own copy. Skips of
    torchgpipe-style skippable layers (:mod:`fpipe.stages.module_skip`) that cross stages are
    routed by the pipeline.
    """
    modules = list(modules)
    if not modules:
        raise ValueError("no modules: give at least one module (one per stage)")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"modules[{i}] is a {type(m).__name__}, not an nn.Module")
    devices = _check_devices(devices, len(modules))
    _check_untied(modules)
    params = [_place(m.named_parameters(), d) for m, d in zip(modules, devices)]
    state = [_place(m.named_buffers(), d) for m, d in zip(modules, devices)]
    if stateful:
        stages = [StatefulModuleStage(m) for m in modules]
        return Stages(tuple(route_module_skips(stages, modules, True)), params, state)
    for i, buffers in enumerate(state):
        if buffers:
            raise ValueError(f"stage {i} has buffers {sorted(buffers)}, which a stateless stage "
                             f"cannot carry (BatchNorm's running statistics would be lost): "
                             f"use stateful=True and pass state= to fpipe.pipeline")
    stages = [ModuleStage(m) for m in modules]
    return Stages(tuple(route_module_skips(stages, modules, False)), params, None)


def load_into(target: nn.Module | Sequence[nn.Module], params: Sequence[Tensors],
              state: Sequence[Tensors] | None = None) -> None:
    """Copy trained ``params`` (and ``state``) back into the module(s) they were taken from.

    ``target`` is the ``nn.Sequential`` given to :func:`from_sequential` (whose names are
    shared by all partitions), or the list of modules given to :func:`from_modules`. Values
    are copied in place, onto each module tensor's own device.
    """
    if isinstance(target, nn.Module):
        modules = [target] * len(params)
    else:
        modules = list(target)
        if len(modules) != len(params):
            raise ValueError(f"got {len(modules)} modules but {len(params)} parameter dicts")
    if state is not None and len(state) != len(params):
        raise ValueError(f"got {len(params)} parameter dicts but {len(state)} state dicts")
    with torch.no_grad():
        for i, module in enumerate(modules):
            own = dict(module.named_parameters(remove_duplicate=False))
            own.update(module.named_buffers(remove_duplicate=False))
            values = dict(params[i])
            values.update(state[i] if state is not None else {})
            for name, value in values.items():
                if name not in own:
                    raise KeyError(f"stage {i}'s {name!r} is not a parameter or buffer of "
                                   f"{type(module).__name__}")
                own[name].copy_(value)


def _place(named: Any, device: torch.device) -> Tensors:
    # Always a copy: on the CPU a bare detach would alias the module, so an optimiser step on
    # the stage's tensors would change the module on one device type and not on another.
    return {name: t.detach().to(device, copy=True) for name, t in named}


def check_balance(balance: Sequence[int], n_layers: int) -> list[int]:
    balance = list(balance)
    if not balance:
        raise ValueError("balance is empty: give the number of layers of each partition")
    for i, size in enumerate(balance):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"balance[{i}] is {size!r}: every partition needs a positive whole "
                             f"number of layers")
    if sum(balance) != n_layers:
        raise ValueError(f"balance {balance} sums to {sum(balance)} layers but the module has "
                         f"{n_layers}")
    return balance


def _check_devices(devices: Sequence | None, n_stages: int) -> list[torch.device]:
    if devices is None:
        return [torch.device("cpu")] * n_stages
    devices = [torch.device(d) for d in devices]
    if len(devices) < n_stages:
        raise ValueError(f"{n_stages} partitions but only {len(devices)} devices: give at least "
                         f"one device per partition")
    return devices[:n_stages]


def _check_untied(modules: list[nn.Module]) -> None:
    """A tensor in two stages would be copied to each and trained apart: refuse it."""
    owner: dict[int, tuple[int, str]] = {}
    for i, module in enumerate(modules):
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) in owner:
                j, first = owner[id(t)]
                raise ValueError(f"{first!r} of stage {j} and {name!r} of stage {i} are the same "
                                 f"tensor (tied weights); stages cannot share a tensor: keep "
                                 f"tied layers in one stage, or untie them")
            owner[id(t)] = (i, name)
