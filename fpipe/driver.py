"""The local interpreter: runs a validated program for stages on devices, in one process.

The driver knows no particular schedule. Each worker of the program becomes a thread that
executes its actions in order; activations and cotangents go to the worker that needs them
through its inbox, crossing devices on copy streams (see :mod:`fpipe.stream`). A program is
compiled once into per-worker tuples, so a step allocates little beyond the values it carries.

What each action means lives in :class:`Interpreter`, which reaches other workers only through
a :class:`Channel`; :mod:`fpipe.distributed` runs the same interpreter with a channel over
``torch.distributed``, so both drivers compute exactly the same thing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import optree
import torch

from fpipe.autodiff import StageCall, Value
from fpipe.errors import StageError
from fpipe.rng import RandomStages, StepSeed
from fpipe.schedules.actions import Op, Program
from fpipe.stream import Transport
from fpipe.workers import Aborted, Inbox, WorkerPool

__all__ = ["LocalDriver", "TrainResult", "Interpreter", "Step", "Channel", "compiled"]

# Action codes of a compiled program. A forward is "kept" when its vjp is built at once, and
# "dropped" when only its input is kept for a later recompute (or, in inference, nothing).
_KEPT, _DROPPED, _RECOMPUTE, _BACKWARD, _BACKWARD_INPUT, _BACKWARD_WEIGHT = range(6)
_OP_NAMES = ("forward", "forward", "recompute", "backward", "input-gradient backward",
             "weight-gradient backward")


def compiled(cache: dict, program: Program, training: bool) -> tuple:
    """``program`` compiled for training or inference, memoised in ``cache``."""
    key = (program, training)
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = _compile(program, training)
    return plan


def _compile(program: Program, training: bool) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    recomputed = {(a.stage, a.microbatch) for w in program.workers for a in w
                  if a.op is Op.RECOMPUTE}
    codes = {Op.RECOMPUTE: _RECOMPUTE, Op.BACKWARD: _BACKWARD,
             Op.BACKWARD_INPUT: _BACKWARD_INPUT, Op.BACKWARD_WEIGHT: _BACKWARD_WEIGHT}

    def code(action) -> int:
        if action.op is Op.FORWARD:
            keep = training and (action.stage, action.microbatch) not in recomputed
            return _KEPT if keep else _DROPPED
        return codes[action.op]

    return tuple(tuple((code(a), a.stage, a.microbatch) for a in worker)
                 for worker in program.workers)


class TrainResult:
    """Loss parts per micro-batch (already weighted) and flat gradient leaves per stage."""

    __slots__ = ("losses", "grads")

    def __init__(self, losses: list, grads: list) -> None:
        self.losses = losses
        self.grads = grads


class Step:
    """Everything one step's actions share on one process; dropped when the step ends.

    ``on_abort`` is called once a step has failed, to wake whoever waits for a value (the local
    driver's inboxes, the distributed driver's peers)."""

    def __init__(self, n_stages: int, params: list, inputs: list | None, targets: list | None,
                 weights: list, sizes: list, seed: int, training: bool,
                 on_abort: Callable[[], None]) -> None:
        self.params = params
        self.inputs = inputs
        self.targets = targets
        self.weights = weights
        self.sizes = sizes
        self.seed = seed
        self.training = training
        self.saved: dict[tuple[int, int], Value] = {}
        self.vjps: dict[tuple[int, int], Callable] = {}
        self.pending_weight_grads: dict[tuple[int, int], list] = {}
        self.grads: list = [None] * n_stages
        self.owned_grads: set[int] = set()
        self.outputs: list = [None] * len(sizes)
        self.error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._on_abort = on_abort

    def fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self.error is None:
                self.error = error
        self._on_abort()

    def grads_out(self) -> list:
        """Per stage, its summed gradient leaves, never aliasing a vjp's own output."""
        return [total if stage in self.owned_grads or total is None
                else [g.clone() for g in total]
                for stage, total in enumerate(self.grads)]


class Channel(Protocol):
    """How one worker's values reach the workers of other stages, and how it waits for theirs.

    Keys are ``("x", stage, microbatch)`` for a stage's input and ``("g", stage, microbatch)``
    for the cotangent of its output. Waiting raises :class:`Aborted` once the step has failed.
    """

    def receive(self, key: tuple, device: torch.device) -> Any: ...

    def send(self, leaves: list, src: torch.device, stage: int, key: tuple,
             like: Value | None) -> None: ...


