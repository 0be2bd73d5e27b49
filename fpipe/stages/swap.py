"""A module called on other tensors: ``torch.func.functional_call``'s effect, for the
stages' calls, without re-reading the module's structure at every call.

``functional_call`` walks every submodule's parameters and buffers twice per call (for ties and
for the swap): 0.6 ms of host time per call of a stage of 8 small layers on the CPU, the most
of what a host-bound pipeline of ``nn.Module`` stages spends beyond a plain loop. A
:class:`Swap` reads the structure once and, per call, puts each tensor straight into its
submodule's ``_parameters`` or ``_buffers`` (as ``functional_call`` does) and puts the
module's own back after. It checks on every call, cheaply, that the structure is still the one
it read (the same submodules, holding the same names) and that the call gives exactly one
tensor per name; anything else (a changed module, ties given by one name, parametrized
submodules, a missing or extra name) goes through ``functional_call``, with its checks and
errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain, repeat
from operator import is_
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

__all__: list[str] = []


class Swap:
    """Calls ``module`` with its parameters and buffers replaced by given tensors."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._slots: dict[str, tuple[dict, str]] | None = None  # None: functional_call only
        self._read_once = False
        # Per submodule: its parent's _modules, its name there, itself (columns, not rows:
        # see _current). Per module: itself, its _parameters and _buffers. Per table: its names.
        self._parents: tuple = ()
        self._child_names: tuple = ()
        self._children: tuple = ()
        self._owners: tuple = ()
        self._params: tuple = ()
        self._buffers: tuple = ()
        self._names: list = []

    def __call__(self, tensors: Mapping[str, torch.Tensor], args: tuple) -> Any:
        slots = self._slots if self._current() else self._read()
        if slots is None or len(tensors) != len(slots) or not slots.keys() >= tensors.keys():
            given = tensors if isinstance(tensors, dict) else dict(tensors)
            return functional_call(self.module, given, args, strict=True)
        originals = []
        try:
            for name, tensor in tensors.items():
                table, key = slots[name]
                originals.append((name, table, key, table[key]))
                table[key] = tensor
            return self.module(*args)
        finally:
            for name, table, key, original in originals:
                # A tensor the module reassigned (not updated in place) comes back in the
                # caller's dict, as functional_call writes it back.
                if table[key] is not tensors[name] and isinstance(tensors, dict):
                    tensors[name] = table[key]
                table[key] = original

    def _current(self) -> bool:
        """Whether the module still has the structure :meth:`_read` read: each submodule where
        it was, each module's tables the same dicts, holding the same names. Checked with
        ``map`` over columns, so the loop runs in C: a model of 800 tensors is checked at every
        call of every micro-batch, and a Python loop over its modules cost 0.5 ms a call."""
        if not self._read_once:
            return False
        placed = map(dict.get, self._parents, self._child_names)
        return (all(map(is_, placed, self._children))
                and all(map(is_, map(getattr, self._owners, repeat("_parameters")),
                            self._params))
                and all(map(is_, map(getattr, self._owners, repeat("_buffers")), self._buffers))
                and list(map(tuple, chain(self._params, self._buffers))) == self._names)

    def _read(self) -> dict[str, tuple[dict, str]] | None:
        """Each tensor name's table and key, or None where only ``functional_call`` will do
        (parametrized submodules, tensors registered under two names)."""
        modules = dict(self.module.named_modules(remove_duplicate=False))
        links = [(parent._modules, name, child) for parent in modules.values()
                 for name, child in parent._modules.items() if child is not None]
        self._parents, self._child_names, self._children = (
            tuple(column) for column in zip(*links)) if links else ((), (), ())
        self._owners = tuple(modules.values())
        self._params = tuple(m._parameters for m in self._owners)
        self._buffers = tuple(m._buffers for m in self._owners)
        self._names = [tuple(table) for table in chain(self._params, self._buffers)]
        self._read_once = True
        slots: dict[str, tuple[dict, str]] = {}
        seen: set[int] = set()
        for prefix, m in modules.items():
            if parametrize.is_parametrized(m):
                return self._keep(None)
            for table in (m._parameters, m._buffers):
                for key, value in table.items():
                    if value is None:
                        continue
                    if id(value) in seen:
                        return self._keep(None)
                    seen.add(id(value))
                    slots[f"{prefix}.{key}" if prefix else key] = (table, key)
        return self._keep(slots)

    def _keep(self, slots: dict | None) -> dict | None:
        self._slots = slots
        return slots
