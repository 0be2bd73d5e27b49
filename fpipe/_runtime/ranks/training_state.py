"""The rest of a training run's state in a checkpoint (``fpipe.saving``'s ``extra=`` and
``rng=``): an LR scheduler, a step counter, any ``Stateful``, and the random generators.

Both travel through DCP like the model: ``"extra": {name: state}`` and
``"rng": {"rank<r>": {...}}``, tensors where the value is one (each with its checksum, as the
model's), DCP's pickled bytes for the rest. Two kinds of entry:

- ``extra`` entries are **replicated**: every rank that saves a name holds the same value (a
  scheduler and a step counter advance alike on every rank), so DCP writes it once, a load on
  any number of ranks gives every rank that value, and a save refuses values that differ
  between ranks (they would be written once, the others lost).
- RNG states are **per rank**: each rank's generators drew their own numbers (its dropout, its
  data order), so each is saved under the rank's number and loaded by the rank of that number.
  On fewer ranks, the first ranks' states come back (rank 0 draws each step's seed for every
  stage, so its state is the one that makes a resumed step draw as the uninterrupted one).

Nothing here writes into the caller's objects until :func:`apply` and :func:`restore`, which
``fpipe.saving`` calls once the whole checkpoint was read and checked.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import random
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist

from fpipe._runtime.ranks.gather import all_gather_objects
from fpipe._runtime.ranks.intact import checksum, dotted

__all__ = ["EXTRA", "RNG", "add", "request", "put", "saved_extra", "check_replicated",
           "extra_request", "apply", "rank_of", "rng_state", "rng_request", "restore"]

EXTRA, RNG = "extra", "rng"


def add(state_dict: dict[str, Any], saved: dict[str, Any], rng: bool, group: Any) -> None:
    """``saved`` (what :func:`saved_extra` made of ``extra``, checked equal on every rank
    that saves a name: collective) and, with ``rng``, this rank's generators, added to the
    state dict ``save`` writes."""
    check_replicated(saved, group)
    if saved:
        state_dict[EXTRA] = saved
    if rng:
        state_dict[RNG] = {f"rank{rank_of(group)}": rng_state()}


def request(extra: Mapping[str, Any] | None, rng: bool, held: dict[str, Any],
            group: Any) -> dict[str, Any]:
    """What a load reads besides the model and the optimiser: ``extra``'s entries and this
    rank's generators (a ``KeyError`` naming what the checkpoint lacks)."""
    more: dict[str, Any] = {}
    if extra:
        more[EXTRA] = extra_request(extra, held)
    if rng:
        rank = rank_of(group)
        more[RNG] = {f"rank{rank}": rng_request(held, rank)}
    return more


def put(extra: dict[str, Any] | None, read: dict[str, Any],
        agree: Callable[[Callable[[], None]], None]) -> None:
    """The read ``extra`` and generators put in place, once everything was read and checked:
    the first writes into the caller's objects, before the model's tensors. A ``Stateful``'s
    own ``load_state_dict`` can still refuse its state; ``agree`` runs the loads so that a
    refusal on any rank is raised on every rank, and each rank then gives back every
    ``extra`` entry it had already loaded, so a refused load leaves nothing loaded."""
    if EXTRA in read:
        kept = {name: (copy.deepcopy(value.state_dict()) if _is_stateful(value) else value)
                for name, value in (extra or {}).items()}
        try:
            agree(lambda: apply(extra, read[EXTRA]))
        except BaseException:
            _give_back(extra, kept)  # type: ignore[arg-type]
            raise
    if RNG in read:
        (generators,) = read[RNG].values()
        restore(generators)


def _give_back(extra: dict[str, Any], kept: dict[str, Any]) -> None:
    """Every entry of ``extra`` back to what it held before a refused load: a ``Stateful`` by
    its own ``load_state_dict`` of its earlier state, a plain value put back. A ``Stateful``
    that refuses even its earlier state is left as it is (the one that refused the load, which
    took nothing in), and the others are still given back: the load's own error is the one
    raised, not this one."""
    for name, earlier in kept.items():
        if _is_stateful(extra[name]):
            with contextlib.suppress(Exception):
                extra[name].load_state_dict(earlier)
        else:
            extra[name] = earlier


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


def saved_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """What ``save`` writes for ``extra``: each ``Stateful``'s ``state_dict()``, a plain value
    as it is (tensors detached)."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra= is a {type(extra).__name__}: give a dict of name -> a "
                        f"Stateful (LR scheduler, ...) or a plain value (a step counter)")
    out = {}
    for name, value in extra.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"extra's key {name!r}: a checkpoint's keys are non-empty "
                             f"strings without dots")
        value = value.state_dict() if _is_stateful(value) else value
        out[name] = optree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                                    value, none_is_leaf=True)
    return out


def _digest(value: Any) -> int:
    """A fingerprint of one entry, equal for equal values on any rank: its structure, and
    each leaf's bytes (tensors: shape, dtype and checksum; others: pickled)."""
    paths, leaves, spec = optree.tree_flatten_with_path(value, none_is_leaf=True)
    parts = [repr(spec)]
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            said = f"{tuple(leaf.shape)} {leaf.dtype} {checksum(leaf)}"
        else:
            try:
                said = pickle.dumps(leaf).hex()
            except Exception:  # noqa: BLE001 - an unpicklable leaf: DCP would refuse it too
                said = repr(leaf)
        parts.append(f"{path}={said}")
    return zlib.crc32("\n".join(parts).encode())