class Interpreter:
    """What every action of a compiled program means, for one worker; drivers share it and
    differ only in their :class:`Channel` and in how they start workers."""

    def __init__(self, stages: Sequence[Callable], param_specs: Sequence[Any],
                 devices: Sequence[torch.device], loss_fn: Callable | None,
                 transport: Transport) -> None:
        n = len(stages)
        self.devices = list(devices)
        # A ``None`` spec marks a stage this process does not hold (distributed): no call.
        self.inference_calls = [None if spec is None else StageCall(fn, spec, grad_input=False)
                                for fn, spec in zip(stages, param_specs)]
        self.training_calls = [
            None if spec is None else
            StageCall(fn, spec, grad_input=s > 0, loss_fn=loss_fn if s == n - 1 else None)
            for s, (fn, spec) in enumerate(zip(stages, param_specs))
        ]
        self.transport = transport
        self.random = RandomStages(self.devices)

    def run(self, step: Step, actions: tuple, channel: Channel) -> None:
        """Execute ``actions`` in order. A failure is recorded with :meth:`Step.fail` as a
        :class:`StageError` naming the stage, op and micro-batch; only interrupts propagate."""
        # Grad mode is thread-local: set it in every worker, whatever the caller's is.
        with torch.enable_grad() if step.training else torch.no_grad():
            self._run(step, actions, channel)

    def _run(self, step: Step, actions: tuple, channel: Channel) -> None:
        devices, transport, random = self.devices, self.transport, self.random
        calls = self.training_calls if step.training else self.inference_calls
        last = len(devices) - 1
        code = stage = microbatch = x = None
        try:
            for code, stage, microbatch in actions:
                x = None
                device = devices[stage]
                call = calls[stage]
                key = (stage, microbatch)
                if code <= _DROPPED:
                    if stage == 0:
                        x = step.inputs[microbatch]
                    else:
                        x = channel.receive(("x", stage, microbatch), device)
                    target = step.targets[microbatch] if step.targets is not None else None
                    weight = step.weights[microbatch]
                    with transport.compute(device), random.scope(step.seed, stage, microbatch,
                                                                 step.training):
                        if code == _KEPT:
                            out, step.vjps[key] = call.forward_vjp(
                                step.params[stage], x, target, weight)
                        else:
                            out = call.forward(step.params[stage], x, target, weight)
                    if code == _DROPPED and step.training:
                        step.saved[key] = x
                    if stage == last:
                        step.outputs[microbatch] = out if step.training else out.tree()
                    else:
                        _check_output(out, step.sizes[microbatch])
                        channel.send(out.leaves, device, stage + 1,
                                     ("x", stage + 1, microbatch), out)
                elif code == _RECOMPUTE:
                    x = step.saved.pop(key)
                    with transport.compute(device), random.scope(step.seed, stage, microbatch,
                                                                 True):
                        _, step.vjps[key] = call.forward_vjp(
                            step.params[stage], x,
                            step.targets[microbatch] if stage == last else None,
                            step.weights[microbatch])
                elif code == _BACKWARD_WEIGHT:
                    self.accumulate(step, stage, step.pending_weight_grads.pop(key))
                else:
                    if stage == last:
                        cotangent = [torch.ones_like(step.outputs[microbatch])]
                    else:
                        cotangent = channel.receive(("g", stage, microbatch), device)
                    with transport.compute(device):
                        param_grads, input_grads = step.vjps.pop(key)(cotangent)
                    if code == _BACKWARD:
                        self.accumulate(step, stage, param_grads)
                    else:
                        step.pending_weight_grads[key] = param_grads
                    if stage > 0:
                        channel.send(list(input_grads), device, stage - 1,
                                     ("g", stage - 1, microbatch), None)
        except Aborted:
            return
        except BaseException as exc:
            step.fail(_stage_error(exc, code, stage, microbatch, x))
            if not isinstance(exc, Exception):
                raise

    @staticmethod
    def accumulate(step: Step, stage: int, grads: list) -> None:
        # A vjp may return views, broadcast (stride-0) tensors, or the very cotangent it was
        # given: the first sum is out of place, so later ones may add in place.
        total = step.grads[stage]
        if total is None:
            step.grads[stage] = list(grads)
        elif stage not in step.owned_grads:
            step.grads[stage] = [acc + grad for acc, grad in zip(total, grads)]
            step.owned_grads.add(stage)
        else:
            for acc, grad in zip(total, grads):
                acc.add_(grad)


