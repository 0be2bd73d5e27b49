"""``nn.Module`` -> fpipe stages: pure functions over a model's partitions.

A partition's module is kept only as the code to run. Its parameters and buffers are copied out
into plain tensors on the stage's device and come back in as arguments, swapped in for the call
as ``torch.func.functional_call`` does (:mod:`fpipe.stages.swap`); so a stage is a pure function
of its arguments, the original module is never read or written during training, and
``load_into`` hands the results back.
A model built on the ``meta`` device is the exception: its stages are made on their devices in
the module itself (:mod:`fpipe.stages.materialize`), whose tensors the stages then hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fpipe.recompute import is_recomputing, run_serial, state_owned
from fpipe.stages.materialize import Init, place_stages
from fpipe.stages.module_skip import _Routed, route_module_skips
from fpipe.stages.naming import Tie, find_ties, model_names, module_names
from fpipe.stages.running import RunningStats
from fpipe.stages.swap import Swap

__all__ = ["Stages", "ModuleStage", "StatefulModuleStage", "from_sequential", "from_modules",
           "load_into", "required_ties", "check_ties_given"]

Tensors = dict[str, torch.Tensor]


class Stages(NamedTuple):
    """What ``fpipe.pipeline`` takes: ``fpipe.pipeline(s.stages, s.params, state=s.state, ...)``.

    ``params[i]`` and ``state[i]`` map the names of stage ``i``'s parameters and buffers (as
    ``named_parameters()`` of its module spells them) to detached tensors on its device.
    ``state`` is None for stateless stages (``stateful=False``).

    ``names[i]`` maps each of those local names to the tensor's name in the model (for
    ``fpipe.saving``: ``save(d, s.params, names=s.names)``), and ``ties`` lists the parameters
    several stages hold, each as ``((stage, local_name), ...)``: pass ``ties=s.ties`` to the
    pipeline, which sums the copies' gradients so they stay equal.
    """

    stages: tuple
    params: list[Tensors]
    state: list[Tensors] | None
    names: Sequence[dict[str, str]] = ()
    ties: tuple[Tie, ...] = ()


class ModuleStage:
    """``stage(params, x) -> y``: the module run on ``params``, for modules without buffers.

    ``x`` is passed as the module's one positional argument, as ``nn.Sequential`` passes values
    between its layers: a stage returning a tuple hands the whole tuple to the next one.
    ``model``: the tensors of the whole model by name (:func:`tensor_names`), so that a
    refusal can name a weight the module reaches without holding it (see
    ``fpipe._runtime.given``); by default its own. ``ties``: the ties the cut found that
    involve this stage, which a pipeline refuses to run without (see :func:`required_ties`).
    """

    def __init__(self, module: nn.Module, model: TensorNames | None = None,
                 ties: tuple[Tie, ...] = ()) -> None:
        self.module = module
        self.swap = Swap(module)
        self.model = tensor_names({"": module}) if model is None else model
        self.ties = ties

    def __call__(self, params: Tensors, x: Any) -> Any:
        slots = self.swap.structure(run_serial())
        given = self.swap.ordered(params, {}, slots)
        result = None if given is None else self.swap.call(given, (x,))
        return self.swap(params, (x,), slots) if result is None else result[0]

    def name_of(self, tensor: torch.Tensor) -> str | None:
        """The model's name of ``tensor``, where it is one of the model's tensors."""
        held = self.model.get(id(tensor))
        return held[1] if held is not None and held[0] is tensor else None

    def sources(self) -> dict[str, torch.Tensor]:
        """The module's own parameters by name: the model's, whose ``requires_grad`` and
        gradient hooks the stage's copies follow (see ``fpipe.pipeline``)."""
        return dict(self.module.named_parameters())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.module!r})"


