"""Skip connections declared on ``nn.Module`` classes, as torchgpipe declares them.

A class decorated ``@skippable(stash=["1to3"])`` whose ``forward`` does ``yield stash("1to3", x)``
hands ``x`` to the layer of a class decorated ``@skippable(pop=["1to3"])``, whose ``forward``
gets it back with ``skip = yield pop("1to3")``. Run as a plain module, the values pass through
a per-thread tracker, so the model works unpipelined. Cut into stages (``from_sequential``,
``fpipe.GPipe``), a skip stashed and popped in one stage stays inside it, and one that crosses
stages becomes a skip of fpipe's routing (see :mod:`fpipe.stages.skip`): the stage that stashes
it returns it beside its output, and it goes straight to the stage that pops it. Skips of the
same name are told apart by :class:`Namespace` (``layer.isolate(ns)``).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from functools import total_ordering
from typing import Any, ClassVar

import optree
import torch
from torch import nn

from fpipe.stages.skip import Skippable, _names

__all__ = ["Namespace", "stash", "pop", "SkippableModule", "skippable_module",
           "verify_skippables", "route_module_skips"]

Key = tuple[Any, str]  # (namespace or None, name)


@total_ordering
class Namespace:
    """Isolates skips of the same name from each other: ``layer.isolate(Namespace())``."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __lt__(self, other: object) -> bool:
        return isinstance(other, Namespace) and self.id < other.id


class stash:  # noqa: N801 - torchgpipe's name for the command
    """``yield stash(name, tensor)`` in a skippable module's ``forward``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Any) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801 - torchgpipe's name for the command
    """``tensor = yield pop(name)`` in a skippable module's ``forward``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Tracker:
    """Stashed values by key, waiting for their pop."""

    def __init__(self, values: dict[Key, Any] | None = None) -> None:
        self.values = dict(values or {})


_local = threading.local()


def _current() -> _Tracker:
    tracker = getattr(_local, "tracker", None)
    if tracker is None:  # a plain module run: one tracker per thread, as in torchgpipe
        tracker = _local.tracker = _Tracker()
    return tracker


@contextlib.contextmanager
def tracking(values: dict[Key, Any]) -> Iterator[_Tracker]:
    """A fresh tracker holding ``values`` for the calls inside (one stage call)."""
    outer = getattr(_local, "tracker", None)
    _local.tracker = tracker = _Tracker(values)
    try:
        yield tracker
    finally:
        _local.tracker = outer


class SkippableModule(nn.Module):
    """What ``@skippable(stash=..., pop=...)`` makes of an ``nn.Module`` class: the original
    module (as ``.module``, so parameter names read as torchgpipe's) and the skips it declares.
    """

    module_cls: ClassVar[type]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> Key:
        return (self.namespaces.get(name), name)

    def stashable(self) -> Iterator[Key]:
        return (self.namespaced(name) for name in sorted(self.stashable_names))

    def poppable(self) -> Iterator[Key]:
        return (self.namespaced(name) for name in sorted(self.poppable_names))

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> SkippableModule:
        """Put this module's skips (or only those named) in ``ns``; returns the module."""
        names = self.stashable_names | self.poppable_names if only is None else set(only)
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, input: Any) -> Any:
        tracker = _current()
        poppable: dict[str, Any] = {}
        for key in self.poppable():
            if key not in tracker.values:
                raise RuntimeError(f"'{key[1]}' has not been stashed")
            poppable[key[1]] = tracker.values.pop(key)
        stashed: dict[str, Any] = {}
        output = self._dispatch(input, stashed, poppable)
        missing = sorted(self.stashable_names - stashed.keys())
        if missing:
            raise RuntimeError(f"{', '.join(map(repr, missing))} must be stashed but have not")
        if poppable:
            raise RuntimeError(f"{', '.join(map(repr, sorted(poppable)))} must be popped but "
                               f"have not")
        for key in self.stashable():
            tracker.values[key] = stashed[key[1]]
        return output

    def _dispatch(self, input: Any, stashed: dict[str, Any], poppable: dict[str, Any]) -> Any:
        """Run the module's forward, serving its ``stash`` and ``pop`` commands."""
        generator = self.module(input)
        if not isinstance(generator, Generator):
            return generator  # a forward without yield
        try:
            command = next(generator)
            while True:
                if isinstance(command, stash):
                    if command.name not in self.stashable_names:
                        raise RuntimeError(f"'{command.name}' has not been declared as stashable")
                    stashed[command.name] = command.tensor
                    command = next(generator)
                elif isinstance(command, pop):
                    if command.name not in self.poppable_names:
                        raise RuntimeError(f"'{command.name}' has not been declared as poppable")
                    if command.name not in poppable:
                        raise RuntimeError(f"'{command.name}' was popped twice")
                    command = generator.send(poppable.pop(command.name))
                else:
                    raise TypeError(f"{command!r} is not a command from @skippable: yield "
                                    f"stash(name, tensor) or pop(name)")
        except StopIteration as stop:
            return stop.value


