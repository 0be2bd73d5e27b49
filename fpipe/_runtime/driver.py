"""The local interpreter: runs a program for stages on devices, in one process.

The driver knows no particular schedule. Each worker of the program becomes a thread that
executes its actions in order; activations and cotangents go to the worker that needs them
through its inbox, crossing devices on copy streams (see :mod:`fpipe._runtime.stream`). A program is
validated and compiled once into per-worker tuples, so a step allocates little beyond the
values it carries.

What each action means lives in :class:`Interpreter`, which reaches other workers only through
a :class:`Channel`; :mod:`fpipe.distributed` runs the same interpreter with a channel over
``torch.distributed``, so both drivers compute exactly the same thing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import optree
import torch

from fpipe._runtime.autodiff import StageCall, Value, describe
from fpipe._runtime.rng import RandomStages, StepSeed, UnseededDraws
from fpipe._runtime.split_backward import SplitVJP
from fpipe._runtime.stream import Transport
from fpipe._runtime.thread_state import ThreadState
from fpipe._runtime.workers import Aborted, Inbox, WorkerPool
from fpipe.errors import StageError, Where, locate
from fpipe.recompute import recomputing
from fpipe.schedules.actions import Action, Op, Program
from fpipe.schedules.validate import validate
from fpipe.stages.skip import pops, skip_routes, stashes
from fpipe.timeline import Recorder, StepClock

__all__ = ["LocalDriver", "TrainResult", "Interpreter", "Step", "Channel", "compiled"]

_NOTHING = contextlib.nullcontext()


@dataclass(frozen=True, eq=False)
class Kind:
    """What a compiled action does: ``handler(job, kind, stage, microbatch)`` runs it.

    A forward is *kept* when its vjp is built at once and *dropped* when only its input is kept
    for a later recompute (or, in inference, nothing); a *split* forward or recompute builds a
    vjp whose backward runs as I then W. ``name`` is how errors call it."""

    name: str
    op: Op
    handler: Callable[..., None] = field(repr=False)
    keep: bool = False
    split: bool = False

    @property
    def forward(self) -> bool:
        return self.op is Op.FORWARD


def _kinds() -> dict[str, Kind]:
    """The instruction set (the handlers are defined below, one per kind of action)."""
    return {
        "kept": Kind("forward", Op.FORWARD, _forward, keep=True),
        "kept_split": Kind("forward", Op.FORWARD, _forward, keep=True, split=True),
        "dropped": Kind("forward", Op.FORWARD, _forward),
        "recompute": Kind("recompute", Op.RECOMPUTE, _recompute),
        "recompute_split": Kind("recompute", Op.RECOMPUTE, _recompute, split=True),
        "backward": Kind("backward", Op.BACKWARD, _backward),
        "backward_input": Kind("input-gradient backward", Op.BACKWARD_INPUT, _backward,
                               split=True),
        "backward_weight": Kind("weight-gradient backward", Op.BACKWARD_WEIGHT,
                                _backward_weight),
    }


def compiled(cache: dict, program: Program, training: bool, stateful: bool = False) -> tuple:
    """``program`` validated and compiled for training or inference, memoised in ``cache``:
    every program is validated before it first runs."""
    key = (program, training)
    plan = cache.get(key)
    if plan is None:
        validate(program, training=training)
        if stateful:
            _check_forward_order(program)
        plan = cache[key] = _compile(program, training)
    return plan


def _compile(program: Program, training: bool) -> tuple[tuple[tuple[Kind, int, int], ...], ...]:
    """Per worker, ``(kind, stage, microbatch)`` for each action: a forward's kind depends on
    whether its pair is recomputed later and whether its backward is split."""
    def having(op: Op) -> set[tuple[int, int]]:
        return {(a.stage, a.microbatch) for w in program.workers for a in w if a.op is op}

    recomputed, split = having(Op.RECOMPUTE), having(Op.BACKWARD_INPUT)
    by_op = {Op.BACKWARD: KINDS["backward"], Op.BACKWARD_INPUT: KINDS["backward_input"],
             Op.BACKWARD_WEIGHT: KINDS["backward_weight"]}

    def kind(action) -> Kind:
        pair = (action.stage, action.microbatch)
        if action.op is Op.FORWARD:
            if not training or pair in recomputed:
                return KINDS["dropped"]
            return KINDS["kept_split" if pair in split else "kept"]
        if action.op is Op.RECOMPUTE:
            return KINDS["recompute_split" if pair in split else "recompute"]
        return by_op[action.op]

    return tuple(tuple((kind(a), a.stage, a.microbatch) for a in worker)
                 for worker in program.workers)


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
        self.targets = targets
        self.weights = weights
        self.sizes = sizes
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
        self.grads: list = [None] * len(params)
        self.owned_grads: set[int] = set()
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

    def grads_out(self) -> list:
        """Per stage, its summed gradient leaves, never aliasing a vjp's own output."""
        return [total if stage in self.owned_grads or total is None
                else [g.clone() for g in total]
                for stage, total in enumerate(self.grads)]


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


