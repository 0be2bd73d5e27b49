"""Which of a module stage's buffers a call may leave uncopied: normalisation layers' running
statistics.

A stateful module stage copies its buffers before each call, so that a write lands on the copy
and the state it was given stays as it was (the caller's, or the one a recompute will start
from). A model of many BatchNorms spent most of its per-call host time on those copies
(``benchmarks/amoeba.py``: 315 buffers a call, a call of each micro-batch). Torch's own
normalisation layers use their running statistics in a way that makes most copies needless:

- in training, the forward normalises by the batch's statistics and *writes* the running ones
  (in place, without reading them for the output);
- in evaluation, it *reads* them and writes nothing.

So, for a layer whose forward is torch's own and runs no hook:

- a layer in evaluation never needs a copy: nothing writes its statistics;
- a layer in training needs none where the state is the step's own (not the caller's): the
  micro-batches update one set of statistics in turn, as a plain module's forwards do;
- a recompute of a layer in training runs on scratch statistics, which it writes and nobody
  reads: its output does not depend on them, and the step's own have moved on since its
  forward (they must not be counted twice).

A layer of another class (a subclass with its own forward, ``DeferredBatchNorm``), one with a
forward hook (which could read the statistics), or any layer while a global forward hook is
registered keeps the copies. Hooks and classes are looked at once per run of the runtime
(:func:`fpipe.recompute.run_serial`: in between only stage calls run) and at every call made
outside one; a stage reads its layers again whenever its swap reads the module's structure
again (a layer replaced, under the same names, between calls).
"""

from __future__ import annotations

import threading
from operator import is_, itemgetter

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

__all__: list[str] = []

# Forwards known to read running statistics only in evaluation and write them only in training.
_KNOWN = frozenset({_BatchNorm.forward, _InstanceNorm.forward, nn.SyncBatchNorm.forward})


class RunningStats:
    """The running statistics of ``module``'s normalisation layers of known forward, by the
    buffer names a stage's state uses (``"3.1.running_mean"``)."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = tuple(
            (m, tuple(f"{prefix}.{name}" if prefix else name
                      for name, b in m._buffers.items() if b is not None))
            for prefix, m in module.named_modules(remove_duplicate=False)
            if type(m).forward in _KNOWN)
        self._names = tuple(name for _, names in self.layers for name in names)
        self._all = frozenset(self._names)
        self._scratch = threading.local()
        self._plain_in: tuple = (None, ())  # (the run serial, _plain's layers in it)

    def uncopied(self, owned: bool, serial: int | None = None) -> frozenset[str] | set[str]:
        """The names a forward may pass uncopied: every layer's where the state is the step's
        own (``owned``), else those of layers in evaluation. ``serial``: the runtime's run
        the call is in, if any (the layers' hooks are looked at once in it)."""
        plain = self._plain(serial)
        if owned and len(plain) == len(self.layers):  # (every layer's: the usual case)
            return self._all
        return {name for m, names in plain if owned or not m.training for name in names}

    def for_recompute(self, state: dict[str, torch.Tensor],
                      serial: int | None = None) -> tuple[set[str], dict]:
        """``(uncopied, scratch)`` for a recompute from ``state``: layers in evaluation read
        their statistics as they are; layers in training get scratch tensors (kept per
        thread, reused from call to call)."""
        uncopied: set[str] = set()
        kept = self._scratch.__dict__
        plain = self._plain(serial)
        if len(plain) == len(self.layers) and all(m.training for m, _ in plain):
            # (the usual case, every layer plain and in training, each name's scratch made
            # for this very tensor: looked up with loops in C, hundreds a call)
            entries = list(map(kept.get, self._names))
            if None not in entries and all(map(is_, map(itemgetter(0), entries),
                                               map(state.get, self._names))):
                return uncopied, dict(zip(self._names, map(itemgetter(1), entries)))
        scratch: dict[str, torch.Tensor] = {}
        for m, names in plain:
            if not m.training:
                uncopied.update(names)
                continue
            for name in names:
                given = state.get(name)
                if given is None:
                    continue
                entry = kept.get(name)  # (the tensor it was made for, the scratch)
                if entry is None or entry[0] is not given:
                    held = entry[1] if entry is not None and _alike(entry[1], given) \
                        else torch.zeros_like(given)
                    entry = kept[name] = (given, held)
                scratch[name] = entry[1]
        return uncopied, scratch

    def _plain(self, serial: int | None) -> tuple:
        """The layers running no hook (none at all while a global forward hook is set), looked
        at once per run ``serial``."""
        if serial is not None and self._plain_in[0] == serial:
            return self._plain_in[1]
        if _module._global_forward_hooks or _module._global_forward_pre_hooks:
            plain: tuple = ()
        else:
            plain = tuple(
                (m, names) for m, names in self.layers
                if type(m).forward in _KNOWN  # (not since made a subclass in place)
                and not (m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__))
        self._plain_in = (serial, plain)
        return plain


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