class _LocalChannel:
    """A worker's view of the step: its own inbox, and the inboxes of the stages' workers."""

    __slots__ = ("inboxes", "inbox", "owners", "transport", "devices")

    def __init__(self, inboxes: list[Inbox], worker: int, owners: tuple,
                 transport: Transport, devices: list[torch.device]) -> None:
        self.inboxes = inboxes
        self.inbox = inboxes[worker]
        self.owners = owners
        self.transport = transport
        self.devices = devices

    def receive(self, key: tuple, device: torch.device) -> Any:
        item, event, like = self.inbox.take(key)
        leaves = self.transport.receive(item, event, device)
        return leaves if like is None else Value(leaves, like.spec, like.grad_index)

    def send(self, leaves: list, src: torch.device, stage: int, key: tuple,
             like: Value | None) -> None:
        moved, event = self.transport.send(leaves, src, self.devices[stage])
        self.inboxes[self.owners[stage]].put(key, (moved, event, like))


class LocalDriver:
    """Runs programs for ``stages`` placed on ``devices`` with one thread per worker."""

    def __init__(self, stages: Sequence[Callable], param_specs: Sequence[optree.PyTreeSpec],
                 devices: Sequence[torch.device], n_workers: int,
                 loss_fn: Callable | None) -> None:
        self.devices = list(devices)
        self.transport = Transport(self.devices)
        self.interpreter = Interpreter(stages, param_specs, self.devices, loss_fn,
                                       self.transport)
        self.pool = WorkerPool(n_workers)
        self._compiled: dict[tuple[Program, bool], tuple] = {}

    def close(self) -> None:
        self.pool.close()

    def infer(self, program: Program, params: list, inputs: list[Value],
              sizes: list[int]) -> list[Any]:
        """Forward every micro-batch; returns the last stage's outputs, one pytree each."""
        step = self._run(program, False, params, inputs, None, [1.0] * len(inputs), sizes)
        return step.outputs

    def train(self, program: Program, params: list, inputs: list[Value], targets: list,
              weights: list[float], sizes: list[int]) -> TrainResult:
        step = self._run(program, True, params, inputs, targets, weights, sizes)
        return TrainResult(step.outputs, step.grads_out())

    def _run(self, program: Program, training: bool, params: list, inputs: list,
             targets: list | None, weights: list, sizes: list) -> Step:
        plan = compiled(self._compiled, program, training)
        seed = StepSeed(self.devices)
        inboxes = [Inbox() for _ in range(len(plan))]

        def abort() -> None:
            for inbox in inboxes:
                inbox.abort()

        step = Step(len(self.devices), params, inputs, targets, weights, sizes, seed.seed,
                    training, abort)
        owners = program.placement
        jobs = [partial(self.interpreter.run, step, plan[w],
                        _LocalChannel(inboxes, w, owners, self.transport, self.devices))
                for w in range(len(plan))]
        self.transport.begin_step()
        try:
            self.pool.run(jobs, abort)
        finally:
            self.transport.end_step()
            seed.restore()
        if step.error is not None:
            raise step.error
        return step


def _check_output(out: Value, size: int) -> None:
    tensors = [leaf for leaf in out.leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise TypeError(f"the stage returned no tensor (got {out.tree()!r}); a stage must return "
                        f"a tensor or a pytree with tensor leaves")
    for leaf in tensors:
        if leaf.dim() > 0 and leaf.shape[0] != size:
            raise ValueError(
                f"the stage's output {describe(out.tree())} does not keep the micro-batch size "
                f"{size} on dim 0 of every tensor"
            )


def describe(tree: Any) -> str:
    """Shapes and dtypes of a pytree's tensor leaves, for error messages."""
    def one(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            return f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
        return repr(leaf)
    return str(optree.tree_map(one, tree, none_is_leaf=True))


def _stage_error(exc: BaseException, code: int | None, stage: int | None,
                 microbatch: int | None, x: Value | None) -> StageError:
    if isinstance(exc, StageError):
        return exc
    op = _OP_NAMES[code] if code is not None else "setup"
    message = f"stage {stage} failed in the {op} of micro-batch {microbatch}: " \
              f"{type(exc).__name__}: {exc}"
    if x is not None and stage:
        message += f"\n  its input, from stage {stage - 1}: {describe(x.tree())}"
    error = StageError(message, stage, microbatch, op)
    error.__cause__ = exc
    return error