class Interpreter:
    """What every action of a compiled program means, for one worker; drivers share it and
    differ only in their :class:`Channel` and in how they start workers."""

    def __init__(self, stages: Sequence[Callable], param_specs: Sequence[Any],
                 devices: Sequence[torch.device], loss_fn: Callable | None,
                 transport: Transport, stateful: bool = False,
                 grad_dtype: torch.dtype | None = None, autodiff: str = "func",
                 concurrent: bool = True) -> None:
        if autodiff not in ("func", "autograd"):
            raise ValueError(f"autodiff must be 'func' or 'autograd', got {autodiff!r}")
        n = len(stages)
        self.grad_dtype = grad_dtype
        self.devices = list(devices)
        self.routes = skip_routes(stages)

        def calls(grad_input: Callable[[int], bool], loss: Callable | None) -> list:
            # A ``None`` spec marks a stage this process does not hold (distributed): no call.
            return [None if spec is None else
                    StageCall(fn, spec, grad_input=grad_input(s),
                              loss_fn=loss if s == n - 1 else None, stateful=stateful,
                              pops=pops(fn), stashes=stashes(fn), autodiff=autodiff)
                    for s, (fn, spec) in enumerate(zip(stages, param_specs))]

        self.inference_calls = calls(lambda s: False, None)
        self.training_calls = calls(lambda s: s > 0, loss_fn)
        self.open_ended_calls = calls(lambda s: True, None)
        self.transport = transport
        self.random = RandomStages(self.devices, concurrent)

    def run(self, step: Step, actions: tuple, channel: Channel) -> None:
        """Execute ``actions`` in order. A failure is recorded with :meth:`Step.fail`, located
        (stage, op, micro-batch); only interrupts propagate."""
        # Grad mode is the step's; the rest of the caller's thread-local state is carried.
        with torch.enable_grad() if step.training else torch.no_grad(), \
                _NOTHING if step.context is None else step.context.applied(step.training):
            self._run(step, actions, channel)

    def _run(self, step: Step, actions: tuple, channel: Channel) -> None:
        job = _Job(self, step, channel)
        kind = stage = microbatch = None
        try:
            for kind, stage, microbatch in actions:
                job.received = None
                kind.handler(job, kind, stage, microbatch)
        except Aborted:
            return
        except BaseException as exc:
            step.fail(_located(exc, kind, stage, microbatch, job.received))
            if not isinstance(exc, Exception):
                raise

    def accumulate(self, step: Step, stage: int, grads: list) -> None:
        # Called inside the device's compute scope: the sums read the vjp's outputs there.
        # With a grad dtype (float32 for bfloat16 parameters), each micro-batch's gradient is
        # cast before it is added, so the sum does not round at the parameters' precision.
        if self.grad_dtype is not None:
            grads = [grad.to(self.grad_dtype) for grad in grads]
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


