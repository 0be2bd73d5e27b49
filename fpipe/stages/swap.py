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

from collections import deque
from collections.abc import Mapping
from itertools import chain, repeat
from operator import getitem, is_, setitem
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

__all__: list[str] = []


_UNCHECKED = object()


class Swap:
    """Calls ``module`` with its parameters and buffers replaced by given tensors."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._slots: dict[str, tuple[dict, str]] | None = None  # None: functional_call only
        self._read_once = False
        self.reads = 0  # how many times the structure was read (a change read anew adds one)
        # Per submodule: its parent's _modules, its name there, itself (columns, not rows:
        # see _current). Per module: itself, its _parameters and _buffers. Per table: its names.
        self._parents: tuple = ()
        self._child_names: tuple = ()
        self._children: tuple = ()
        self._owners: tuple = ()
        self._params: tuple = ()
        self._buffers: tuple = ()
        self._sizes: list = []
        self._empty: tuple = ((), ())  # the (tables, keys) registered as None: still None?
        self._order: tuple = ((), (), ())
        self._n_params = 0  # the slots are the parameters' (in order), then the buffers'
        self._param_slots: tuple = ((), ())  # the parameters' (tables, keys)
        self._checked_in: int | None = None  # the run serial of the last check, if in a run

    def __call__(self, tensors: Mapping[str, torch.Tensor], args: tuple,
                 slots: Any = _UNCHECKED) -> Any:
        """``slots``: what :meth:`structure` just returned, where the caller checked it."""
        if slots is _UNCHECKED:
            slots = self.structure()
        if slots is None or len(tensors) != len(slots):
            given = tensors if isinstance(tensors, dict) else dict(tensors)
            return functional_call(self.module, given, args, strict=True)
        names = self._order[0]
        try:  # as many names as slots, each found: the slots' names
            given = list(map(tensors.__getitem__, names))
        except KeyError:  # a name replaced by another, or missing: functional_call's error
            return functional_call(self.module, dict(tensors), args, strict=True)
        result = self.call(given, args)
        if result is None:  # a slot's name is gone from its table: functional_call's checks
            return functional_call(self.module, dict(tensors), args, strict=True)
        y, now = result
        # A buffer the module reassigned (not updated in place) comes back in the caller's
        # dict, as functional_call writes it back. (A parameter can be reassigned only by a
        # new nn.Parameter, which no stage's caller reads back: not looked for.)
        if now is not None and isinstance(tensors, dict):
            tensors.update(zip(names[self._n_params:], now))
        return y

    def ordered(self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                slots: Any) -> list | None:
        """``params``' tensors then ``buffers``', as :meth:`call` takes them, where each gives
        exactly the slots' names in the slots' order (a stage's dicts, built from the module's
        own names, do: no name is looked up); else ``None`` (:meth:`__call__`, by name)."""
        if slots is None or len(params) + len(buffers) != len(slots):
            return None
        names, n = self._order[0], self._n_params
        if tuple(params) != names[:n] or tuple(buffers) != names[n:]:
            return None
        return [*params.values(), *buffers.values()]

    def call(self, given: list, args: tuple) -> tuple[Any, list | None] | None:
        """The module called on ``given`` (every slot's tensor, in slot order: what
        :meth:`ordered` returned): ``(output, buffers)``, ``buffers`` the tensors in the buffer
        slots after the call where the module reassigned one (``None`` where none was), in
        slot order. ``None`` where a slot's name is gone from its table (the module is then
        left untouched)."""
        originals = self._slot_values()
        if originals is None:
            return None
        _, tables, keys = self._order
        n = self._n_params
        # Each loop over every tensor runs in C (map): a model of 800 tensors is swapped in
        # and out at every call of every micro-batch. Buffers given as the module's own (a
        # stateful stage's running statistics, updated where they are) stay where they are.
        own = all(map(is_, given[n:], originals[n:]))
        swapped = self._param_slots if own else (tables, keys)
        deque(map(setitem, *swapped, given), maxlen=0)
        try:
            y = self.module(*args)
        finally:
            now = list(map(getitem, tables[n:], keys[n:]))
            kept = all(map(is_, now, given[n:]))
            deque(map(setitem, *(swapped if kept else (tables, keys)), originals), maxlen=0)
        return y, None if kept else now

    def structure(self, serial: int | None = None) -> dict[str, tuple[dict, str]] | None:
        """Each tensor name's table and key, the module's structure checked first and read
        again where it changed (:attr:`reads` counts the reads); ``None``: only
        ``functional_call`` will do.

        ``serial``: the runtime's run the calling stage is in
        (:func:`fpipe.recompute.run_serial`), in which the structure is checked once: within
        one run only stage calls run, and a module that changes its own structure in its
        forward (registers a buffer at its first call) runs on, for the rest of the run, as
        the run found it, its new tensors its own, as a plain module's forward would; the next
        run reads it again. A slot whose name is gone is noticed at once all the same
        (:meth:`_slot_values`)."""
        if serial is not None and serial == self._checked_in and self._read_once:
            return self._slots
        self._checked_in = serial
        return self._slots if self._current() else self._read()

    def named(self, serial: int | None = None) -> tuple[dict, dict] | None:
        """``(dict(module.named_parameters()), dict(module.named_buffers()))`` as they are
        now, read from the tables they live in (no walk of the module, which costs a model of
        800 tensors milliseconds a call); ``None`` where only those walks will do (a structure
        :meth:`_read` leaves to ``functional_call``, a tensor set to ``None`` since). A tensor
        registered under a second name since (a tie) is given under both, as the module now
        uses it under both: its gradient is the sum, as in plain PyTorch. ``serial``: as
        for :meth:`structure`."""
        if self.structure(serial) is None:
            return None
        values = self._slot_values()
        if values is None or any(map(is_, values, repeat(None))):
            return None
        names, n = self._order[0], self._n_params
        return dict(zip(names[:n], values[:n])), dict(zip(names[n:], values[n:]))

    def _slot_values(self) -> list | None:
        """The tensor in every slot, or ``None`` where a slot's name is no longer in its table
        (the structure is read again at the next call)."""
        _, tables, keys = self._order
        try:
            return list(map(getitem, tables, keys))
        except KeyError:
            self._read_once = False
            return None

    def _current(self) -> bool:
        """Whether the module still has the structure :meth:`_read` read: each submodule where
        it was, each module's tables the same dicts, holding as many names. Checked with
        ``map`` over columns, so the loop runs in C: a model of 800 tensors is checked at every
        call of every micro-batch, and a Python loop over its modules cost 0.5 ms a call (and
        comparing each table's names, 0.4 ms). A name replaced by another in the same table
        keeps the count: its slot's key is then missing, which :meth:`_slot_values` sees. A
        name registered as ``None`` (``bias=False``) keeps it too when it gets a tensor: those
        are checked to be ``None`` still."""
        if not self._read_once:
            return False
        placed = map(dict.get, self._parents, self._child_names)
        return (all(map(is_, placed, self._children))
                and all(map(is_, map(getattr, self._owners, repeat("_parameters")),
                            self._params))
                and all(map(is_, map(getattr, self._owners, repeat("_buffers")), self._buffers))
                and list(map(len, chain(self._params, self._buffers))) == self._sizes
                and all(map(is_, map(getitem, *self._empty), repeat(None))))

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
        self._sizes = list(map(len, chain(self._params, self._buffers)))
        empty = [(table, key) for table in chain(self._params, self._buffers)
                 for key, value in table.items() if value is None]
        self._empty = tuple(zip(*empty)) if empty else ((), ())
        self._read_once = True
        self.reads += 1
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
        if slots is not None:  # the slots as columns: each name, its table, its key there
            params = {id(table) for table in self._params}
            ordered = sorted(slots.items(), key=lambda slot: id(slot[1][0]) not in params)
            self._order = (tuple(name for name, _ in ordered),
                           tuple(table for _, (table, _) in ordered),
                           tuple(key for _, (_, key) in ordered))
            self._n_params = n = sum(id(table) in params for table in self._order[1])
            self._param_slots = (self._order[1][:n], self._order[2][:n])
        return slots
