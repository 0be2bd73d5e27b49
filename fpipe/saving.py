"""Checkpoints of a pipeline through ``torch.distributed.checkpoint`` (DCP), keyed by the
model's own names. (The module is ``saving``, not ``checkpoint``: in
``fpipe.GPipe(checkpoint=...)``, as in torchgpipe, a checkpoint is a recomputation.)

fpipe has no file format of its own: :func:`save` hands DCP a state dict laid out as
``torch.distributed.checkpoint.state_dict.get_state_dict`` lays out a module's and its
optimiser's, with ``StateDictOptions(flatten_optimizer_state_dict=True)``:

- ``"model"``: ``{name: tensor}``, every parameter and buffer under the name the whole model
  gives it (``"lm_head.weight"``), whichever stage holds it;
- ``"optim"``: ``{"state.<name>.<key>": value, "param_groups.<name>.<key>": value}``, the
  optimiser's state and hyper-parameters per parameter.

The optimiser's part is written flat because the nested form
(``{"state": ..., "param_groups": [{"params": [names]}]}``) keeps each group's list of names
as one value, which every rank of a pipeline would write with other names in it; flat, each
value belongs to one parameter (torch's option exists for pipeline parallelism). The tensors'
keys are the same in both forms. :func:`load` reads both: a checkpoint a plain module wrote
with ``get_state_dict``'s default (nested) options gives each parameter the hyper-parameters
of the group that lists its name.

So the ranks of a pipeline each write their own stages' tensors into one checkpoint (data
parallel replicas write the same keys: DCP's planner writes each once), and any cut of the
model loads it, on any number of ranks, as does the plain ``nn.Module`` (:func:`load_module`,
or ``get_state_dict`` / ``dcp.load`` / ``set_state_dict`` with that option). Any DCP storage
holds them: ``storage_writer=`` / ``storage_reader=`` are given to ``dcp.save`` / ``dcp.load``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fpipe._runtime.ranks import entries, saved_groups, teardown, training_state
from fpipe._runtime.ranks import metadata as safe_metadata
from fpipe._runtime.ranks.intact import (
    SUMS,
    agreed,
    checksums,
    files_whole,
    fresh,
    read_failure,
    sums_request,
    verify,
)
from fpipe._runtime.ranks.saved_optimizer import (
    OPTIM,
    flat_optimizer,
    hyper_parameters,
    optimizer_names,
    optimizer_state_dict,
    state_request,
)
from fpipe._runtime.trees import leaf_names, stage_items
from fpipe.errors import CheckpointError

__all__ = ["save", "load", "load_module", "names"]

_MODEL, _OPTIM = "model", OPTIM


def names(tree: Any) -> list[str]:
    """The name of each leaf of one stage's pytree, in leaf order: its path, joined by dots
    (``"wte.weight"`` for the dicts ``from_modules`` makes), as ``ties=`` spells them."""
    return leaf_names(tree)


def _dcp(process_group: Any = None) -> Any:
    """``torch.distributed.checkpoint``, imported when first used (a large import that
    ``import fpipe`` need not pay), after checking what it needs: on several ranks it exchanges
    its plans with torch's object collectives, which go through numpy."""
    if (dist.is_available() and dist.is_initialized()
            and dist.get_world_size(process_group) > 1
            and importlib.util.find_spec("numpy") is None):
        raise ImportError("fpipe.saving on several ranks needs numpy: torch.distributed."
                          "checkpoint exchanges its plans with torch's object collectives, "
                          "which use it; pip install numpy (or, in fpipe's clone, "
                          "pip install -e '.[saving]')")
    import torch.distributed.checkpoint as dcp

    if dist.is_available() and dist.is_initialized():
        teardown.used()  # its last collectives must settle before the interpreter's teardown
    return dcp


def _tensor_metadata() -> type:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return TensorStorageMetadata


