"""A module run on other tensors than its own: what ``torch.func.functional_call`` does, with
the walk of the module done once instead of at every call.

``functional_call`` finds, at each call, every submodule and every name of every parameter and
buffer (to tie names that share a tensor and to check the keys), then swaps each tensor in
through a path lookup. For a partition of a few hundred tensors that walk cost more than its
arithmetic: torchgpipe's AmoebaNet-D benchmark model (831 parameter tensors) ran 1.1-1.4x
slower on ``fpipe.GPipe`` than on torchgpipe at one thread. :class:`Slots` records once where
each tensor lives (the ``_parameters`` or ``_buffers`` dict of its submodule, under each of its
names), and a call sets those entries and puts the originals back, as ``functional_call``'s
swap does. A tensor's new value read back from its slot after the call (a module that assigns
a buffer instead of updating it in place) is written into the caller's dict, as there.

The module's structure is read at the first call: submodules replaced later are not seen, so
make a new stage for a changed module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["Slots"]


class Slots:
    """Where each of ``module``'s tensors lives, by its name in ``named_parameters()`` /
    ``named_buffers()`` (the first of a shared tensor's names): ``(dict, key)`` of each of the
    tensor's names."""

    __slots__ = ("module", "slots", "keys")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots: dict[str, list[tuple[dict, str]]] = {}
        first: dict[int, str] = {}
        for kind in ("_parameters", "_buffers"):
            for prefix, sub in module.named_modules(remove_duplicate=False):
                for name, tensor in getattr(sub, kind).items():
                    if tensor is None:
                        continue
                    full = f"{prefix}.{name}" if prefix else name
                    canonical = first.setdefault(id(tensor), full)
                    self.slots.setdefault(canonical, []).append((getattr(sub, kind), name))
        self.keys = self.slots.keys()

    def call(self, tensors: dict[str, torch.Tensor], args: tuple) -> Any:
        """``module(*args)`` with ``tensors`` in place of its own (every name, strictly)."""
        if tensors.keys() != self.keys:  # torch's own check, and its error
            return functional_call(self.module, tensors, args, strict=True)
        originals = []
        try:
            for name, slots in self.slots.items():
                value = tensors[name]
                for holder, key in slots:
                    originals.append((holder, key, holder[key]))
                    holder[key] = value
            return self.module(*args)
        finally:
            for name, slots in self.slots.items():
                holder, key = slots[0]
                if holder[key] is not tensors[name]:
                    tensors[name] = holder[key]
            for holder, key, original in reversed(originals):
                holder[key] = original
