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
from fpipe._runtime.values import Value, placed, trainable
from fpipe._runtime.workers import Inbox
from fpipe.timeline import StepClock

__all__ = ["Step", "Donated", "Ends", "Vjp", "GradSums", "TrainResult", "Channel", "plus"]


class TrainResult:
    """Loss parts per micro-batch (already weighted), flat gradient leaves per stage, and each
    stage's state after the step (``None`` for stateless stages)."""

    __slots__ = ("losses", "grads", "state")

    def __init__(self, losses: list, grads: list, state: list) -> None:
        self.losses = losses
        self.grads = grads
        self.state = state


class Ends:
    """What a step does at its two ends, the one thing the kinds of step differ in: what it keeps
    of the last stage's output, where the last stage's backward takes its cotangent, and what
    becomes of the first stage's input gradients. ``calls`` names the stage calls it runs
    (:class:`~fpipe._runtime.interpreter.Interpreter`): with the loss on the last stage or
    not, with the first stage's input gradients or not."""

    calls = "inference"

    def output(self, outs: list[Value]) -> Any:
        return outs[0].tree()

    def seed(self, microbatch: int, output: Any) -> list:  # called in the compute scope
        raise AssertionError("a forward-only step has no backward")

    def input_grads(self, microbatch: int, grads: list) -> None:
        pass


class _Loss(Ends):
    """A training step: the micro-batch's (weighted) loss, seeded with 1."""

    calls = "training"

    def output(self, outs: list[Value]) -> Any:
        return outs[0].leaves[0]

    def seed(self, microbatch: int, output: Any) -> list:
        return [torch.ones_like(output)]


class Vjp(Ends):
    """A step run in two calls (``vjp``): the outputs are kept as they are, the caller gives
    their cotangents (:attr:`cotangents`, once the forwards have run) and takes the input's
    gradients (:attr:`grads`)."""

    calls = "vjp"

    def __init__(self, n_microbatches: int) -> None:
        self.cotangents: list | None = None
        self.grads: list = [None] * n_microbatches

    def output(self, outs: list[Value]) -> Any:
        return outs[0]

    def seed(self, microbatch: int, output: Any) -> list:
        return list(self.cotangents[microbatch])

    def input_grads(self, microbatch: int, grads: list) -> None:
        self.grads[microbatch] = list(grads)


INFERENCE, LOSS = Ends(), _Loss()


class Donated(dict):
    """A stage's state that its caller hands over to the step, as a plain module hands its
    buffers to its forward: the step may update it in place as it would a state it made
    (``fpipe.GPipe`` gives its partitions' buffers so)."""

    __slots__ = ()