def _model_names(params: Any, state: Any, rename: Any) -> dict[str, tuple[int, torch.Tensor]]:
    """Model name -> ``(stage, leaf)`` for every leaf of ``params`` and ``state``, refusing a
    leaf ``rename`` misses, a leaf that is not a tensor and two leaves under one name."""
    found: dict[str, tuple[int, torch.Tensor]] = {}
    for what, trees in (("params", params), ("state", state)):
        for stage, tree in stage_items(trees):
            table = None if rename is None else _names_of(rename, stage)
            for local, leaf in zip(names(tree), optree.tree_leaves(tree)):
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(f"{what}[{stage}][{local!r}] is a {type(leaf).__name__}, "
                                    f"not a tensor: a checkpoint holds tensors")
                if table is not None and local not in table:
                    raise KeyError(f"names[{stage}] has no entry for {what}[{stage}][{local!r}]:"
                                   f" give every leaf of the stage its model name")
                name = local if table is None else table[local]
                if name in found:
                    first = found[name][0]
                    raise ValueError(
                        f"stage {first} and stage {stage} both hold a leaf named {name!r}: a "
                        f"checkpoint keys tensors by the model's names, so give names= "
                        f"(Stages.names) mapping each stage's leaves to the model's names")
                found[name] = (stage, leaf)
    return found


def _names_of(rename: Any, stage: int) -> Mapping[str, str]:
    try:
        return rename[stage]
    except (KeyError, IndexError):
        raise KeyError(f"names has no entry for stage {stage}") from None


def save(directory: str | os.PathLike | None, params: Sequence[Any] | Mapping[int, Any],
         state: Sequence[Any] | Mapping[int, Any] | None = None, *,
         optimizer: torch.optim.Optimizer | None = None,
         names: Sequence[Mapping[str, str]] | Mapping[int, Mapping[str, str]] | None = None,
         process_group: Any = None, storage_writer: Any = None,
         extra: Mapping[str, Any] | None = None, rng: bool = False) -> None:
    """Write a checkpoint of ``params``, ``state`` and ``optimizer`` to ``directory`` with
    ``torch.distributed.checkpoint.save``.

    ``params`` / ``state``: one pytree per stage (a list), or the ``{stage: pytree}`` of the
    stages this rank holds (``fpipe.distributed``). ``optimizer``: built on leaves of
    ``params`` (any order, any groups). ``names``: per stage (a list, or a dict by stage),
    each leaf's local name -> the model's name (``Stages.names``); without it a leaf's name is
    its path in its stage's pytree, which must then be unique across stages.
    ``process_group``: the ranks that save together, each calling ``save`` with its own
    stages (default: every rank, when a process group is initialised; else this process).
    ``storage_writer``: a DCP ``StorageWriter`` (``FileSystemWriter`` with options of its
    own, an fsspec or object-store writer), given to ``dcp.save`` as it is; ``directory`` is
    then its ``checkpoint_id`` (``None``: the writer's own location). Without one, DCP picks
    its writer for ``directory``.

    ``extra``: the rest of the training state, ``{name: value}``: a ``Stateful`` (anything
    with ``state_dict`` / ``load_state_dict``: an LR scheduler, a data loader's position,
    ``torch.distributed.checkpoint.stateful.Stateful``) or a plain value (a step counter, a
    dict of numbers or tensors). Replicated: ranks that save a name must hold equal values
    (checked; it is written once). ``rng=True``: this rank's random generators too (torch's
    CPU one, each CUDA device's, Python's ``random``, numpy's), per rank. Every check runs
    before anything is written; a value that is not a tensor must be data, what
    ``torch.load(weights_only=True)`` reads back (else a ``TypeError`` naming it).
    """
    def prepare() -> tuple[dict[str, Any], dict[str, Any]]:
        """Everything this rank can refuse alone (a location, names, the optimiser, ``extra``),
        before any collective: a refusal raised on one rank only would leave the others
        waiting in the next collective until the timeout."""
        _located(directory, storage_writer, "storage_writer")
        model = _model_names(params, state, names)
        state_dict: dict[str, Any] = {_MODEL: {name: leaf.detach() for name, (_, leaf)
                                               in model.items()}}
        if optimizer is not None:
            state_dict[_OPTIM] = flat_optimizer(optimizer, optimizer_names(optimizer, model))
        saved = training_state.saved_extra(extra)
        every = {**state_dict, training_state.EXTRA: saved} if saved else state_dict
        for key, value in entries.flat(every).items():
            if not isinstance(value, torch.Tensor):
                entries.plain_data(key, value)
        return state_dict, saved

    dcp = _dcp(process_group)
    state_dict, saved = agreed(prepare, process_group, "save")
    training_state.add(state_dict, saved, rng, process_group)
    state_dict[SUMS] = checksums(state_dict)
    with _quiet():
        dcp.save(state_dict, checkpoint_id=directory, storage_writer=storage_writer,
                 process_group=process_group)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP in one process (no process group initialised), without its warning that it
    assumes so: for fpipe that is the documented way, not a guess."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or "
                                "uninitialized", UserWarning)
        yield