class StatefulModuleStage(ModuleStage):
    """``stage(params, state, x) -> (y, new_state)``: the module run on ``params`` and buffers.

    The buffers are copied before the call, so in-place updates land on the copies, which are
    returned: the caller's ``state`` is never written, which lets the driver replay a forward
    from the state it saw. A buffer the module reassigns (``self.steps = self.steps + 1``, in
    any submodule) is returned as reassigned, as plain PyTorch keeps it.

    The exception is the running statistics of torch's own normalisation layers, which only
    a training forward writes and only an evaluation forward reads (see
    :mod:`fpipe.stages.running`): where the call's state is the step's own
    (:func:`~fpipe.recompute.state_owned`), they are updated where they are, one set through
    the micro-batches as a plain module's; a layer in evaluation reads them uncopied; and a
    recompute writes scratch ones (the step's own have moved on since its forward, and its
    output does not depend on them). Other buffers are always copied: a module may save one
    for its backward and write it in the next micro-batch's call.
    """

    def __init__(self, module: nn.Module, model: TensorNames | None = None,
                 ties: tuple[Tie, ...] = ()) -> None:
        super().__init__(module, model, ties)
        self._running = RunningStats(module)
        self._read = self.swap.reads  # the swap's read of the structure _running follows

    def running(self, serial: int | None = None) -> RunningStats:
        """The running statistics of the module as it is now: read again after a change of
        its structure (a layer replaced between calls, under the same names). ``serial``:
        the run the caller is in (:func:`~fpipe.recompute.run_serial`), if any."""
        self.swap.structure(serial)
        return self._current_running()

    def _current_running(self) -> RunningStats:
        if self.swap.reads != self._read:
            self._running, self._read = RunningStats(self.module), self.swap.reads
        return self._running

    def __call__(self, params: Tensors, state: Tensors, x: Any) -> tuple[Any, Tensors]:
        serial = run_serial()
        slots = self.swap.structure(serial)  # checked once a run, before anything reads it
        running = self._current_running()
        if is_recomputing():
            uncopied, scratch = running.for_recompute(state, serial)
            tensors = {**state, **scratch} if len(scratch) == len(state) else \
                {name: scratch[name] if name in scratch else
                 buffer if name in uncopied else buffer.clone()
                 for name, buffer in state.items()}
        else:
            uncopied = running.uncopied(state_owned(), serial)
            tensors = state if uncopied.issuperset(state) else \
                {name: buffer if name in uncopied else buffer.clone()
                 for name, buffer in state.items()}
        given = self.swap.ordered(params, tensors, slots)
        result = None if given is None else self.swap.call(given, (x,))
        if result is not None:  # (the usual case: no name looked up, no dict merged)
            y, reassigned = result
            if reassigned is None:
                return y, dict(tensors)
            return y, dict(zip(tensors, reassigned))
        if tensors is state:  # (functional_call may write a reassigned buffer back)
            tensors = dict(state)
        merged = {**tensors, **params}
        if len(merged) < len(tensors) + len(params):  # a name given twice: functional_call's
            return torch.func.functional_call(self.module, (params, tensors), (x,)), tensors
        y = self.swap(merged, (x,), slots)  # writes a reassigned tensor back into ``merged``
        return y, {name: merged[name] for name in state}


TensorNames = dict[int, tuple[torch.Tensor, str]]


def tensor_names(modules: dict[str, nn.Module]) -> TensorNames:
    """``{id: (tensor, name)}`` of every parameter and buffer of ``modules`` (a name prefix
    each), the first name winning: what a refusal calls a model's tensor."""
    names: TensorNames = {}
    for prefix, module in modules.items():
        for named in (module.named_parameters(remove_duplicate=False),
                      module.named_buffers(remove_duplicate=False)):
            for name, t in named:
                names.setdefault(id(t), (t, f"{prefix}{name!r}"))
    return names


def required_ties(stages: Sequence[Any]) -> tuple[Tie, ...]:
    """The ties that stages cut from a model found (each stage's ``ties``), once each: a
    pipeline over them without these ties would train each copy apart."""
    found: list[Tie] = []
    for stage in stages:
        for tie in getattr(stage, "ties", ()):
            if tie not in found:
                found.append(tie)
    return tuple(found)


