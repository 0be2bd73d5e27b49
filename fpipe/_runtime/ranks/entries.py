"""A checkpoint's entries as data, never code (``fpipe.saving``'s non-tensor entries).

DCP writes a value that is not a tensor (a step counter, a scheduler's ``last_epoch``, a
hyper-parameter, a generator's state, an ``extra=`` value) as ``torch.save`` bytes, and its
loader reads them back with ``torch.load(weights_only=False)``: a plain unpickler, which
calls whatever the bytes name. A checkpoint from someone else could then run code on the
machine that loads it. fpipe reads these bytes with the unpickler ``torch.load`` uses by
default (``weights_only=True``): numbers, strings, bytes, lists, tuples, dicts, sets,
tensors, dtypes, devices and the types given to ``torch.serialization.add_safe_globals``,
nothing that calls a function. What it refuses is recorded, not raised inside DCP, so the
load can name the entry and its file and refuse it on every rank alike; ``save`` refuses
such a value before anything is written, since no load would read it.

Every entry also has a checksum (:func:`digest` of its value, so equal for the value saved
and the value read back), written beside the tensors' by ``save``.
"""

from __future__ import annotations

import io
import re
import zlib
from typing import Any

import torch

__all__ = ["flat", "digest", "plain_data", "planner", "refusal"]


def flat(state_dict: dict) -> dict[str, Any]:
    """Every entry of a (nested) state dict by its DCP key, as DCP itself flattens it (a
    list of plain values, or any tuple, is one entry)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)[0]


def _canonical(value: Any, tensor_sum: Any) -> str:
    """A text equal for equal values in any process: each value's type and contents (a
    set's members sorted, a tensor by shape, dtype and ``tensor_sum``)."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}:{tensor_sum(value)}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, dict):
        inner = ",".join(f"{_canonical(k, tensor_sum)}:{_canonical(v, tensor_sum)}"
                         for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        inner = ",".join(_canonical(v, tensor_sum) for v in value)
    elif isinstance(value, (set, frozenset)):
        inner = ",".join(sorted(_canonical(v, tensor_sum) for v in value))
    elif type(value).__repr__ is object.__repr__ and hasattr(value, "__dict__"):
        inner = _canonical(vars(value), tensor_sum)  # an allowed class: not by its address
    else:
        inner = repr(value)
    return f"{kind}({inner})"


def digest(value: Any, tensor_sum: Any) -> int:
    """CRC-32 of a non-tensor entry's :func:`_canonical` text."""
    return zlib.crc32(_canonical(value, tensor_sum).encode("utf-8", "backslashreplace"))


_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _obviously_data(value: Any) -> bool:
    if isinstance(value, dict) and type(value) is dict:
        return all(_obviously_data(k) and _obviously_data(v) for k, v in value.items())
    if type(value) in (list, tuple):
        return all(_obviously_data(v) for v in value)
    return type(value) in _ATOMS


def plain_data(key: str, value: Any) -> None:
    """Raise ``TypeError`` naming ``key`` unless ``value`` reads back through torch's
    weights-only unpickler (checked by writing and reading it, unless it is made of
    builtins alone)."""
    if _obviously_data(value):
        return
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - named below, torch's words as the cause
        raise TypeError(f"{key} is a {type(value).__name__}, not data: a checkpoint holds "
                        f"only what torch.load(weights_only=True) reads back (numbers, "
                        f"strings, lists, dicts, tensors, ...), and reading this {_why(exc)}"
                        ) from exc


def _why(error: BaseException) -> str:
    """What torch's weights-only unpickler refused, in a few words."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    if found:
        return f"would call {found.group(1)}"
    found = re.search(r"Unsupported operand (\d+)", str(error))
    if found:
        return f"would run pickle's operation {found.group(1)}"
    return f"fails ({type(error).__name__})"


def refusal(key: str, error: BaseException, place: str) -> str:
    """The one line a load raises for an entry it did not read as data."""
    if "Weights only load failed" in str(error) or isinstance(error, _unpickling()):
        return (f"{key!r} in the checkpoint's file {place!r} is not data: reading it "
                f"{_why(error)}, so it was not read (a checkpoint is read as torch.load("
                f"weights_only=True) reads)")
    return (f"{key!r} in the checkpoint's file {place!r} is damaged: its bytes do not read "
            f"back as the saved value ({type(error).__name__})")


def _unpickling() -> type:
    import pickle

    return pickle.UnpicklingError


_PLANNER: list[type] = []


def planner() -> Any:
    """A new :class:`DataPlanner` (the class made on first use: DCP is a large import that
    ``import fpipe`` need not pay)."""
    if not _PLANNER:
        from torch.distributed.checkpoint._traverse import set_element
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class DataPlanner(DefaultLoadPlanner):
            """DCP's default load planner, reading each non-tensor entry with torch's
            weights-only unpickler; an entry it refuses (or that is not a ``torch.save``
            archive at all) is recorded in ``refused`` by key, its place left ``None``."""

            def __init__(self) -> None:
                super().__init__()
                self.refused: dict[str, BaseException] = {}

            def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
                key = read_item.dest_index.fqn
                try:
                    data = torch.load(value, weights_only=True, map_location="cpu")
                except Exception as exc:  # noqa: BLE001 - named by the caller, on every rank
                    self.refused[key] = exc
                    data = None
                if self.flatten_state_dict:
                    set_element(self.original_state_dict, self.mappings[key], data)
                else:
                    self.state_dict[key] = data

        _PLANNER.append(DataPlanner)
    return _PLANNER[0]()