def _located(directory: str | os.PathLike | None, storage: Any, argument: str) -> None:
    """Refuse a call that says nowhere where the checkpoint is (DCP allows ``checkpoint_id=None``
    only with a storage object, which then knows its location)."""
    if directory is None and storage is None:
        raise ValueError(f"no checkpoint location: give a directory, or a {argument}= that "
                         f"knows where the checkpoint is")


def _reader(directory: str | os.PathLike | None, storage_reader: Any) -> Any:
    """The DCP reader the metadata check and the read both use: the one given, reset to
    ``directory`` as ``dcp.load`` resets it (when given), else a ``FileSystemReader`` that
    reads ``.metadata`` as data only (:mod:`fpipe._runtime.ranks.metadata`)."""
    _located(directory, storage_reader, "storage_reader")
    if storage_reader is None:
        _dcp()
        return safe_metadata.reader(directory)
    if directory is not None:
        storage_reader.reset(directory)
    return storage_reader


def _where(reader: Any, directory: str | os.PathLike | None) -> str:
    """The checkpoint's location, for messages."""
    return os.fspath(directory) if directory is not None else str(
        getattr(reader, "checkpoint_id", None) or type(reader).__name__)


def _metadata(reader: Any, directory: str | os.PathLike | None) -> Any:
    """DCP's ``Metadata`` of the checkpoint: ``state_dict_metadata`` says what it holds (DCP
    key -> size and dtype), ``storage_data`` where."""
    try:
        return reader.read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint in {_where(reader, directory)!r} (DCP's "
                                f".metadata is missing)") from None
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any damage: named, the reader's error its cause
        root = getattr(reader, "path", None)
        place = _where(reader, directory) if root is None else os.path.join(root, ".metadata")
        raise CheckpointError(f"the checkpoint's metadata {os.fspath(place)!r} is damaged: it "
                              f"does not read as DCP's Metadata ({type(exc).__name__})"
                              ) from exc


def _dcp_load(request: dict, metadata: Any, directory: Any, reader: Any,
              process_group: Any, planner: Any) -> None:
    """``dcp.load`` (objects read as data by ``planner``), its failures
    (``CheckpointException`` derives from ``BaseException``) raised as
    :class:`fpipe.errors.CheckpointError`, naming the files it read."""
    from torch.distributed.checkpoint.api import CheckpointException

    with torch.no_grad(), _quiet():
        try:
            _dcp(process_group).load(request, checkpoint_id=directory, storage_reader=reader,
                                     process_group=process_group, planner=planner)
        except (CheckpointException, Exception) as exc:
            keys = [".".join(map(str, path)) for path in
                    optree.tree_paths(request, none_is_leaf=True)]
            raise read_failure(exc, _where(reader, directory), metadata, reader,
                               keys) from exc


