"""Each stage's tensors on its device: copied from a built model, or made from a meta one.

A model built on the ``meta`` device (``with torch.device("meta"): model = Model()``) has
shapes and no data, so no process ever holds it whole. :func:`place_stages` gives each stage
this process holds (``held``) real tensors on its own device and initialises them there:

- **Storage.** Every meta tensor of the stage's module gets uninitialised storage on the
  stage's device, in place, as ``nn.Module.to_empty`` does, except that a tensor shared by two
  names of the stage stays one tensor (``to_empty`` would split it in two). The stage's params
  then *are* the module's tensors: a second copy would double the memory the meta build saved.
- **Initialisers**, in this order (the order a CPU-built reference must follow to get the same
  values from the same seed): the ties' owners (below), then stage by stage, each submodule
  of the stage's module in ``modules()`` order, once (a submodule shared with an earlier
  stage was done there):
  ``init="reset_parameters"`` calls its ``reset_parameters()`` where it has one (and a
  submodule holding a meta tensor without one is an error naming it); a callable ``init`` is
  called as ``init(submodule)`` (HF's ``model._init_weights``); ``init=None`` leaves the
  storage uninitialised, for a checkpoint (DCP) to fill in place.
- **Ties** come first: the submodule that owns a tie's first member is initialised before
  anything else (a scratch copy of it, where that stage is not held here), and every copy of
  the tie held here takes its value. So processes that hold different stages of a tie, seeded
  alike (``torch.manual_seed`` with one seed on every rank), give its copies one value.

Stages not held stay on ``meta``: their params are meta tensors (shapes only, no memory).
Stages built with real tensors are copied to their device (held ones) as they always were.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fpipe.stages.naming import Tie

__all__ = ["place_stages", "Init"]

Tensors = dict[str, torch.Tensor]
Init = Callable[[nn.Module], Any] | str | None


def place_stages(modules: Sequence[nn.Module], devices: Sequence[torch.device],
                 held: frozenset[int], ties: Sequence[Tie],
                 init: Init) -> tuple[list[Tensors], list[Tensors]]:
    """``(params, state)`` per stage: see the module's docstring. Everything is checked before
    any module is touched."""
    if not (init is None or init == "reset_parameters" or callable(init)):
        raise ValueError(f"init must be 'reset_parameters', a function init(module) or None, "
                         f"got {init!r}")
    on_meta = [_on_meta(i, m) for i, m in enumerate(modules)]
    made_here = {i for i in held if on_meta[i]}
    if init == "reset_parameters":
        for i in sorted(made_here):
            _check_initialisers(i, modules[i])
    made = {i: _materialize(modules[i], devices[i]) for i in sorted(made_here)}
    done: set[int] = set()
    values = [] if init is None else _tie_values(modules, devices, ties, made_here, init, done)
    params, state = [], []
    for i, (module, device) in enumerate(zip(modules, devices)):
        if i not in held:
            take = _shapes
        else:
            if i in made:
                _initialise(module, init, done)
            take = _taker(device, made.get(i, set()))
        params.append(_as_parameters(take(module.named_parameters()), module))
        state.append(take(module.named_buffers()))
    with torch.no_grad():
        for tie, value in values:
            for s, name in tie:
                if s in made_here:
                    params[s][name].copy_(value)
    return params, state


def _tie_values(modules: Sequence[nn.Module], devices: Sequence[torch.device],
                ties: Sequence[Tie], made_here: set[int], init: Init,
                done: set[int]) -> list[tuple[Tie, torch.Tensor]]:
    """Each tie's value, made before anything else is initialised, so that every process
    draws it alike whichever stages it holds: the submodule that owns the tie's first member
    is initialised (its own, if that stage is made here; else a scratch copy on the device of
    a member made here), and its tensor is the value every copy takes."""
    values = []
    for tie in ties:
        mine = [s for s, _ in tie if s in made_here]
        if not mine:
            continue
        first, name = tie[0]
        path, _, attr = name.rpartition(".")
        owner = modules[first].get_submodule(path)
        if first not in made_here:
            owner = copy.deepcopy(owner)  # on meta, as the stage is not made here
            _materialize(owner, devices[mine[0]])
            if init == "reset_parameters":
                _check_initialisers(first, owner)
        _initialise(owner, init, done)
        values.append((tie, getattr(owner, attr).detach()))
    return values


def _on_meta(i: int, module: nn.Module) -> bool:
    """Whether stage ``i`` is built on meta; a stage partly on meta is an error."""
    named = [*module.named_parameters(), *module.named_buffers()]
    meta = [name for name, t in named if t.is_meta]
    if meta and len(meta) != len(named):
        real = [name for name, t in named if not t.is_meta]
        raise ValueError(f"stage {i} has tensors on the meta device ({meta[:3]}) and others "
                         f"not ({real[:3]}): build the whole stage on meta, or none of it")
    return bool(meta)


def _direct_meta(module: nn.Module) -> list[str]:
    return [name for slots in (module._parameters, module._buffers)
            for name, t in slots.items() if t is not None and t.is_meta]


def _check_initialisers(i: int, module: nn.Module) -> None:
    for path, sub in module.named_modules():
        bare = _direct_meta(sub)
        if bare and not callable(getattr(sub, "reset_parameters", None)):
            names = [f"{path}.{n}" if path else n for n in bare]
            raise ValueError(f"stage {i}'s {names} are on the meta device and their "
                             f"{type(sub).__name__} has no reset_parameters() to initialise "
                             f"them: pass init= (a function called on each submodule), or "
                             f"init=None to leave them for a checkpoint to fill")


def _materialize(module: nn.Module, device: torch.device) -> set[int]:
    """Uninitialised storage on ``device`` for every meta tensor of ``module``, in place,
    shared tensors kept shared; the ids of the new tensors."""
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, real)
    for sub in module.modules():
        for slots in (sub._parameters, sub._buffers):
            for key, t in slots.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    real = torch.empty_like(t, device=device)
                    if isinstance(t, nn.Parameter):
                        real = nn.Parameter(real, requires_grad=t.requires_grad)
                    new[id(t)] = (t, real)
                slots[key] = new[id(t)][1]
    return {id(real) for _, real in new.values()}


def _initialise(module: nn.Module, init: Init, done: set[int]) -> None:
    with torch.no_grad():
        for sub in module.modules():
            if id(sub) in done:
                continue
            done.add(id(sub))
            if init == "reset_parameters":
                if callable(getattr(sub, "reset_parameters", None)):
                    sub.reset_parameters()
            elif init is not None:
                init(sub)


def _taker(device: torch.device, made: set[int]) -> Callable[[Iterable], Tensors]:
    # A copy, except of the tensors just made here: on the CPU a bare detach would alias the
    # module, so an optimiser step on the stage's tensors would change the module on one
    # device type and not on another; a meta-built stage's tensors are its module's alike.
    def take(named: Iterable) -> Tensors:
        return {name: t.detach() if id(t) in made else t.detach().to(device, copy=True)
                for name, t in named}
    return take


def _as_parameters(taken: Tensors, module: nn.Module) -> Tensors:
    """The stage's parameters, those frozen in the model (``requires_grad=False``) as frozen
    ``nn.Parameter``s, which the pipeline does not differentiate (see ``fpipe.pipeline``);
    the others plain tensors, as ``torch.func`` takes them."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    if not frozen:
        return taken
    return {name: nn.Parameter(t, requires_grad=False) if name in frozen else t
            for name, t in taken.items()}


def _shapes(named: Iterable) -> Tensors:
    return {name: t.detach() if t.is_meta else torch.empty_like(t, device="meta")
            for name, t in named}
