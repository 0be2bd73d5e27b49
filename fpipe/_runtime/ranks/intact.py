"""A checkpoint read whole and checked before anything is written (``fpipe.saving``'s load).

DCP reads into the tensors it is given, so a shard cut short, deleted or overwritten would
leave a model half loaded, or loaded with wrong bytes and no error. fpipe's checkpoints carry a
checksum of every entry (``fpipe_checksums.<key>``, written by ``save``: CRC-32 of a tensor's
bytes, or of a non-tensor value's canonical text, :mod:`fpipe._runtime.ranks.entries`); a load
reads into new tensors and objects (the objects as data only), checks the files are there and
long enough, checks every checksum, and only then copies into the caller's tensors. On
several ranks each check ends in an agreement (one gather of objects): a problem on any rank
is raised alike on every rank, so none writes while another refuses, and none waits in a
collective the others left.

A checkpoint without checksums (written by plain ``torch.distributed.checkpoint``) is read
and checked for keys, shapes and dtypes only (and its objects read as data only).
"""

from __future__ import annotations

import ctypes
import os
import zlib
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist

from fpipe._runtime.ranks.entries import digest, flat, refusal
from fpipe._runtime.ranks.gather import all_gather_objects
from fpipe.errors import CheckpointError

__all__ = ["SUMS", "checksum", "entry_sum", "checksums", "dotted", "fresh", "files_whole",
           "sums_request", "verify", "agreed", "read_failure"]