def check_replicated(saved: dict[str, Any], group: Any) -> None:
    """Raise, on every rank of ``group`` alike, for an ``extra`` name that ranks save with
    different values. Collective when a process group of several ranks is initialised."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return
    everyone = all_gather_objects({name: _digest(v) for name, v in saved.items()}, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    for name in sorted({n for theirs in everyone for n in theirs}):
        values: dict[int, list[int]] = {}
        for rank, theirs in zip(ranks, everyone):
            if name in theirs:
                values.setdefault(theirs[name], []).append(rank)
        if len(values) > 1:
            apart = "; ".join(f"ranks {r}" for r in values.values())
            raise ValueError(f"extra[{name!r}] differs between ranks ({apart} hold different "
                             f"values): an extra entry is replicated, written once, so every "
                             f"rank must hold the same value (give per-rank state a name per "
                             f"rank, e.g. f'{name}_{{rank}}')")


def extra_request(extra: Mapping[str, Any] | None, held: dict[str, Any]) -> dict[str, Any]:
    """What a load reads for ``extra``: each entry's current value (a ``Stateful``'s
    ``state_dict()``) as the template DCP fills, with new tensors. A name the checkpoint
    lacks is a ``KeyError`` naming it and the names it holds (before anything is read)."""
    template = saved_extra(extra)
    prefix = f"{EXTRA}."
    saved = sorted({key[len(prefix):].split(".")[0] for key in held if key.startswith(prefix)})
    for name in template:
        if name not in saved:
            raise KeyError(f"the checkpoint holds no extra entry {name!r} (it holds "
                           f"{saved or 'none'}): was it saved with extra={{{name!r}: ...}}?")
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key in dotted({EXTRA: template}):  # each tensor of the template saved as a tensor
        if not isinstance(held.get(key), TensorStorageMetadata):
            raise KeyError(f"extra entry {key.split('.')[1]!r} was saved with another "
                           f"structure: the checkpoint has no tensor {key!r}")
    return optree.tree_map(lambda v: torch.empty_like(v) if isinstance(v, torch.Tensor) else v,
                           template, none_is_leaf=True)


def apply(extra: Mapping[str, Any] | None, read: dict[str, Any]) -> None:
    """The read entries into ``extra``: a ``Stateful`` by ``load_state_dict``, a plain value
    put in its place in the dict."""
    for name, value in (extra or {}).items():
        if _is_stateful(value):
            value.load_state_dict(read[name])
        else:
            extra[name] = read[name]  # type: ignore[index]


# -- random generators, per rank -------------------------------------------------------------


def rank_of(group: Any) -> int:
    """This process's rank among the ranks that save or load together (0 alone)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group)
    return 0


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def rng_state() -> dict[str, Any]:
    """This process's generators: torch's CPU one, each CUDA device's (when CUDA is
    initialised), Python's ``random`` and numpy's global one (when numpy imports)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": {"version": version, "gauss": gauss,
                                        "state": torch.tensor(internal, dtype=torch.int64)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = {str(i): torch.cuda.get_rng_state(i)
                         for i in range(torch.cuda.device_count())}
    numpy = _numpy()
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss),
                          "gauss": float(cached),
                          "keys": torch.tensor(keys.astype("int64"), dtype=torch.int64)}
    return state


def rng_request(held: dict[str, Any], rank: int) -> dict[str, Any]:
    """What a load reads of rank ``rank``'s generators, from the checkpoint's metadata:
    placeholders of every entry it holds there. A checkpoint without them (saved without
    ``rng=True``, or on fewer ranks) is a ``KeyError`` naming the rank."""
    from fpipe._runtime.ranks.saved_groups import placeholder

    prefix = f"{RNG}.rank{rank}."
    found = {key[len(prefix):]: saved for key, saved in held.items() if key.startswith(prefix)}
    if not found:
        ranks = sorted({k.split(".")[1] for k in held if k.startswith(f"{RNG}.")})
        raise KeyError(f"the checkpoint holds no random generator state for rank {rank} "
                       f"({'it was saved without rng=True' if not ranks else f'it holds {ranks}'})")
    request: dict[str, Any] = {}
    for key, saved in found.items():
        *path, last = key.split(".")
        node = request
        for part in path:
            node = node.setdefault(part, {})
        node[last] = placeholder(saved)
    return request


def restore(read: dict[str, Any]) -> None:
    """Set this process's generators from a read :func:`rng_state`: what the checkpoint and
    this process both have (CUDA devices by index, numpy when it imports)."""
    torch.set_rng_state(read["torch"])
    python = read["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    if "cuda" in read and torch.cuda.is_available():
        for index, value in read["cuda"].items():
            if int(index) < torch.cuda.device_count():
                torch.cuda.set_rng_state(value, int(index))
    numpy = _numpy()
    if "numpy" in read and numpy is not None:
        saved = read["numpy"]
        numpy.random.set_state((saved["kind"], saved["keys"].numpy().astype("uint32"),
                                saved["pos"], saved["has_gauss"], saved["gauss"]))
