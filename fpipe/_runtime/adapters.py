"""User stages, normalised into the one form the runtime knows.

The runtime calls every stage as a *core*::

    core(params, state, inputs, mb) -> (outputs, new_state)

``inputs`` is ``(x, *popped skips)`` and ``outputs`` is ``(y, *stashed skips)``, tuples of
pytrees; ``mb`` is the call's :class:`MicroBatch`. What users write (a plain
``stage(params, x)``, a stateful ``stage(params, state, x) -> (y, state)``, a ``skippable``
stage, a compiled one, the loss on the last stage of a training step) becomes a core through
the small adapters below, composed from outside when the pipeline is built. So the
interpreter, the autodiff and the handlers know no flavour of stage: a new one is a new
adapter, not a flag threaded through every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpipe._runtime.compiled import batch_dynamic, is_compiled
from fpipe._runtime.notes import summary
from fpipe._runtime.values import check_output, differentiable, flatten
from fpipe.errors import StageError

__all__ = ["MicroBatch", "Core", "user_core", "dynamic_batch", "with_loss", "core_of",
           "in_loss"]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """What one call knows of its micro-batch: its ``size`` (which every output keeps on
    dim 0; ``None``: not checked), its ``target`` and its ``weight``, the micro-batch's share
    of the batch, by which its loss is scaled so that the sum over micro-batches is the mean
    over the batch."""

    size: int | None
    target: Any = None
    weight: float = 1.0


Core = Callable[[Any, Any, tuple, MicroBatch], tuple[tuple, Any]]


def core_of(fn: Callable, stateful: bool, loss_fn: Callable | None = None,
            pops: tuple[str, ...] = (), stashes: tuple[str, ...] = ()) -> Core:
    """``fn`` as a core: its calling convention and the skips it pops and stashes, the
    compiled-stage adapter when ``torch.compile`` made it, and ``loss_fn`` on top when given (the
    last stage of a training step)."""
    core = user_core(fn, stateful, pops, stashes)
    if is_compiled(fn):
        core = dynamic_batch(core)
    return core if loss_fn is None else with_loss(core, loss_fn)


def user_core(fn: Callable, stateful: bool, pops: tuple[str, ...] = (),
              stashes: tuple[str, ...] = ()) -> Core:
    """A stage as users write it: ``fn(params, x)``, or ``fn(params, state, x) -> (y, state)``
    when ``stateful``; a stage that pops skips takes them as a last argument, a dict by name,
    and one that stashes returns ``(y, {name: value})`` (inside the state pair)."""
    def core(params: Any, state: Any, inputs: tuple, mb: MicroBatch) -> tuple[tuple, Any]:
        args = (params, state, inputs[0]) if stateful else (params, inputs[0])
        if pops:
            args += (dict(zip(pops, inputs[1:])),)
        result, new_state = fn(*args), None
        if stateful:
            result, new_state = _pair(result, "a stateful stage must return (y, new_state)")
        if not stashes:
            return (result,), new_state
        y, stash = _pair(result, "a stage that stashes skips must return (y, {name: value})")
        if not isinstance(stash, dict) or set(stash) != set(stashes):
            got = sorted(stash) if isinstance(stash, dict) else type(stash).__name__
            raise StageError(f"the stage must stash exactly {list(stashes)}, got {got}")
        return (y, *(stash[name] for name in stashes)), new_state
    return core


def dynamic_batch(core: Core) -> Core:
    """A compiled stage's core: dim 0 of its inputs marked dynamic before each call, so one
    graph serves every micro-batch size (see :mod:`fpipe._runtime.compiled`)."""
    def dynamic(params: Any, state: Any, inputs: tuple, mb: MicroBatch) -> tuple[tuple, Any]:
        return core(params, state, batch_dynamic(inputs), mb)
    return dynamic


def with_loss(core: Core, loss_fn: Callable) -> Core:
    """The last stage of a training step: its one output becomes the micro-batch's loss,
    ``loss_fn(y, target)`` scaled by the micro-batch's weight, a scalar."""
    def lossy(params: Any, state: Any, inputs: tuple, mb: MicroBatch) -> tuple[tuple, Any]:
        (y, *_), new_state = core(params, state, inputs, mb)
        if mb.size is not None:  # the last stage keeps the micro-batch too
            check_output(flatten(y), mb.size, "output")
        return (_loss(loss_fn, y, mb.target) * mb.weight,), new_state
    return lossy


def _loss(loss_fn: Callable, y: Any, target: Any) -> torch.Tensor:
    try:
        loss = loss_fn(y, target)
    except Exception as exc:
        if target is None and hasattr(exc, "add_note"):
            exc.add_note("fpipe: no target was given: value_and_grad(x) passes target=None "
                         "to loss_fn; call value_and_grad(x, target)")
        in_loss(exc, y, target)
        raise
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise in_loss(StageError(f"loss_fn must return a scalar (0-dim) tensor, got {shape}"),
                      y, target)
    if not differentiable(loss):
        raise in_loss(StageError(f"loss_fn must return a floating-point tensor, got "
                                 f"{loss.dtype}"), y, target)
    return loss


def in_loss(exc: BaseException, y: Any, target: Any) -> BaseException:
    """``exc``, raised inside ``loss_fn`` (or by its result's checks), marked so: where it is
    located, it is said to be raised in the loss, not in the last stage's forward, with the
    arguments ``loss_fn`` was given. (An exception that takes no attributes stays unmarked.)"""
    given = f"loss_fn(y, target) was given y {summary(y)} and target {summary(target)}"
    try:
        exc.fpipe_loss = given  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    return exc


def _pair(result: Any, message: str) -> tuple[Any, Any]:
    if not isinstance(result, tuple) or len(result) != 2:
        raise StageError(f"{message}, got {type(result).__name__}")
    return result
