"""Each stage's tensors on its device: copied from a built model, or made from a meta one.

A model built on the ``meta`` device (``with torch.device("meta"): model = Model()``) has
shapes and no data, so no process ever holds it whole. :func:`place_stages` gives each stage
this process holds (``held``) real tensors on its own device and initialises them there:

- **Storage.** Every meta tensor of the stage's module gets uninitialised storage on the
  stage's device, in place, as ``nn.Module.to_empty`` does, except that a tensor shared by two
  names of the stage stays one tensor (``to_empty`` would split it in two). The stage's params
  then *are* the module's tensors: a second copy would double the memory the meta build saved.
- **Initialisers**, each submodule of a held stage's module in ``modules()`` order, once (a
  submodule shared with an earlier stage was done there):
  ``init="reset_parameters"`` calls its ``reset_parameters()`` where it has one (and a
  submodule holding a meta tensor without one is an error naming it); a callable ``init`` is
  called as ``init(submodule)`` (HF's ``model._init_weights``); ``init=None`` leaves the
  storage uninitialised, for a checkpoint (DCP) to fill in place.
- **The seed** (:mod:`fpipe.stages.seeding`): one base seed drawn from the caller's
  generator, then each submodule initialised under its own generator seeded from the base and
  its name in the model (``names``), so its values do not depend on the cut, on which stages
  this process holds, or on the order of anything else.
- **Shared tensors** (ties across stages, and a tensor two submodules of one stage hold) take
  the value their first owner gives them: the first submodule holding it, stage by stage in
  ``modules()`` order (for a tied GPT, the embedding, not the LM head). Where that owner's
  stage is not held here, a scratch copy of it is initialised, so processes holding different
  stages of a tie give its copies one value, seeded alike.

Stages not held stay on ``meta``: their params are meta tensors (shapes only, no memory).
Stages built with real tensors are copied to their device (held ones) as they always were.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fpipe.stages.seeding import draw_base, seeded, submodule_seed

__all__ = ["place_stages", "Init"]

Tensors = dict[str, torch.Tensor]
Init = Callable[[nn.Module], Any] | str | None
Member = tuple[int, str]  # (stage, the tensor's name in the stage's module)


def place_stages(modules: Sequence[nn.Module], devices: Sequence[torch.device],
                 held: frozenset[int], names: Sequence[dict[int, str]],
                 init: Init) -> tuple[list[Tensors], list[Tensors]]:
    """``(params, state)`` per stage: see the module's docstring. ``names[i]`` maps the
    ``id`` of each submodule of stage ``i`` to its name (``naming.module_names``). Everything
    is checked before any module is touched."""
    if not (init is None or init == "reset_parameters" or callable(init)):
        raise ValueError(f"init must be 'reset_parameters', a function init(module) or None, "
                         f"got {init!r}")
    on_meta = [_on_meta(i, m) for i, m in enumerate(modules)]
    made_here = {i for i in held if on_meta[i]}
    # The shared tensors with a copy made here that another owner's value must fill.
    shared = [group for group in _shared(modules) if any(s in made_here for s, _ in group[1:])]
    if init == "reset_parameters":
        for i in sorted(made_here):
            _check_initialisers(i, modules[i])
        for (first, name), *_ in shared:
            if first not in made_here:  # initialised here as a scratch copy
                _check_initialisers(first, _owner(modules[first], name)[0])
    made = {i: _materialize(modules[i], devices[i]) for i in sorted(made_here)}
    if init is not None and any(on_meta):
        _initialise_all(modules, devices, names, made_here, shared, init, draw_base())
    params, state = [], []
    for i, (module, device) in enumerate(zip(modules, devices)):
        take = _taker(device, made.get(i, set())) if i in held else _shapes
        params.append(_as_parameters(take(module.named_parameters()), module))
        state.append(take(module.named_buffers()))
    return params, state


def _initialise_all(modules: Sequence[nn.Module], devices: Sequence[torch.device],
                    names: Sequence[dict[int, str]], made_here: set[int],
                    shared: list[tuple[Member, ...]], init: Init, base: int) -> None:
    """Every submodule of the stages made here, each under its own seed; then each shared
    tensor's copies made here set to its first owner's value."""
    values: dict[Member, torch.Tensor] = {}
    for group in shared:  # first owners elsewhere: a scratch copy of each, initialised here
        first, name = group[0]
        if first not in made_here:
            owner, attr = _owner(modules[first], name)
            scratch = copy.deepcopy(owner)  # on meta, as that stage is not made here
            device = devices[next(s for s, _ in group if s in made_here)]
            _materialize(scratch, device)
            for sub, original in zip(scratch.modules(), owner.modules()):
                _call(sub, init, names[first][id(original)], base, device)
            values[group[0]] = getattr(scratch, attr).detach()
    firsts: dict[int, list[tuple[Member, str]]] = {}  # id(owner) -> its first members
    for group in shared:
        if group[0][0] in made_here:
            owner, attr = _owner(modules[group[0][0]], group[0][1])
            firsts.setdefault(id(owner), []).append((group[0], attr))
    done: set[int] = set()
    for i in sorted(made_here):
        for sub in modules[i].modules():
            if id(sub) in done:
                continue
            done.add(id(sub))
            _call(sub, init, names[i][id(sub)], base, devices[i])
            for member, attr in firsts.get(id(sub), ()):  # before a later owner overwrites it
                values[member] = getattr(sub, attr).detach().clone()
    with torch.no_grad():
        for group in shared:
            for s, name in group:
                if s in made_here:
                    owner, attr = _owner(modules[s], name)
                    getattr(owner, attr).copy_(values[group[0]])


def _call(sub: nn.Module, init: Init, name: str, base: int, device: torch.device) -> None:
    """``sub``'s initialiser, under the seed of its name."""
    run = (getattr(sub, "reset_parameters", None) if init == "reset_parameters"
           else lambda: init(sub))
    if callable(run):
        with seeded(submodule_seed(base, name), device), torch.no_grad():
            run()


