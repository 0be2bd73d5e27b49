"""The local interpreter: runs a program for stages on devices, in one process.

The driver knows no particular schedule. Each worker of the program becomes a thread that
executes its actions in order; activations and cotangents go to the worker that needs them
through its inbox, crossing devices on copy streams (see :mod:`fpipe.stream`). A program is
compiled once into per-worker tuples, so a step allocates little beyond the values it carries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fpipe.autodiff import StageCall, Value
from fpipe.errors import StageError
from fpipe.recompute import recomputing
from fpipe.rng import RandomStages, StepSeed
from fpipe.schedules.actions import Op, Program
from fpipe.schedules.validate import validate
from fpipe.stream import Transport
from fpipe.workers import Aborted, Inbox, WorkerPool

__all__ = ["LocalDriver", "TrainResult"]

# Action codes of a compiled program. A forward is "kept" when its vjp is built at once, and
# "dropped" when only its input is kept for a later recompute (or, in inference, nothing).
_KEPT, _DROPPED, _RECOMPUTE, _BACKWARD, _BACKWARD_INPUT, _BACKWARD_WEIGHT = range(6)
_OP_NAMES = ("forward", "forward", "recompute", "backward", "input-gradient backward",
             "weight-gradient backward")


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
    """Loss parts per micro-batch (already weighted), flat gradient leaves per stage, and each
    stage's state after the step (``None`` for stateless stages)."""

    __slots__ = ("losses", "grads", "state")

    def __init__(self, losses: list, grads: list, state: list) -> None:
        self.losses = losses
        self.grads = grads
        self.state = state


class _Step:
    """Everything one step's workers share; dropped when the step ends."""

    def __init__(self, n_workers: int, params: list, state: list, inputs: list,
                 targets: list | None, weights: list, sizes: list, training: bool) -> None:
        self.inboxes = [Inbox() for _ in range(n_workers)]
        self.params = params
        self.state = list(state)
        self.inputs = inputs
        self.targets = targets
        self.weights = weights
        self.sizes = sizes
        self.seed = 0  # drawn when the step starts (fpipe.rng.StepSeed)
        self.training = training
        self.saved: dict[tuple[int, int], tuple[Value, Any]] = {}
        self.vjps: dict[tuple[int, int], Callable] = {}
        self.pending_weight_grads: dict[tuple[int, int], list] = {}
        self.grads: list = [None] * len(params)
        self.owned_grads: set[int] = set()
        self.outputs: list = [None] * len(inputs)
        self.error: BaseException | None = None
        self._error_lock = threading.Lock()

    def fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self.error is None:
                self.error = error
        self.abort()

    def abort(self) -> None:
        for inbox in self.inboxes:
            inbox.abort()