def _read_checked(request: dict, metadata: Any, directory: Any, reader: Any,
                  process_group: Any) -> dict:
    """``request`` (new tensors and placeholders) read, objects as data only, with the
    checksums of its entries, and checked against them on every rank before anything is
    returned."""
    held = metadata.state_dict_metadata
    sums = agreed(lambda: sums_request(held, list(entries.flat(request))), process_group)
    if sums is not None:
        request = {**request, SUMS: sums}
    planner = entries.planner()
    _dcp_load(request, metadata, directory, reader, process_group, planner)
    agreed(lambda: verify(entries.flat({k: v for k, v in request.items() if k != SUMS}),
                          planner.refused, request.get(SUMS), metadata, reader,
                          _where(reader, directory)), process_group)
    return request


def _check_model(model: dict[str, tuple[int, torch.Tensor]], held: dict[str, Any]) -> None:
    for name, (stage, leaf) in model.items():
        saved = held.get(f"{_MODEL}.{name}")
        if not isinstance(saved, _tensor_metadata()):
            raise KeyError(f"{name!r} (stage {stage}) is not in the checkpoint")
        shape, dtype = tuple(saved.size), saved.properties.dtype
        if shape != tuple(leaf.shape) or dtype != leaf.dtype:
            raise ValueError(f"{name!r} (stage {stage}) is {shape} {dtype} in the checkpoint "
                             f"but {tuple(leaf.shape)} {leaf.dtype} here")


def load(directory: str | os.PathLike | None, params: Sequence[Any] | Mapping[int, Any],
         state: Sequence[Any] | Mapping[int, Any] | None = None, *,
         optimizer: torch.optim.Optimizer | None = None,
         names: Sequence[Mapping[str, str]] | Mapping[int, Mapping[str, str]] | None = None,
         process_group: Any = None, ties: Any = (), storage_reader: Any = None,
         extra: dict[str, Any] | None = None, rng: bool = False) -> Any:
    """Fill ``params``' and ``state``'s tensors, in place, from the checkpoint in
    ``directory`` (``torch.distributed.checkpoint.load``); returns ``params``, or
    ``(params, state)`` when ``state`` is given.

    The arguments are :func:`save`'s: any cut of the model, on any number of ranks, loads
    any checkpoint of it, each tensor found by its model name. ``optimizer`` (built on
    leaves of ``params``) gets its state and hyper-parameters by ``load_state_dict``, from
    either of torch's optimiser layouts (flat, or nested as ``get_state_dict`` writes by
    default); its groups must keep apart the parameters saved with different hyper-parameters
    (a group of its own for the biases saved without weight decay). A leaf missing from the
    checkpoint, or saved with another shape or dtype, is an error naming it, raised before
    any tensor is read.

    ``ties``: the pipeline's ``ties=``. A plain module's optimiser holds a tied weight once,
    under one of its names, so its checkpoint has no optimiser state for the others: a tied
    copy without state of its own takes (a copy of) its tie's.

    ``storage_reader``: a DCP ``StorageReader``, given to ``dcp.load`` as it is (and read for
    the checks first); ``directory`` may then be ``None``, as with :func:`save`'s writer.

    ``extra``: the dict given to :func:`save` (its names; values of the same kind): each
    ``Stateful`` gets its saved state by ``load_state_dict``, each plain value is replaced in
    the dict by the saved one. A name the checkpoint lacks is a ``KeyError`` naming it.
    ``rng=True``: this rank's random generators are set to those its rank number saved.
    Nothing is written, into ``params``, the optimiser or ``extra``, until every part was read
    and checked on every rank: every entry against its checksum, objects read as data only
    (as ``torch.load(weights_only=True)`` reads); a refusal on any rank is raised alike on
    every rank (one :class:`fpipe.errors.CheckpointError` naming the rank).
    """
    reader = _reader(directory, storage_reader)
    metadata = agreed(lambda: _metadata(reader, directory), process_group)
    held = metadata.state_dict_metadata

    def check() -> tuple:
        model = _model_names(params, state, names)
        _check_model(model, held)
        files_whole(metadata, reader)
        order = None if optimizer is None else optimizer_names(optimizer, model)
        return model, order, training_state.request(extra, rng, held, process_group)

    # Every refusal, on any rank, is agreed (raised alike on every rank) before the next read.
    model, order, more = agreed(check, process_group)

    def read(wanted: dict[str, Any]) -> Any:
        """One checked ``dcp.load`` (collective) of optimiser entries (hyper-parameters)."""
        return _read_checked({_OPTIM: wanted}, metadata, directory, reader,
                             process_group)[_OPTIM]

    request: dict[str, Any] = {_MODEL: {name: torch.empty_like(leaf)
                                        for name, (_, leaf) in model.items()}}
    if optimizer is not None:
        order, hyper = hyper_parameters(read, lambda check: agreed(check, process_group),
                                        optimizer, order, held, ties, names)
        held_params = [p for group in optimizer.param_groups for p in group["params"]]
        request[_OPTIM] = state_request(order, held, dict(zip(order, held_params)))
    got = _read_checked({**request, **more}, metadata, directory, reader, process_group)
    optim = None if optimizer is None else agreed(
        lambda: optimizer_state_dict(optimizer, order, got[_OPTIM], hyper), process_group)
    # All read and checked on every rank: now written, the user's Statefuls first (their
    # load_state_dict may still refuse, on any rank, which then loads nothing anywhere).
    training_state.put(extra, got, lambda apply: agreed(apply, process_group))
    with torch.no_grad():
        for name, (_, leaf) in model.items():
            leaf.copy_(got[_MODEL][name])
    if optimizer is not None:
        optimizer.load_state_dict(optim)
    return params if state is None else (params, state)


