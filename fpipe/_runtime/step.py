"""What one step's actions share: the :class:`Step`, its gradient sums, its results, and the
:class:`Channel` through which a worker reaches the others."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fpipe._runtime.adapters import MicroBatch
from fpipe._runtime.split_backward import SplitVJP
from fpipe._runtime.thread_state import ThreadState
from fpipe._runtime.values import Value
from fpipe._runtime.workers import Inbox
from fpipe.timeline import StepClock

__all__ = ["Step", "GradSums", "TrainResult", "Channel"]


class TrainResult:
    """Loss parts per micro-batch (already weighted), flat gradient leaves per stage, and each
    stage's state after the step (``None`` for stateless stages)."""

    __slots__ = ("losses", "grads", "state")

    def __init__(self, losses: list, grads: list, state: list) -> None:
        self.losses = losses
        self.grads = grads
        self.state = state


class Step:
    """Everything one step's actions share on one process; dropped when the step ends.

    ``on_abort`` is called once a step has failed, to wake whoever waits for a value (the local
    driver's inboxes, the distributed driver's peers)."""

    def __init__(self, params: list, state: list, inputs: list | None, targets: list | None,
                 weights: list, sizes: list, seed: int, training: bool,
                 on_abort: Callable[[], None], open_ended: bool = False,
                 clock: StepClock | None = None, seeded: bool = False,
                 context: ThreadState | None = None) -> None:
        self.params = params
        self.state = list(state)
        self.inputs = inputs
        # What each micro-batch's stage calls know of it (size, target, loss weight).
        self.batch = [MicroBatch(size, None if targets is None else targets[m], weights[m])
                      for m, size in enumerate(sizes)]
        self.seed = seed
        # Every stage call seeded (see fpipe._runtime.rng): a step run again after UnseededDraws.
        self.seeded = seeded
        self.training = training
        # The caller's thread-local state, applied by every worker (None: run as the thread is).
        self.context = context
        # An open-ended training step has no loss: the caller gives the cotangents of the last
        # stage's outputs and takes the gradients of the first stage's inputs (module face).
        self.open_ended = open_ended
        self.output_cotangents: list | None = None
        self.input_grads: list = [None] * len(sizes)
        # Per (stage, micro-batch): what a recompute needs, and the vjp with its input counts.
        self.saved: dict[tuple[int, int], tuple] = {}
        self.vjps: dict[tuple[int, int], tuple[Callable, tuple[int, ...]]] = {}
        # Per (stage, micro-batch) between its I and its W: the backward's second half.
        self.pending_weights: dict[tuple[int, int], SplitVJP] = {}
        self.grads = GradSums(len(params))
        self.outputs: list = [None] * len(sizes)
        self.error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._on_abort = on_abort
        self.inboxes: list[Inbox] = []  # the local driver's, kept for a step run in two calls
        self.clock = clock  # marks when each action runs, for a Recorder

    def fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self.error is None:
                self.error = error
        self._on_abort()

    def abort(self) -> None:
        self._on_abort()


class GradSums:
    """Per stage, the sum over micro-batches of its parameters' gradients (flat leaves)."""

    __slots__ = ("totals", "owned")

    def __init__(self, n_stages: int) -> None:
        self.totals: list = [None] * n_stages
        self.owned: set[int] = set()  # stages whose totals are fpipe's own tensors

    def add(self, stage: int, grads: list, dtype: torch.dtype | None = None) -> None:
        """Add one micro-batch's gradients. Called inside the device's compute scope: the sums
        read the vjp's outputs there. With ``dtype`` (float32 for bfloat16 parameters), each
        micro-batch's gradient is cast before it is added, so the sum does not round at the
        parameters' precision."""
        if dtype is not None:
            grads = [grad.to(dtype) for grad in grads]
        # A vjp may return views, broadcast (stride-0) tensors, or the very cotangent it was
        # given: the first sum is out of place, so later ones may add in place.
        total = self.totals[stage]
        if total is None:
            self.totals[stage] = list(grads)
        elif stage not in self.owned:
            self.totals[stage] = [acc + grad for acc, grad in zip(total, grads)]
            self.owned.add(stage)
        else:
            for acc, grad in zip(total, grads):
                acc.add_(grad)

    def out(self) -> list:
        """Per stage, its summed leaves (``None`` for a stage without a backward here), never
        aliasing a vjp's own output."""
        return [total if stage in self.owned or total is None else [g.clone() for g in total]
                for stage, total in enumerate(self.totals)]


class Channel(Protocol):
    """How one worker's values reach the workers of other stages, and how it waits for theirs.

    Keys are ``("x", stage, microbatch)`` for a stage's input, ``("g", stage, microbatch)`` for
    the cotangent of its output, ``("s", name, microbatch)`` for a skip's value and
    ``("t", name, microbatch)`` for its cotangent; ``stage`` in :meth:`send` is the stage the
    value goes to. Waiting raises :class:`Aborted` once the step has failed.
    """

    def receive(self, key: tuple, device: torch.device) -> Any: ...

    def send(self, leaves: list, src: torch.device, stage: int, key: tuple,
             like: Value | None) -> None: ...