class LocalDriver:
    """Runs programs for ``stages`` placed on ``devices`` with one thread per worker."""

    def __init__(self, stages: Sequence[Callable], param_specs: Sequence[optree.PyTreeSpec],
                 devices: Sequence[torch.device], n_workers: int,
                 loss_fn: Callable | None, stateful: bool = False) -> None:
        n = len(stages)
        self.devices = list(devices)
        self.stateful = stateful
        self.inference_calls = [StageCall(fn, spec, grad_input=False, stateful=stateful)
                                for fn, spec in zip(stages, param_specs)]
        self.training_calls = [
            StageCall(fn, spec, grad_input=s > 0, loss_fn=loss_fn if s == n - 1 else None,
                      stateful=stateful)
            for s, (fn, spec) in enumerate(zip(stages, param_specs))
        ]
        self.transport = Transport(self.devices)
        self.random = RandomStages(self.devices)
        self.pool = WorkerPool(n_workers)
        self._compiled: dict[tuple[Program, bool], tuple] = {}

    def close(self) -> None:
        self.pool.close()

    def infer(self, program: Program, params: list, state: list, inputs: list[Value],
              sizes: list[int]) -> tuple[list[Any], list]:
        """Forward every micro-batch; returns the last stage's outputs, one pytree each, and
        each stage's state after the last micro-batch."""
        step = _Step(program.n_workers, params, state, inputs, None, [1.0] * len(inputs), sizes,
                     training=False)
        self._run(program, step)
        return step.outputs, step.state

    def train(self, program: Program, params: list, state: list, inputs: list[Value],
              targets: list, weights: list[float], sizes: list[int]) -> TrainResult:
        step = _Step(program.n_workers, params, state, inputs, targets, weights, sizes,
                     training=True)
        self._run(program, step)
        grads = [total if stage in step.owned_grads else [g.clone() for g in total]
                 for stage, total in enumerate(step.grads)]
        return TrainResult(step.outputs, grads, step.state)

    def prepare(self, program: Program, training: bool) -> tuple:
        """Validate and compile ``program`` once; every program is validated before it runs."""
        key = (program, training)
        plan = self._compiled.get(key)
        if plan is None:
            if program.n_stages != len(self.devices):
                raise ValueError(f"the program is for {program.n_stages} stages but the driver "
                                 f"has {len(self.devices)}")
            if program.n_workers != self.pool.n:
                raise ValueError(f"the program has {program.n_workers} workers but the driver "
                                 f"has {self.pool.n}")
            validate(program, training=training)
            if self.stateful:
                _check_forward_order(program)
            plan = self._compiled[key] = _compile(program, training)
        return plan

    def _run(self, program: Program, step: _Step) -> None:
        plan = self.prepare(program, step.training)
        seed = StepSeed(self.devices)
        step.seed = seed.seed
        owners = program.placement
        jobs = [self._job(step, w, plan[w], owners) for w in range(len(plan))]
        self.transport.begin_step()
        try:
            self.pool.run(jobs, step.abort)
        finally:
            self.transport.end_step()
            seed.restore()
        if step.error is not None:
            raise step.error

    def _job(self, step: _Step, worker: int, actions: tuple,
             owners: tuple) -> Callable[[], None]:
        def job() -> None:
            # Grad mode is thread-local: set it in every worker, whatever the caller's is.
            with torch.enable_grad() if step.training else torch.no_grad():
                self._work(step, step.inboxes[worker], actions, owners)
        return job

    def _work(self, step: _Step, inbox: Inbox, actions: tuple, owners: tuple) -> None:
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
                        x = self._receive(inbox, ("x", stage, microbatch), device)
                    target = step.targets[microbatch] if step.targets is not None else None
                    weight = step.weights[microbatch]
                    state = step.state[stage]
                    with transport.compute(device), random.scope(step.seed, stage, microbatch,
                                                                 step.training):
                        if code == _KEPT:
                            out, step.state[stage], step.vjps[key] = call.forward_vjp(
                                step.params[stage], x, state, target, weight)
                        else:
                            out, step.state[stage] = call.forward(
                                step.params[stage], x, state, target, weight)
                    if code == _DROPPED and step.training:
                        step.saved[key] = (x, state)
                    if stage == last:
                        step.outputs[microbatch] = out if step.training else out.tree()
                    else:
                        _check_output(out, step.sizes[microbatch])
                        self._send(step, owners, out.leaves, device, stage + 1,
                                   ("x", stage + 1, microbatch), out)
                elif code == _RECOMPUTE:
                    # The state the forward saw, again; the state it returns is dropped.
                    x, state = step.saved.pop(key)
                    with transport.compute(device), random.scope(step.seed, stage, microbatch,
                                                                 True), recomputing():
                        *_, step.vjps[key] = call.forward_vjp(
                            step.params[stage], x, state,
                            step.targets[microbatch] if stage == last else None,
                            step.weights[microbatch])
                elif code == _BACKWARD_WEIGHT:
                    self._accumulate(step, stage, step.pending_weight_grads.pop(key))
                else:
                    if stage == last:
                        cotangent = [torch.ones_like(step.outputs[microbatch])]
                    else:
                        cotangent = self._receive(inbox, ("g", stage, microbatch), device)
                    with transport.compute(device):
                        param_grads, input_grads = step.vjps.pop(key)(cotangent)
                    if code == _BACKWARD:
                        self._accumulate(step, stage, param_grads)
                    else:
                        step.pending_weight_grads[key] = param_grads
                    if stage > 0:
                        self._send(step, owners, list(input_grads), device, stage - 1,
                                   ("g", stage - 1, microbatch), None)
        except Aborted:
            return
        except BaseException as exc:
            step.fail(_stage_error(exc, code, stage, microbatch, x))
            if not isinstance(exc, Exception):
                raise

    def _receive(self, inbox: Inbox, key: tuple, device: torch.device) -> Any:
        item, event, like = inbox.take(key)
        leaves = self.transport.receive(item, event, device)
        return leaves if like is None else Value(leaves, like.spec, like.grad_index)

    def _send(self, step: _Step, owners: tuple, leaves: list, src: torch.device, stage: int,
              key: tuple, like: Value | None) -> None:
        moved, event = self.transport.send(leaves, src, self.devices[stage])
        step.inboxes[owners[stage]].put(key, (moved, event, like))

    @staticmethod
    def _accumulate(step: _Step, stage: int, grads: list) -> None:
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


def _check_forward_order(program: Program) -> None:
    """State flows from one micro-batch's forward to the next, so they must run in order."""
    for worker, actions in enumerate(program.workers):
        last: dict[int, int] = {}
        for action in actions:
            if action.op is Op.FORWARD:
                if last.get(action.stage, -1) > action.microbatch:
                    raise ValueError(
                        f"stateful stages need their forwards in micro-batch order, but worker "
                        f"{worker} runs {action} after {action.stage}F{last[action.stage]}"
                    )
                last[action.stage] = action.microbatch


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