def load_module(directory: str | os.PathLike | None, module: torch.nn.Module,
                optimizer: torch.optim.Optimizer | None = None, *,
                storage_reader: Any = None, extra: dict[str, Any] | None = None,
                rng: bool = False) -> None:
    """Load a checkpoint into the plain ``module`` (and its ``optimizer``), as torch's
    ``get_state_dict`` / ``dcp.load`` / ``set_state_dict`` do with
    ``flatten_optimizer_state_dict=True``: every name ``module.state_dict()`` lists must be
    in the checkpoint. A checkpoint with the optimiser in torch's nested layout is read
    without that option. ``storage_reader``, ``extra`` and ``rng``: as :func:`load`'s (the
    generators of rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    reader = _reader(directory, storage_reader)
    metadata = _metadata(reader, directory)
    held = metadata.state_dict_metadata
    files_whole(metadata, reader)
    more = training_state.request(extra, rng, held, None)
    # torch reads the optimiser in the layout it asks for: the one the checkpoint has.
    nested = saved_groups.nested_groups(saved_groups.entries(held, f"{_OPTIM}."))
    options = StateDictOptions(flatten_optimizer_state_dict=not nested)
    # torch's get_state_dict gives a new optimiser a state (a step with zero gradients):
    # taken back if the load is refused, so a refusal leaves the optimiser as it was.
    fresh_optimizer = optimizer is not None and not optimizer.state
    if optimizer is None:
        state_dict = {_MODEL: get_model_state_dict(module, options=options)}
    else:
        model, optim = get_state_dict(module, optimizer, options=options)
        state_dict = {_MODEL: model, _OPTIM: optim}
    try:  # read into new tensors, checked whole, before torch copies them into the module
        state_dict = _read_checked({**fresh(state_dict), **more}, metadata, directory,
                                   reader, None)
        if optimizer is not None:  # refused as load refuses it: one value of two is lost
            saved_groups.check_groups(optimizer, saved_groups.module_order(module, optimizer),
                                      saved_groups.module_hyper(state_dict[_OPTIM],
                                                                bool(nested)))
        training_state.put(extra, state_dict, lambda apply: apply())  # may still refuse
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()  # type: ignore[union-attr]
        raise
    set_state_dict(module, optimizer or (), model_state_dict=state_dict[_MODEL],
                   optim_state_dict=state_dict.get(_OPTIM, {}), options=options)
