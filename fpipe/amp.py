"""Mixed precision for pipelines: autocast in stages, low-precision parameters with float32
master weights, and loss scaling for float16.

Stages run in worker threads, and ``torch.autocast`` is thread-local: an autocast block
around ``pipe.value_and_grad`` does not reach the stages. :func:`autocast` wraps a stage so it
runs under autocast wherever it runs.

For parameters kept in ``bfloat16``, train float32 master copies (:func:`cast`) and build the
pipeline with ``grad_dtype=torch.float32``, so that gradients are summed over micro-batches in
float32 and match the masters' dtype.

``float16`` gradients overflow easily. With a ``torch.optim`` optimiser, use PyTorch's own
``torch.amp.GradScaler`` unchanged: ``loss_fn=lambda y, t: scaler.scale(loss(y, t))``, then
``fpipe.optim.bind_grads(params, grads)``, ``scaler.step(optimizer)``, ``scaler.update()``
(its ``state_dict`` saves and restores it as usual). :class:`LossScaler` is the same policy
for what ``GradScaler`` cannot serve: functional updates (``fpipe.optim.sgd``, any update of
parameter pytrees without a ``torch.optim`` optimiser), since ``GradScaler`` unscales and
checks only through an optimiser's parameters' ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fpipe.stages.skip import Skippable

__all__ = ["autocast", "Autocast", "cast", "LossScaler"]


class Autocast:
    """A stage run under ``torch.autocast``; see :func:`autocast`. It names the stage it wraps
    in ``__wrapped__``, so fpipe sees a compiled stage inside (and differentiates it so that
    it runs compiled)."""

    def __init__(self, stage: Callable, device_type: str | None, dtype: torch.dtype) -> None:
        self.stage = self.__wrapped__ = stage
        self.device_type = device_type
        self.dtype = dtype

    def __call__(self, *args: Any) -> Any:
        device_type = self.device_type or _device_type(args)
        with torch.autocast(device_type, dtype=self.dtype):
            return self.stage(*args)

    def __repr__(self) -> str:
        return f"autocast({self.stage!r}, {self.device_type!r}, {self.dtype})"


def _device_type(args: tuple) -> str:
    """The device type of a stage call: its first tensor's (parameters first, then input)."""
    for leaf in optree.tree_leaves(args, none_is_leaf=False):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


def autocast(stage: Callable, device_type: str | None = None,
             dtype: torch.dtype = torch.bfloat16) -> Callable:
    """``stage`` run under ``torch.autocast(device_type, dtype=dtype)``, where the stage runs
    (in whichever worker thread). ``device_type`` is by default that of the stage's tensors
    (its parameters, or for a stage without parameters its input), so the same wrapper casts
    on a CUDA stage and on a CPU one. A ``skippable`` stage keeps its skips; a compiled stage
    stays compiled, whichever wraps which: ``autocast(torch.compile(stage))`` and
    ``torch.compile(autocast(stage))`` both run compiled graphs."""
    if isinstance(stage, Skippable):
        return Skippable(Autocast(stage.fn, device_type, dtype), stage.stash, stage.pop)
    return Autocast(stage, device_type, dtype)


def cast(tree: Any, dtype: torch.dtype) -> Any:
    """A copy of ``tree`` with floating-point tensor leaves in ``dtype`` (others unchanged):
    ``master = cast(params, torch.float32)``, then ``params = cast(master, torch.bfloat16)``
    after each optimiser step."""
    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().to(dtype, copy=True)
        return leaf
    return optree.tree_map(one, tree)


class LossScaler:
    """Dynamic loss scaling across a pipeline's stages, for functional updates (with a
    ``torch.optim`` optimiser, ``torch.amp.GradScaler`` does the same; see the module)::

        scaler = LossScaler()
        pipe = fpipe.pipeline(stages, params, schedule=..., loss_fn=scaler.scaled(loss_fn),
                              nonfinite="ignore")       # overflows are the scaler's to handle
        loss, grads = pipe.value_and_grad(x, target)    # loss and grads are scaled
        grads, finite = scaler.unscale(grads)
        if finite:
            ...                                         # the optimiser step
        scaler.update(finite)                           # skipped steps lower the scale

    A step whose gradients hold an inf or NaN is skipped and the scale multiplied by
    ``backoff_factor``; after ``growth_interval`` finite steps in a row it is multiplied by
    ``growth_factor``.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval >= 1):
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             "and growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.finite_steps = 0

    def scaled(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` times the current scale (read at each call, so one pipeline serves
        every step)."""
        def scaled_loss(y: Any, target: Any) -> torch.Tensor:
            return loss_fn(y, target) * self.scale
        return scaled_loss

    def unscale(self, grads: Any) -> tuple[Any, bool]:
        """``(grads / scale, finite)``: ``finite`` is whether every gradient of every stage is
        free of inf and NaN, checked on each leaf's device (one flag per device is read)."""
        inverse = 1.0 / self.scale
        flags: dict[torch.device, list[torch.Tensor]] = {}
        unscaled = []
        for leaf in optree.tree_leaves(grads):
            grad = leaf * inverse
            flags.setdefault(grad.device, []).append(torch.isfinite(grad).all())
            unscaled.append(grad)
        finite = all(bool(torch.stack(found).all()) for found in flags.values())
        return optree.tree_unflatten(optree.tree_structure(grads), unscaled), finite

    def update(self, finite: bool) -> None:
        """Lower the scale after a skipped step; raise it after enough finite ones."""
        if not finite:
            self.scale *= self.backoff_factor
            self.finite_steps = 0
            return
        self.finite_steps += 1
        if self.finite_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.finite_steps = 0