#: The top-level key under which a checkpoint's checksums are written, one per tensor key.
SUMS = "fpipe_checksums"


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of ``tensor``'s bytes, as stored (the same on every device and process). A
    ``DTensor`` (FSDP2's shards) is summed whole, so a checkpoint's sums do not depend on how
    it was sharded: ``full_tensor()`` is a collective, which every rank of its mesh reaches
    with the same keys in the same order (replicas hold the same stages)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    flat = tensor.detach().cpu().contiguous()
    size = flat.numel() * flat.element_size()
    return zlib.crc32(ctypes.string_at(flat.data_ptr(), size)) if size else 0


def dotted(state_dict: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict by its DCP key: its path joined by dots."""
    paths, leaves, _ = optree.tree_flatten_with_path(state_dict, none_is_leaf=True)
    return {".".join(map(str, path)): leaf for path, leaf in zip(paths, leaves)
            if isinstance(leaf, torch.Tensor)}


def entry_sum(value: Any) -> int:
    """The checksum of one entry: :func:`checksum` of a tensor, else the value's digest."""
    return checksum(value) if isinstance(value, torch.Tensor) else digest(value, checksum)


def checksums(state_dict: dict) -> dict[str, int]:
    """What ``save`` writes under :data:`SUMS`: each entry's DCP key -> its checksum (in key
    order: a ``DTensor``'s sum is a collective, which replicas reach in one order)."""
    return {key: entry_sum(value) for key, value in sorted(flat(state_dict).items())}


def fresh(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a new empty one like it, for DCP to read into."""
    return optree.tree_map(lambda leaf: torch.empty_like(leaf)
                           if isinstance(leaf, torch.Tensor) else leaf, tree,
                           none_is_leaf=True)


def _files(metadata: Any, reader: Any) -> dict[str, tuple[str, int]]:
    """Each DCP key of a checkpoint in a local directory -> (its file, the bytes it needs
    there); other storage (fsspec, object stores) is named by its location."""
    root = getattr(reader, "path", None)
    found: dict[str, tuple[str, int]] = {}
    if (root is None or not os.path.isdir(os.fspath(root))  # a local directory's files only
            or not getattr(metadata, "storage_data", None)):
        return found
    for index, info in metadata.storage_data.items():
        path = os.path.join(os.fspath(root), info.relative_path)
        end = info.offset + info.length
        found[index.fqn] = (path, max(end, found.get(index.fqn, ("", 0))[1]))
    return found


def files_whole(metadata: Any, reader: Any) -> None:
    """Raise :class:`CheckpointError` for a file of the checkpoint that is missing or shorter
    than its entries say (file-system checkpoints; other storage is checked as it is read)."""
    ends: dict[str, int] = {}
    for path, end in _files(metadata, reader).values():
        ends[path] = max(end, ends.get(path, 0))
    for path, end in sorted(ends.items()):
        if not os.path.exists(path):
            raise CheckpointError(f"the checkpoint's file {path!r} is missing")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(f"the checkpoint's file {path!r} is cut short: {size} bytes "
                                  f"of the {end} its entries need")


def sums_request(held: dict[str, Any], keys: list[str]) -> dict[str, None] | None:
    """The checksums to read for ``keys`` (``None`` for a checkpoint without any); a key
    without one in a checkpoint that has them is damage. (Earlier fpipe checkpoints summed tensors
    alone: a checkpoint whose sums are all of tensors has its tensors checked.)"""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{SUMS}."
    summed = {name[len(prefix):] for name in held if name.startswith(prefix)}
    if not summed:
        return None
    objects_too = any(not isinstance(held.get(key), TensorStorageMetadata) for key in summed)
    wanted = [key for key in keys
              if objects_too or isinstance(held.get(key), TensorStorageMetadata)]
    missing = [key for key in wanted if key not in summed]
    if missing:
        raise CheckpointError(f"the checkpoint has no checksum for {missing[:3]}: its metadata "
                              f"does not match what was saved")
    return dict.fromkeys(wanted)


def verify(read: dict[str, Any], refused: dict[str, BaseException], saved: dict[str, int] | None,
           metadata: Any, reader: Any, where: str) -> None:
    """Raise :class:`CheckpointError` naming the first entry, and its file, that was not read
    as data (``refused``: key -> the unpickler's error, then its cause; the checksums first)
    or whose checksum is not the one saved. Every sum is taken before anything is raised (a
    ``DTensor``'s is a collective its replicas all reach)."""
    sums = {key: entry_sum(value) for key, value in sorted(read.items())
            if saved and key in saved}
    files = _files(metadata, reader)
    for key in sorted(refused, key=lambda k: (not k.startswith(f"{SUMS}."), k)):
        place = files.get(key, (where, 0))[0]
        raise CheckpointError(refusal(key, refused[key], place)) from refused[key]
    for key, value in sums.items():
        if value != saved[key]:  # type: ignore[index]
            place = files.get(key, (where, 0))[0]
            raise CheckpointError(f"{key!r} in the checkpoint's file {place!r} does not hold "
                                  f"the bytes saved (its checksum differs): the file is damaged")


def read_failure(error: BaseException, where: str, metadata: Any, reader: Any,
                 keys: list[str]) -> CheckpointError:
    """DCP's ``CheckpointException`` (a ``BaseException``) as a :class:`CheckpointError`
    naming the files that hold ``keys``, the entries that were being read."""
    files = _files(metadata, reader)
    held = sorted({files[key][0] for key in keys if key in files})
    named = f" from {', '.join(map(repr, held[:4]))}{' ...' if len(held) > 4 else ''}"
    return CheckpointError(f"reading the checkpoint in {where!r}{named if held else ''} "
                           f"failed in torch.distributed.checkpoint ({type(error).__name__}; "
                           f"its report is this error's cause)")


def agreed(check: Callable[[], Any], group: Any, doing: str = "load") -> Any:
    """``check()`` on every rank of ``group`` (a process group; ``None``: the world, when
    one is initialised), a failure raised alike on every rank: one :class:`CheckpointError`
    naming the first rank that failed and what it raised (on that rank, from it). Alone, a
    failure is raised as itself. ``doing``: ``"load"`` or ``"save"``, for the message."""
    try:
        result, failure = check(), None
    except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised
        result, failure = None, exc
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        if failure is not None:
            raise failure
        return result
    said = None if failure is None else f"{type(failure).__name__}: {_text(failure)}"
    everyone = all_gather_objects(said, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    for rank, theirs in zip(ranks, everyone):
        if theirs is not None:
            raise CheckpointError(f"rank {rank} could not {doing} the checkpoint, so no rank "
                                  f"did: {theirs}") from failure
    return result


def _text(error: BaseException) -> str:
    """An error's message (a ``KeyError``'s without the quotes ``str`` adds)."""
    return error.args[0] if isinstance(error, KeyError) and len(error.args) == 1 else str(error)