class _Job:
    """One worker's run of one step: what the handlers of its actions share."""

    __slots__ = ("interpreter", "step", "channel", "calls", "last", "received")

    def __init__(self, interpreter: Interpreter, step: Step, channel: Channel) -> None:
        self.interpreter, self.step, self.channel = interpreter, step, channel
        self.calls = (interpreter.open_ended_calls if step.open_ended else
                      interpreter.training_calls if step.training else
                      interpreter.inference_calls)
        self.last = len(interpreter.devices) - 1
        self.received: Value | None = None  # the input of the running forward, for errors

    def timed(self, kind: Kind, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        """The span of one action for a Recorder, or nothing when the step is not recorded."""
        clock = self.step.clock
        if clock is None:
            return _NOTHING
        return clock.span(Action(stage, kind.op, microbatch), self.interpreter.devices[stage])


def _forward(job: _Job, kind: Kind, stage: int, microbatch: int) -> None:
    """Run a stage on a micro-batch, keeping its vjp (or only its input, for a recompute), and
    send its output and stashed skips on."""
    step, channel, call = job.step, job.channel, job.calls[stage]
    interpreter = job.interpreter
    device = interpreter.devices[stage]
    x = step.inputs[microbatch] if stage == 0 else \
        channel.receive(("x", stage, microbatch), device)
    job.received = x
    popped = tuple(channel.receive(("s", name, microbatch), device) for name in call.pops)
    target = step.targets[microbatch] if step.targets is not None else None
    state = step.state[stage]
    dropped = not kind.keep and step.training  # to be recomputed
    args = (step.params[stage], x, state, popped, target, step.weights[microbatch],
            step.sizes[microbatch])
    with interpreter.transport.compute(device), \
            interpreter.random.scope(step.seed, stage, microbatch, step.training, step.seeded,
                                     check=dropped) as drawing, \
            job.timed(kind, stage, microbatch):
        if kind.keep:
            outs, step.state[stage], vjp_fn = call.forward_vjp(*args, split=kind.split)
            step.vjps[stage, microbatch] = (vjp_fn, _grad_counts(call, x, popped))
        else:
            outs, step.state[stage] = call.forward(*args)
    if dropped:
        step.saved[stage, microbatch] = (x, state, popped, drawing.drew)
    if stage == job.last:
        step.outputs[microbatch] = (outs[0] if step.open_ended else
                                    outs if step.training else outs[0].tree())
        return
    channel.send(outs[0].leaves, device, stage + 1, ("x", stage + 1, microbatch), outs[0])
    for name, value in zip(call.stashes, outs[1:]):
        channel.send(value.leaves, device, interpreter.routes[name][1], ("s", name, microbatch),
                     value)


def _recompute(job: _Job, kind: Kind, stage: int, microbatch: int) -> None:
    """The forward again, from the inputs and state it saw (its new state is dropped), drawing
    the random numbers it drew; keeps the vjp for the backward."""
    step, call, interpreter = job.step, job.calls[stage], job.interpreter
    x, state, popped, drew = step.saved.pop((stage, microbatch))
    job.received = x
    target = step.targets[microbatch] if step.targets is not None else None
    with interpreter.transport.compute(interpreter.devices[stage]), \
            interpreter.random.scope(step.seed, stage, microbatch, True, step.seeded,
                                     check=True) as drawing, \
            recomputing(), job.timed(kind, stage, microbatch):
        *_, vjp_fn = call.forward_vjp(step.params[stage], x, state, popped, target,
                                      step.weights[microbatch], step.sizes[microbatch],
                                      split=kind.split)
    if drawing.drew != drew:
        raise StageError(f"the stage drew random numbers in its "
                         f"{'forward' if drew else 'recompute'} but not in its "
                         f"{'recompute' if drew else 'forward'}, so the recompute cannot "
                         f"reproduce the forward: a stage must draw alike in both")
    step.vjps[stage, microbatch] = (vjp_fn, _grad_counts(call, x, popped))


def _backward(job: _Job, kind: Kind, stage: int, microbatch: int) -> None:
    """A backward (B), or its input half (I, which leaves the weight half pending): the output's
    cotangent in, parameter gradients summed, input gradients sent back."""
    step, channel, call, interpreter = job.step, job.channel, job.calls[stage], job.interpreter
    device = interpreter.devices[stage]
    cotangent: list = []
    if stage == job.last and step.open_ended:
        cotangent = list(step.output_cotangents[microbatch])
    elif stage < job.last:
        cotangent = list(channel.receive(("g", stage, microbatch), device))
    for name in call.stashes:
        cotangent += channel.receive(("t", name, microbatch), device)
    vjp_fn, counts = step.vjps.pop((stage, microbatch))
    # Everything below touches the device's tensors: on its compute stream.
    with interpreter.transport.compute(device), job.timed(kind, stage, microbatch):
        if stage == job.last and not step.open_ended:  # the loss's seed
            cotangent = [torch.ones_like(step.outputs[microbatch])]
        if kind.split:
            input_grads = vjp_fn.input_grads(cotangent)
        else:
            param_grads, input_grads = vjp_fn(cotangent)
            interpreter.accumulate(step, stage, param_grads)
    if kind.split:
        step.pending_weights[stage, microbatch] = vjp_fn
    if stage == 0 and step.open_ended:
        step.input_grads[microbatch] = list(input_grads)
    elif stage > 0:
        _send_input_grads(job, stage, microbatch, input_grads, counts)


def _send_input_grads(job: _Job, stage: int, microbatch: int, input_grads: list,
                      counts: tuple[int, ...]) -> None:
    """Input gradients in input order: the previous stage's output first, then each popped
    skip's, back to the stage that stashed it."""
    device, routes = job.interpreter.devices[stage], job.interpreter.routes
    end = counts[0]
    job.channel.send(list(input_grads[:end]), device, stage - 1, ("g", stage - 1, microbatch),
                     None)
    for name, count in zip(job.calls[stage].pops, counts[1:]):
        job.channel.send(list(input_grads[end:end + count]), device, routes[name][0],
                         ("t", name, microbatch), None)
        end += count


def _backward_weight(job: _Job, kind: Kind, stage: int, microbatch: int) -> None:
    """The weight half (W) of a split backward, from what its input half recorded."""
    step, interpreter = job.step, job.interpreter
    with interpreter.transport.compute(interpreter.devices[stage]), \
            job.timed(kind, stage, microbatch):
        grads = step.pending_weights.pop((stage, microbatch)).weight_grads()
        interpreter.accumulate(step, stage, grads)


KINDS = _kinds()


def _grad_counts(call: StageCall, x: Value, popped: tuple[Value, ...]) -> tuple[int, ...]:
    """How many input gradients the backward returns for ``x`` and for each popped skip."""
    if not call.grad_input:
        return ()
    return (len(x.grad_index), *(len(value.grad_index) for value in popped))


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
    """Runs programs for ``stages`` placed on ``devices`` with one thread per worker.

    One step runs at a time: calls from several threads are served one after the other (a
    training loop and an evaluation thread may share a pipeline), and a stage that calls its
    own pipeline is refused rather than left waiting for itself.
    """

    def __init__(self, stages: Sequence[Callable], param_specs: Sequence[optree.PyTreeSpec],
                 devices: Sequence[torch.device], n_workers: int,
                 loss_fn: Callable | None, stateful: bool = False,
                 grad_dtype: torch.dtype | None = None, autodiff: str = "func") -> None:
        self.devices = list(devices)
        self.stateful = stateful
        self.transport = Transport(self.devices)
        self.interpreter = Interpreter(stages, param_specs, self.devices, loss_fn,
                                       self.transport, stateful, grad_dtype, autodiff,
                                       concurrent=n_workers > 1)
        self.pool = WorkerPool(n_workers)
        self._compiled: dict[tuple[Program, bool], tuple] = {}
        self._lock = threading.Lock()
        self._holder: int | None = None

    def close(self) -> None:
        with self._serialised():
            self.pool.close()

    def prepare(self, program: Program, training: bool) -> tuple:
        """Validate and compile ``program`` for this driver, once."""
        if program.n_stages != len(self.devices):
            raise ValueError(f"the program is for {program.n_stages} stages but the driver "
                             f"has {len(self.devices)}")
        if program.n_workers != self.pool.n:
            raise ValueError(f"the program has {program.n_workers} workers but the driver "
                             f"has {self.pool.n}")
        return compiled(self._compiled, program, training, self.stateful)

    def infer(self, program: Program, params: list, state: list, inputs: list[Value],
              sizes: list[int], record: Recorder | None = None) -> tuple[list[Any], list]:
        """Forward every micro-batch; returns the last stage's outputs, one pytree each, and
        each stage's state after the last micro-batch."""
        step = self._step(program, _everything, partial(
            self._start, program, False, params, state, inputs, None, [1.0] * len(inputs),
            sizes, record=record))
        return step.outputs, step.state

    def train(self, program: Program, params: list, state: list, inputs: list[Value],
              targets: list, weights: list[float], sizes: list[int],
              record: Recorder | None = None) -> TrainResult:
        step = self._step(program, _everything, partial(
            self._start, program, True, params, state, inputs, targets, weights, sizes,
            record=record))
        return TrainResult(step.outputs, step.grads_out(), step.state)

    def begin(self, program: Program, params: list, state: list, inputs: list[Value],
              sizes: list[int]) -> Step:
        """The first half of an open-ended training step: every worker's leading forwards.

        For programs whose workers run all their forwards first (GPipe): ``step.outputs`` then
        holds the last stage's output per micro-batch, and :meth:`finish` runs the rest once
        their cotangents are known, as an autograd backward does.
        """
        plan = self.prepare(program, True)
        if any(kind.forward for actions in plan for kind, _, _ in _after_forwards(actions)):
            raise ValueError("a step run in two calls needs a program whose workers run all "
                             "their forwards before any other action, such as gpipe's")
        return self._step(program, _forwards, partial(
            self._start, program, True, params, state, inputs, None, [1.0] * len(inputs),
            sizes, open_ended=True))

    def finish(self, program: Program, step: Step, cotangents: list[list]) -> TrainResult:
        """The rest of a step :meth:`begin` started, given the outputs' cotangents; the
        inputs' gradients are left in ``step.input_grads``.

        The worker of the last stage runs in the calling thread. Called from an autograd
        backward (``fpipe.GPipe``) on a CUDA output, that thread is autograd's thread for the
        output's device, which every vjp on that device needs: were it to wait for another
        thread running those vjps, the backward would wait on itself.
        """
        step.output_cotangents = cotangents
        try:
            self._run(program, step, _after_forwards, inline=program.placement[-1])
        except UnseededDraws as exc:
            raise StageError(
                f"stage {exc.stage} drew random numbers in the recompute of micro-batch "
                f"{exc.microbatch} but not in its forward, so the recompute cannot reproduce "
                f"the forward: a stage must draw alike in both (its forward ran when the "
                f"pipeline was called, the recompute in the backward)",
                exc.stage, exc.microbatch, "recompute") from None
        return TrainResult(None, step.grads_out(), step.state)

    def _step(self, program: Program, part: Callable[[tuple], tuple],
              start: Callable[..., Step]) -> Step:
        """Run ``part`` of a new step; if a stage drew random numbers unseeded (see
        :mod:`fpipe._runtime.rng`), run the step again from its start, every call seeded."""
        step = start()
        try:
            self._run(program, step, part)
        except UnseededDraws:
            step = start(seed=step.seed, seeded=True)
            self._run(program, step, part)
        return step

    def _start(self, program: Program, training: bool, params: list, state: list,
               inputs: list, targets: list | None, weights: list, sizes: list,
               open_ended: bool = False, record: Recorder | None = None,
               seed: int | None = None, seeded: bool = False) -> Step:
        inboxes = [Inbox() for _ in range(program.n_workers)]

        def abort() -> None:
            for inbox in inboxes:
                inbox.abort()

        clock = (None if record is None else
                 record.clock(program.placement, program.n_workers, self.devices))
        step = Step(params, state, inputs, targets, weights, sizes, seed, training, abort,
                    open_ended, clock, seeded, ThreadState.capture(self.devices))
        if step.context.plain:
            step.context = None
        step.inboxes = inboxes
        return step

    def _run(self, program: Program, step: Step, part: Callable[[tuple], tuple],
             inline: int = 0) -> None:
        """Run ``part`` of each worker's compiled actions (all of them, or one half), worker
        ``inline`` in the calling thread."""
        plan = self.prepare(program, step.training)
        with self._serialised():
            seed = StepSeed(self.devices, step.seed)
            step.seed = seed.seed
            jobs = [partial(self.interpreter.run, step, part(plan[w]),
                            _LocalChannel(step.inboxes, w, program.placement, self.transport,
                                          self.devices))
                    for w in range(len(plan))]
            self.transport.begin_step()
            try:
                self.pool.run(jobs, step.abort, inline)
            finally:
                self.transport.end_step()
                seed.restore()
        if step.error is not None:
            raise step.error
        if step.clock is not None and part is not _forwards:
            step.clock.finish()

    @contextlib.contextmanager
    def _serialised(self):
        """Hold the driver for one run; a stage calling its own pipeline is an error."""
        me = threading.get_ident()
        if me == self._holder or self.pool.runs_in(me):
            raise RuntimeError("a stage called the pipeline that is running it; a pipeline "
                               "runs one step at a time, so this call would wait for itself")
        with self._lock:
            self._holder = me
            try:
                yield
            finally:
                self._holder = None


def _everything(actions: tuple) -> tuple:
    return actions


def _forwards(actions: tuple) -> tuple:
    """The forwards a worker runs before anything else."""
    end = next((i for i, (kind, _, _) in enumerate(actions) if not kind.forward), len(actions))
    return actions[:end]


def _after_forwards(actions: tuple) -> tuple:
    return actions[len(_forwards(actions)):]


def _located(exc: BaseException, kind: Kind | None, stage: int | None,
             microbatch: int | None, x: Value | None) -> BaseException:
    """``exc`` with where it was raised: fpipe's own detections (:class:`StageError`) get it in
    their message and fields, a stage's own exception keeps its type and gets it attached
    (:func:`fpipe.errors.where`) and noted, with the input a later stage received."""
    if isinstance(exc, UnseededDraws) or stage is None:
        return exc
    op = kind.name if kind is not None else "setup"
    received = f"its input, from stage {stage - 1}: {describe(x.tree())}" \
        if x is not None and stage else None
    if isinstance(exc, StageError):
        if exc.stage is None:
            message = f"stage {stage} failed in the {op} of micro-batch {microbatch}: {exc}"
            if received:
                message += f"\n  {received}"
            located = StageError(message, stage, microbatch, op)
            located.__cause__, located.__traceback__ = exc.__cause__, exc.__traceback__
            return located
        return exc
    if getattr(exc, "fpipe_where", None) is None:
        locate(exc, Where(stage, microbatch, op))
        if received and hasattr(exc, "add_note"):
            exc.add_note(f"fpipe: {received}")
    return exc
