"""DCP's ``.metadata`` read as data (``fpipe.saving``'s default reader).

``FileSystemReader.read_metadata`` unpickles the file with no restriction, so a checkpoint
from someone else could run code before a single entry is read. fpipe's reader admits the
types DCP's metadata is made of (its metadata dataclasses, ``torch.Size``, dtypes, layouts,
paths) and nothing else: a file naming anything else is refused, unread, as is one that is
not a pickle of DCP's ``Metadata`` at all.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from fpipe.errors import CheckpointError

__all__ = ["reader", "read"]

_MODULES = ("torch.distributed.checkpoint.metadata",)
_NAMED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
          ("torch", "Size"), ("torch.serialization", "_get_layout"),
          ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
          ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
          ("pathlib", "PureWindowsPath")}


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Unpickler(pickle.Unpickler):
    """Admits DCP's metadata types alone (what ``find_class`` returns is all a pickle can
    call or build)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NAMED or (module in _MODULES and "." not in name):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def read(file: Any, path: str) -> Any:
    """The ``Metadata`` pickled in ``file``; a :class:`CheckpointError` naming ``path`` for
    anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _Unpickler(file).load()
    except _Refused as refused:
        raise CheckpointError(f"the checkpoint's metadata {path!r} is not data: reading it "
                              f"would call {refused.name}, so it was not read") from None
    except Exception as exc:  # noqa: BLE001 - any damage: named, the error its cause
        raise CheckpointError(f"the checkpoint's metadata {path!r} is damaged: it does not "
                              f"read as DCP's Metadata ({type(exc).__name__})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"the checkpoint's metadata {path!r} is damaged: it holds a "
                              f"{type(metadata).__name__}, not DCP's Metadata")
    return metadata


def reader(directory: str | os.PathLike) -> Any:
    """DCP's ``FileSystemReader`` for ``directory``, its ``.metadata`` read by :func:`read`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as file:
                metadata = read(file, os.fspath(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return DataReader(directory)