def skippable_module(module_cls: type, stash: Iterable[str] = (),
                     pop: Iterable[str] = ()) -> type[SkippableModule]:
    """``module_cls`` made a :class:`SkippableModule` that stashes and pops the names given."""
    stash_names, pop_names = frozenset(_names("stash", stash)), frozenset(_names("pop", pop))
    return type(module_cls.__name__, (SkippableModule,),
                {"module_cls": module_cls, "stashable_names": stash_names,
                 "poppable_names": pop_names, "__module__": module_cls.__module__,
                 "__qualname__": module_cls.__qualname__, "__doc__": module_cls.__doc__})


def verify_skippables(module: nn.Sequential) -> None:
    """Every skip among ``module``'s layers is stashed by exactly one layer and popped by
    exactly one later layer (skips of the same name in different namespaces are different
    skips); else a ``TypeError`` listing every problem."""
    stashed: set[Key] = set()
    popped: set[Key] = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, SkippableModule):
            continue
        both = layer.stashable_names & layer.poppable_names
        problems += [f"'{layer_name}' declared '{name}' both as stashable and as poppable"
                     for name in sorted(both)]
        for key in layer.stashable():
            if key[1] in both:
                continue
            if key in stashed:
                problems.append(f"'{layer_name}' stashes '{key[1]}' again: isolate the two "
                                f"with different namespaces (layer.isolate(Namespace()))")
            stashed.add(key)
        for key in layer.poppable():
            if key[1] in both:
                continue
            if key in popped:
                problems.append(f"'{layer_name}' pops '{key[1]}' again: isolate the two with "
                                f"different namespaces (layer.isolate(Namespace()))")
            elif key not in stashed:
                problems.append(f"'{layer_name}' pops '{key[1]}', which no earlier layer "
                                f"stashes")
            popped.add(key)
    problems += [f"'{key[1]}' is stashed but no later layer pops it"
                 for key in sorted(stashed - popped, key=_order)]
    if problems:
        raise TypeError("the skips of this module do not pair up, each stashed once and "
                        "popped once by a later layer:\n" +
                        "\n".join(f"* {problem}" for problem in problems))


def _order(key: Key) -> tuple[str, str]:
    return (key[1], "" if key[0] is None else str(key[0].id))


def route_module_skips(stages: Sequence[Callable], modules: Sequence[nn.Module],
                       stateful: bool) -> list[Callable]:
    """``stages`` (one per module of ``modules``, in order), each made a fpipe skip stage
    (:class:`~fpipe.stages.skip.Skippable`) for the skips of its module's skippable layers that
    cross from one stage to another; a stage without such skips is returned as it is."""
    stashed_at: dict[Key, int] = {}
    crossing: list[tuple[dict[str, Key], dict[str, Key]]] = [({}, {}) for _ in stages]
    for j, module in enumerate(modules):
        layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
        for layer in layers:
            if not isinstance(layer, SkippableModule):
                continue
            for key in layer.poppable():
                i = stashed_at.pop(key, j)
                if i != j:  # popped where it was not stashed: fpipe carries it
                    name = _route_name(key)
                    crossing[i][0][name] = key
                    crossing[j][1][name] = key
            for key in layer.stashable():
                stashed_at[key] = j
    return [Skippable(_Routed(stage, stateful, out, into), stash=out, pop=into)
            if out or into else stage for stage, (out, into) in zip(stages, crossing)]


def _route_name(key: Key) -> str:
    ns, name = key
    return name if ns is None else f"{name} (namespace {str(ns.id)[:8]})"


class _Routed:
    """A module stage whose skippable layers stash for, or pop from, other stages: popped values
    come in as the stage's last argument and go to the layers through a tracker, and stashed
    ones come back beside the output."""

    def __init__(self, stage: Callable, stateful: bool, stashes: dict[str, Key],
                 pops: dict[str, Key]) -> None:
        self.stage, self.stateful, self.stashes, self.pops = stage, stateful, stashes, pops

    def __call__(self, params: Any, *args: Any) -> Any:
        popped: dict[str, Any] = {}
        if self.pops:
            *args, popped = args  # type: ignore[assignment]
        with tracking({key: _unwrap(popped[name]) for name, key in self.pops.items()}) as tracker:
            out = self.stage(params, *args)
        if not self.stashes:
            return out
        y = out[0] if self.stateful else out
        stashed = {name: _wrap(tracker.values.pop(key), y) for name, key in self.stashes.items()}
        return ((y, stashed), out[1]) if self.stateful else (y, stashed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.stage!r})"


_NONE = "fpipe: a stashed None"


def _wrap(value: Any, y: Any) -> Any:
    """A stashed ``None`` (torchgpipe allows it) as what fpipe routes: an empty tensor with the
    output's micro-batch size, on its device."""
    if value is not None:
        return value
    like = next((t for t in optree.tree_leaves(y) if isinstance(t, torch.Tensor) and t.dim()),
                None)
    return value if like is None else {_NONE: like.new_empty((like.shape[0], 0))}


def _unwrap(value: Any) -> Any:
    return None if isinstance(value, dict) and list(value) == [_NONE] else value