def _shared(modules: Sequence[nn.Module]) -> list[tuple[Member, ...]]:
    """The meta tensors held under more than one name (in one stage or several), each as
    its holders stage by stage in ``named_*`` order: the first is the owner whose value all
    take."""
    holders: dict[int, list[Member]] = {}
    for i, module in enumerate(modules):
        for name, t in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
            if t.is_meta:
                holders.setdefault(id(t), []).append((i, name))
    return [tuple(members) for members in holders.values() if len(members) > 1]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return module.get_submodule(path), attr


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


def _taker(device: torch.device, made: set[int]) -> Callable[[Iterable], Tensors]:
    # A copy, except of the tensors just made here: on the CPU a bare detach would alias the
    # module, so an optimiser step on the stage's tensors would change the module on one
    # device type and not on another; a meta-built stage's tensors are its module's alike.
    def take(named: Iterable) -> Tensors:
        return {name: t.detach() if id(t) in made else t.detach().to(device, copy=True)
                for name, t in named}
    return take


def _as_parameters(taken: Tensors, module: nn.Module) -> Tensors:
    """The stage's parameters as ``nn.Parameter``s with the model's ``requires_grad``: those
    frozen in the model are not differentiated (see ``fpipe.pipeline``), and a copy frozen
    later (``requires_grad_(False)``) is frozen from the next step, as the model's would be."""
    flags = {name: p.requires_grad for name, p in module.named_parameters()}
    return {name: nn.Parameter(t, requires_grad=flags.get(name, True) and (
                            t.is_floating_point() or t.is_complex()))
            for name, t in taken.items()}


def _shapes(named: Iterable) -> Tensors:
    return {name: t.detach() if t.is_meta else torch.empty_like(t, device="meta")
            for name, t in named}