def check_ties_given(stages: Sequence[Any], ties: Any) -> None:
    """Refuse a pipeline over cut stages that leaves out a tie the cut found: its copies would
    drift apart, silently. ``ties`` is the pipeline's ``ties=`` (already checked)."""
    given = {frozenset((int(s), str(n)) for s, n in tie) for tie in (ties or ())}
    for tie in required_ties(stages):
        if not any(frozenset(tie) <= members for members in given):
            listed = " and ".join(f"{name!r} of stage {s}" for s, name in tie)
            raise ValueError(
                f"{listed} are one weight of the model (tied), which this pipeline was not "
                f"told: each copy would train apart. Pass the Stages value itself "
                f"(fpipe.pipeline(s, schedule=...)), or ties=s.ties")


def unpacked(stages: Any, ties: Any) -> tuple[Any, Any]:
    """The stage functions a pipeline is given, and its ties: a :class:`Stages` value brings
    its cut's ties (``ties=`` beside it wins), so none is forgotten. Both faces unpack here."""
    if isinstance(stages, Stages):
        return stages.stages, stages.ties if ties is None else ties
    return stages, ties


def from_sequential(module: nn.Sequential, balance: Sequence[int],
                    devices: Sequence[torch.device | str] | None = None, *,
                    stateful: bool | None = None, init: Init = "reset_parameters",
                    held: Iterable[int] | None = None) -> Stages:
    """Cut ``module`` into ``len(balance)`` contiguous partitions of ``balance[i]`` layers.

    Partition ``i`` is the slice ``module[a:b]`` (an ``nn.Sequential`` that keeps the layer
    names, so ``params[i]`` keys read ``"3.weight"`` as in ``module.named_parameters()``, and
    ``names`` maps each to itself), run on ``devices[i]``. The other arguments are
    :func:`from_modules`'.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"from_sequential takes an nn.Sequential, got {type(module).__name__}; "
                        f"cut other models with from_modules([...])")
    balance = check_balance(balance, len(module))
    bounds = [0]
    for size in balance:
        bounds.append(bounds[-1] + size)
    parts = [module[a:b] for a, b in zip(bounds, bounds[1:])]
    # Seeded by the Sequential's own layer names ("3"), so any balance initialises alike.
    return _build(parts, devices, stateful, None, init, held, seed_root=module)


def from_modules(modules: Sequence[nn.Module],
                 devices: Sequence[torch.device | str] | None = None, *,
                 stateful: bool | None = None, root: nn.Module | None = None,
                 init: Init = "reset_parameters", held: Iterable[int] | None = None) -> Stages:
    """One stage per module: ``modules[i]`` runs on ``devices[i]`` and its forward takes the
    previous stage's output as its one argument.

    This is how a model that is not an ``nn.Sequential`` is cut: write small adapter modules
    that hold references to the model's submodules (``Embed(model)``, ``Head(model)``) and
    list them with the blocks between. Skips of torchgpipe-style skippable layers
    (:mod:`fpipe.stages.module_skip`) that cross stages are routed by the pipeline.

    Args:
        modules: one module per stage.
        devices: ``devices[i]`` holds and runs stage ``i`` (default: all on the CPU; extra
            devices are left unused). Parameters and buffers are copied there: this is the
            placement call, the one place fpipe moves tensors.
        stateful: with True, stages take ``(params, state, x) -> (y, new_state)`` and
            ``Stages.state`` holds their buffers (pass ``state=s.state`` to the pipeline);
            with False they take ``(params, x) -> y``, ``Stages.state`` is None, and a module
            with buffers is an error. By default (None), stateful exactly when a module has
            buffers, so ``state=s.state`` is right either way.
        root: the whole model: ``Stages.names`` then gives each leaf the model's own name,
            found by the identity of the submodule that owns it (``"head.weight"`` of
            ``Head(model)`` is ``"lm_head.weight"``). Without it the names are the local ones.
        init: for modules built on the ``meta`` device, how each stage's tensors are
            initialised once made on its device (:mod:`fpipe.stages.materialize`):
            ``"reset_parameters"`` (every submodule's own), a function ``init(submodule)``
            called on each submodule, or None (left empty, for a checkpoint to fill). Each
            submodule is initialised under a seed of its own, from one draw of the caller's
            generator and its name in ``root`` (:mod:`fpipe.stages.seeding`): with ``root``,
            the values depend on the seed only, not on the cut or the stages held.
        held: the stages this process holds (``fpipe.distributed.my_stages``; default: all).
            Only these get tensors; the others' params and state are meta tensors (shapes
            only), and a meta-built model's other stages are never allocated.

    A parameter held by several stages (tied weights) is copied to each and listed in
    ``Stages.ties``; a buffer held by several stages is an error.
    """
    return _build(modules, devices, stateful, root, init, held, seed_root=root)


def _build(modules: Sequence[nn.Module], devices: Sequence[torch.device | str] | None,
           stateful: bool | None, root: nn.Module | None, init: Init,
           held: Iterable[int] | None, seed_root: nn.Module | None) -> Stages:
    """:func:`from_modules`, whose meta-built submodules are seeded by their names in
    ``seed_root`` (:mod:`fpipe.stages.seeding`)."""
    modules = list(modules)
    if not modules:
        raise ValueError("no modules: give at least one module (one per stage)")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"modules[{i}] is a {type(m).__name__}, not an nn.Module")
    _check_no_post_accumulate_hooks(modules)
    devices = _check_devices(devices, len(modules))
    held = _check_held(held, len(modules))
    names = model_names(modules, root)
    ties = find_ties(modules)
    if stateful is None:  # a model without buffers has nothing to carry
        stateful = any(next(m.buffers(), None) is not None for m in modules)
    if not stateful:
        for i, m in enumerate(modules):
            buffers = [name for name, _ in m.named_buffers()]
            if buffers:
                raise ValueError(f"stage {i} has buffers {sorted(buffers)}, which a stateless "
                                 f"stage cannot carry (BatchNorm's running statistics would "
                                 f"be lost): use stateful=True and pass state= to "
                                 f"fpipe.pipeline")
    params, state = place_stages(modules, devices, held, module_names(modules, seed_root), init)
    kind = StatefulModuleStage if stateful else ModuleStage
    model = tensor_names({"": root} if root is not None else
                         {f"stage {i}'s ": m for i, m in enumerate(modules)})
    cut = [kind(m, model, tuple(t for t in ties if any(s == i for s, _ in t)))
           for i, m in enumerate(modules)]
    stages = tuple(route_module_skips(cut, modules, stateful))
    for stage, inner in zip(stages, cut):
        if stage is not inner:  # a skip stage around it answers for the module stage
            stage.ties, stage.name_of, stage.sources = inner.ties, inner.name_of, inner.sources
    return Stages(stages, params, state if stateful else None, names, ties)


def load_into(target: nn.Module | Sequence[nn.Module], params: Sequence[Tensors],
              state: Sequence[Tensors] | None = None, *,
              names: Sequence[dict[str, str]] | None = None) -> None:
    """Copy trained ``params`` (and ``state``) back into the module(s) they were taken from.

    ``target`` is the ``nn.Sequential`` given to :func:`from_sequential` (whose names are
    shared by all partitions), or the list of modules given to :func:`from_modules`; or, with
    ``names`` (``Stages.names``), the whole model given as ``root``, each leaf going to its
    model name. Values are copied in place, onto each module tensor's own device; the copies
    of a tie all land, so every name of a tied weight gets its trained value.
    """
    if names is not None:
        if not isinstance(target, nn.Module):
            raise TypeError("with names=, target is the whole model (the root given to "
                            "from_modules)")
        if len(names) != len(params):
            raise ValueError(f"got {len(names)} name maps but {len(params)} parameter dicts")
        params = [{names[i].get(k, k): v for k, v in part.items()} for i, part in
                  enumerate(params)]
        if state is not None:
            state = [{names[i].get(k, k): v for k, v in part.items()} for i, part in
                     enumerate(state)]
    if isinstance(target, nn.Module):
        modules = [target] * len(params)
    else:
        modules = list(target)
        if len(modules) != len(params):
            raise ValueError(f"got {len(modules)} modules but {len(params)} parameter dicts")
    if state is not None and len(state) != len(params):
        raise ValueError(f"got {len(params)} parameter dicts but {len(state)} state dicts")
    writes = _writes(modules, params, state)
    with torch.no_grad():  # every value checked first: nothing is written on an error
        for target_tensor, value, _ in writes:
            target_tensor.copy_(value)


def _writes(modules: list, params: Sequence[Tensors],
            state: Sequence[Tensors] | None) -> list[tuple[torch.Tensor, Any, str]]:
    """``(module tensor, value, where)`` for every value of every stage, refusing a name the
    module lacks and a tensor given two different values (tied copies that drifted apart:
    their model has one tensor, which cannot hold both)."""
    writes, seen = [], {}
    for i, module in enumerate(modules):
        own = dict(module.named_parameters(remove_duplicate=False))
        own.update(module.named_buffers(remove_duplicate=False))
        values = dict(params[i])
        values.update(state[i] if state is not None else {})
        for name, value in values.items():
            if name not in own:
                raise KeyError(f"stage {i}'s {name!r} is not a parameter or buffer of "
                               f"{type(module).__name__}")
            where = f"stage {i}'s {name!r}"
            first = seen.setdefault(id(own[name]), (value, where))
            if first[0] is not value and not torch.equal(first[0].to(value.device), value):
                raise ValueError(f"{first[1]} and {where} are copies of one tensor of the "
                                 f"model (tied) but hold different values: were the tie's "
                                 f"gradients summed (ties=s.ties)? Nothing was loaded")
            writes.append((own[name], value, where))
    return writes


def _check_no_post_accumulate_hooks(modules: Sequence[nn.Module]) -> None:
    """A ``register_post_accumulate_grad_hook`` on a model parameter is refused at the cut: it
    would be called with the model's parameter after its ``.grad`` is accumulated, which the
    stages' copies never do (their gradients come back from the pipeline). Tensor hooks
    (``register_hook``) are kept: the pipeline applies them to the gradient."""
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if getattr(p, "_post_accumulate_grad_hooks", None):
                raise ValueError(
                    f"stage {i}'s parameter {name!r} has a post-accumulate-grad hook "
                    f"(register_post_accumulate_grad_hook), which a cut model cannot call: "
                    f"its copies' gradients are returned by the pipeline, not accumulated into "
                    f"the model's .grad. Remove the hook and run its work after "
                    f"fpipe.optim.bind_grads (or register it on the stage's parameter copy, "
                    f"whose .grad bind_grads sets)")


def check_state_given(stages: Sequence[Any], stateful: bool) -> None:
    """Refuse, when a pipeline is built, module stages whose kind does not fit it: stateful
    ones (``stage(params, state, x)``) in a pipeline built without ``state=``, or stateless
    ones given state; each would fail at the first step with a ``TypeError`` about missing or
    extra arguments, naming neither the stage nor the remedy."""
    for i, stage in enumerate(stages):
        takes = takes_state(stage)
        if takes is None or takes == stateful:
            continue
        if takes:
            raise TypeError(
                f"stage {i} is a stateful module stage (stage(params, state, x) -> (y, "
                f"new_state), cut with stateful=True, or by default from a model with "
                f"buffers), but the pipeline was built without state=: pass state=s.state, the "
                f"Stages' buffers, to the pipeline, or cut the model with stateful=False if it "
                f"has no buffers")
        raise TypeError(
            f"stage {i} is a stateless module stage (stage(params, x) -> y, cut with "
            f"stateful=False, or by default from a model without buffers; its Stages.state is "
            f"None), but the pipeline was built with state=: leave out state= (state=s.state "
            f"is None for such stages), or cut the model with stateful=True")


def takes_state(stage: Any) -> bool | None:
    """Whether a stage made here takes state (looking through the skip adapters that wrap
    it); ``None`` for any other function, whose signature is the user's to choose."""
    while stage is not None:
        if isinstance(stage, StatefulModuleStage):
            return True
        if isinstance(stage, ModuleStage):
            return False
        if isinstance(stage, _Routed):
            return stage.stateful
        stage = getattr(stage, "__wrapped__", None)
    return None


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


def _check_held(held: Iterable[int] | None, n_stages: int) -> frozenset[int]:
    if held is None:
        return frozenset(range(n_stages))
    held = list(held)
    for s in held:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n_stages:
            raise ValueError(f"held names stage {s!r}, but the stages are 0 to {n_stages - 1}")
    return frozenset(held)
