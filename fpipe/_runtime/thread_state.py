"""The caller's thread-local state, carried into every worker.

Torch keeps autocast, inference mode and dispatch modes per thread, but a step's stages run on
worker threads. So a step captures what the caller's thread has when the step starts and every
worker applies it around all of its actions (forwards, recomputes and backwards), as if the
step ran in the caller's thread: ``with torch.autocast("cuda"): pipe.value_and_grad(x, t)`` casts
in every stage. The second half of a step run in two calls (``Pipeline.vjp``, the ``fpipe.GPipe``
backward) uses the state its forwards saw, as ``torch.utils.checkpoint`` recomputes under the
forward's autocast state.

Carried, like ``torch.nn.parallel.parallel_apply`` and the autograd engine's device threads
do: autocast per device type (enabled, dtype) and its cache flag; inference mode for forward-only
steps; and the CUDA stream sanitizer's mode (``TORCH_CUDA_SANITIZER=1`` installs it in the
importing thread only), so that worker kernels are checked too. Grad mode is the step's own:
training steps differentiate whatever the caller's grad mode (as ``torch.func.grad`` does),
forward-only steps keep nothing for a backward.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ThreadState"]

_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_of(device_type: str) -> tuple[bool, torch.dtype]:
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == "cpu":
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    if device_type == "cuda":
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return False, torch.float32


def _sanitizer_mode() -> Any:
    """The CUDA sanitizer's dispatch mode when it is on (only if its module was imported)."""
    module = sys.modules.get("torch.cuda._sanitizer")
    sanitizer = getattr(module, "cuda_sanitizer", None)
    return sanitizer.dispatch if sanitizer is not None and sanitizer.enabled else None


@dataclass(frozen=True)
class ThreadState:
    """What a worker must apply to run as the caller's thread would."""

    autocast: tuple[tuple[str, torch.dtype], ...] = ()  # device types with autocast on
    autocast_cache: bool = True
    inference_mode: bool = False
    sanitizer: Any = None

    @classmethod
    def capture(cls, devices: list[torch.device] = ()) -> ThreadState:
        """The calling thread's state, for autocast on the CPU, CUDA and ``devices``' types."""
        types = dict.fromkeys((*_DEVICE_TYPES, *(d.type for d in devices)))
        autocast = []
        for device_type in types:
            try:
                enabled, dtype = _autocast_of(device_type)
            except RuntimeError:  # a device type autocast does not know
                continue
            if enabled:
                autocast.append((device_type, dtype))
        return cls(tuple(autocast), torch.is_autocast_cache_enabled(),
                   torch.is_inference_mode_enabled(), _sanitizer_mode())

    @property
    def plain(self) -> bool:
        """Whether applying it changes nothing (then a worker skips the work)."""
        return not self.autocast and not self.inference_mode and self.sanitizer is None

    def applied(self, training: bool) -> contextlib.ExitStack:
        """A context that gives the current thread this state (inference mode only for a
        forward-only step: a training step cannot run under it)."""
        stack = contextlib.ExitStack()
        if self.sanitizer is not None and not _on_this_thread(self.sanitizer):
            stack.enter_context(_pushed(self.sanitizer))
        if self.inference_mode and not training:
            stack.enter_context(torch.inference_mode())
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                               cache_enabled=self.autocast_cache))
        return stack


def _on_this_thread(mode: Any) -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(m is mode for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def _pushed(mode: Any):
    """``mode`` on this thread's dispatch mode stack (pushed directly: one mode object entered
    on several threads must not share its enter/exit bookkeeping)."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()