class Step:
    """Everything one step's actions share on one process; dropped when the step ends.

    ``on_abort`` is called once a step has failed, to wake whoever waits for a value (the local
    driver's inboxes, the distributed driver's peers)."""

    def __init__(self, params: list, state: list, inputs: list | None, targets: list | None,
                 weights: list, sizes: list, seed: int, training: bool,
                 on_abort: Callable[[], None], ends: Ends | None = None,
                 clock: StepClock | None = None, seeded: bool = False,
                 context: ThreadState | None = None) -> None:
        self.params = params
        self.state = list(state)
        # The caller's state, per stage: a call given it may not update it in place (unless
        # the caller handed it over: Donated).
        self.given_state = [None if type(s) is Donated else s for s in state]
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
        # What the step does at its two ends (a loss, outputs, or a vjp's cotangents in).
        self.ends = ends if ends is not None else LOSS if training else INFERENCE
        # Per (stage, micro-batch): what a recompute needs, and the vjp with its input counts.
        self.saved: dict[tuple[int, int], tuple] = {}
        self.vjps: dict[tuple[int, int], tuple[Callable, tuple[int, ...]]] = {}
        # Per (stage, micro-batch) between its I and its W: the backward's second half.
        self.pending_weights: dict[tuple[int, int], SplitVJP] = {}
        # Per (stage, micro-batch): a paired backward's inputs, received before its forward.
        self.awaited: dict[tuple[int, int], list] = {}
        self.grads = GradSums(params)
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
    """Per stage, the sum over micro-batches of its trainable parameters' gradients.

    ``trainable[s]`` gives the indices of stage ``s``'s differentiated parameter leaves
    (``None``: all; see :func:`~fpipe._runtime.values.trainable`). Two ways in, and
    :meth:`out` gives their sum per stage as one entry per parameter leaf, ``None`` for a
    frozen leaf and for one no micro-batch's outputs depended on (an unused weight, which
    PyTorch too leaves without ``.grad``):

    - :meth:`leaves`: the step's own leaves for a stage's trainable parameters, which require
      grad; a backward through ``torch.autograd`` adds into their ``.grad`` inside the engine,
      as ``loss.backward()`` accumulates over micro-batches. Made per step (from that step's
      parameters), never kept across steps. Used where the sum is the same as :meth:`add`'s:
      no ``grad_dtype`` and a backward not split.
    - :meth:`add`: one micro-batch's gradients, as a vjp returned them (``None`` where a
      leaf was not used)."""

    __slots__ = ("params", "trainable", "totals", "owned", "made")

    def __init__(self, params: list) -> None:
        """``params``: per stage, its parameter leaves (``None`` for a stage not held here)."""
        self.params = params
        self.trainable = [None if leaves is None else trainable(leaves) for leaves in params]
        n_stages = len(params)
        self.totals: list = [None] * n_stages
        self.owned: list = [None] * n_stages  # per stage and leaf: whether fpipe made the sum
        self.made: list = [None] * n_stages  # per stage, the step's leaves (or None)

    def leaves(self, stage: int, params: list) -> list:
        """The step's leaves for ``stage``'s trainable parameters (of ``params``): detached,
        requiring grad. A training step's parameters are such leaves already where the
        caller's required grad (:func:`~fpipe._runtime.values.param_leaves`), made for the
        step and held by nothing else: those are taken as they are."""
        made = self.made[stage]
        if made is None:
            index = self.trainable[stage]
            if index is not None:
                params = [params[i] for i in index]
            made = self.made[stage] = [p if p.requires_grad else p.detach().requires_grad_()
                                       for p in params]
        return made

    def requiring(self, stage: int, params: list) -> list:
        """Every parameter leaf of ``stage`` as the step's vjps see it: the trainable ones the
        step's own leaves (:meth:`leaves`, requiring grad), the frozen ones as they are. What
        a forward without a graph runs on (see ``StageCall.forward``)."""
        return placed(params, self.trainable[stage], self.leaves(stage, params))

    def add(self, stage: int, grads: list, dtype: torch.dtype | None = None) -> None:
        """Add one micro-batch's gradients. Called inside the device's compute scope: the sums
        read the vjp's outputs there. With ``dtype`` (float32 for bfloat16 parameters), each
        micro-batch's gradient is cast before it is added, so the sum does not round at the
        parameters' precision."""
        if dtype is not None:
            grads = [None if grad is None else grad.to(dtype) for grad in grads]
        total = self.totals[stage]
        if total is None:
            self.totals[stage] = list(grads)
            self.owned[stage] = [False] * len(grads)
            return
        # A vjp may return views, broadcast (stride-0) tensors, or the very cotangent it was
        # given: a leaf's first sum is out of place, so later ones may add in place.
        owned = self.owned[stage]
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            if total[i] is None:
                total[i] = grad
            elif owned[i]:
                total[i].add_(grad)
            else:
                total[i], owned[i] = total[i] + grad, True

    def out(self) -> list:
        """Per stage, one gradient per parameter leaf (``None`` for a stage without a backward
        here), never aliasing a vjp's own output."""
        return [self._out(stage) for stage in range(len(self.totals))]

    def stage(self, stage: int) -> list | None:
        """One stage's summed leaves, as :meth:`out` gives them (read once they are final:
        the data-parallel reduction launches a stage's as soon as its last backward ran)."""
        return self._out(stage)

    def reduced(self, stage: int) -> list | None:
        """One stage's gradients for a data-parallel reduction: a tensor for every trainable
        leaf, zeros where this replica's micro-batches did not use it (another replica's may
        have), so that every replica's buckets hold the same leaves; ``None`` for a frozen
        leaf, which no replica differentiates."""
        grads = self._out(stage)
        if grads is None:
            return None
        index = self.trainable[stage]
        live = range(len(grads)) if index is None else index
        for i in live:
            if grads[i] is None:
                grads[i] = torch.zeros_like(self.params[stage][i])
        return grads

    def _out(self, stage: int) -> list | None:
        total, made = self.totals[stage], self.made[stage]
        if total is not None:
            total = [g if g is None or own else g.clone()
                     for g, own in zip(total, self.owned[stage])]
        if made is not None:
            accumulated = [p.grad for p in made]
            total = accumulated if total is None else \
                [_plus(a, b) for a, b in zip(total, accumulated)]
        if total is None:
            return None
        return placed([None] * len(self.params[stage]), self.trainable[stage], total)


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


def plus(a: list | None, b: list | None) -> list | None:
    """Two stages' flat gradients (or two steps' of one stage) added leaf by leaf (``None``
    is nothing), as new tensors: how ``value_and_grad(..., accumulate=True)`` carries its
    sums to the next call, in both faces."""
    if a is None or b is None:
        return b if a is None else a
    return [_plus(x, y) for x, y in zip(a, b)]


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
