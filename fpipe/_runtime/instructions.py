"""The instruction set: a program compiled to ``(kind, stage, micro-batch)`` instructions, and a
handler per kind of action. A handler is a short function of a :class:`Job` (one worker's run
of one step); routing goes through the job's channel, sums through the step's
:class:`~fpipe._runtime.step.GradSums`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.autograd import profiler

from fpipe._runtime.autodiff import StageCall
from fpipe._runtime.notes import device_hint, dtype_hint, summary
from fpipe._runtime.rng import UnseededDraws
from fpipe._runtime.step import Channel, Step
from fpipe._runtime.values import Value
from fpipe.errors import LOSS, StageError, Where, locate
from fpipe.recompute import flags
from fpipe.schedules.actions import Action, Op, Program
from fpipe.schedules.validate import validate

if TYPE_CHECKING:
    from fpipe._runtime.interpreter import Interpreter

__all__ = ["Kind", "KINDS", "compiled", "Job", "located", "check_turn", "before_turn",
           "after_turn", "span_name"]

_NOTHING = contextlib.nullcontext()


@dataclass(frozen=True, eq=False)
class Kind:
    """What a compiled action does: ``handler(job, kind, stage, microbatch)`` runs it.

    A forward is *kept* when its vjp is built at once and *dropped* when only its input is kept
    for a later recompute (or, in inference, nothing); a *split* forward or recompute builds a
    vjp whose backward runs as I then W. ``name`` is how errors call it. An instruction with
    no ``op`` is no action of the program: ``await`` receives, before an overlapped pair's
    forward, what the pair's backward needs."""

    name: str
    op: Op | None
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
        "await": Kind("wait for the paired backward's input", None, _await),
    }


def compiled(cache: dict, program: Program, training: bool, stateful: bool = False) -> tuple:
    """``program`` validated and compiled for training or inference, memoised in ``cache``:
    every program is validated before it first runs."""
    # The program last used is found by identity: hashing one hashes every action.
    last = cache.get(("last", training))
    if last is not None and last[0] is program:
        return last[1]
    key = (program, training)
    plan = cache.get(key)
    if plan is None:
        validate(program, training=training)
        if stateful:
            _check_forward_order(program)
        plan = cache[key] = _compile(program, training)
    cache["last", training] = (program, plan)
    return plan


def _compile(program: Program, training: bool) -> tuple[tuple[tuple[Kind, int, int], ...], ...]:
    """Per worker, ``(kind, stage, microbatch)`` for each action: a forward's kind depends on
    whether its pair is recomputed later and whether its backward is split. The forward of an
    overlapped pair (:class:`~fpipe.schedules.Overlap`) is preceded by an ``await`` of its
    backward's inputs, so the pair starts as one unit, as DeepSeek's runtime runs it."""
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

    partner = {o.forward: o.backward for o in program.overlaps}

    def instructions(action) -> tuple:
        own = ((kind(action), action.stage, action.microbatch),)
        paired = partner.get(action)
        return own if paired is None else (
            (KINDS["await"], paired.stage, paired.microbatch), *own)

    return tuple(tuple(i for a in worker for i in instructions(a))
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


# A step run in two calls (``vjp``: the forwards now, the rest once the outputs' cotangents are
# known) runs each worker's compiled actions cut at its turn.

def check_turn(plan: tuple) -> None:
    """A program can be cut at its turn when every worker runs all its forwards first, and
    holds no overlapped pair (whose forward would run in the first call and backward in the
    second, so it could not wait for the backward's input)."""
    if any(kind.op is None for actions in plan for kind, _, _ in actions):
        raise ValueError("a step run in two calls (vjp) cannot run a program with overlapped "
                         "forward-backward pairs (Program.overlaps): a pair's forward would "
                         "run before the cotangents its backward needs are known; run "
                         "program.sequential(), or dual_pipe_v(..., overlap=False)")
    if any(kind.forward for actions in plan for kind, _, _ in after_turn(actions)):
        raise ValueError("a step run in two calls needs a program whose workers run all "
                         "their forwards before any other action, such as gpipe's")


def before_turn(actions: tuple) -> tuple:
    """The forwards a worker runs before anything else."""
    end = next((i for i, (kind, _, _) in enumerate(actions) if not kind.forward), len(actions))
    return actions[:end]


def after_turn(actions: tuple) -> tuple:
    """What a worker runs after its leading forwards."""
    return actions[len(before_turn(actions)):]


class Job:
    """One worker's run of one step: what the handlers of its actions share."""

    __slots__ = ("interpreter", "step", "channel", "calls", "last", "received", "accumulating")

    def __init__(self, interpreter: Interpreter, step: Step, channel: Channel) -> None:
        self.interpreter, self.step, self.channel = interpreter, step, channel
        self.calls = interpreter.calls[step.ends.calls]
        self.last = len(interpreter.devices) - 1
        self.received: Value | None = None  # the input of the running forward, for errors
        # Per stage: whether its unsplit backwards add parameter gradients into the step's
        # leaves inside autograd (the same sums as GradSums.add's, in the same order); not
        # with functorch's engine, nor where each gradient is cast to grad_dtype first.
        self.accumulating = [call is not None and call.accumulates and
                             interpreter.grad_dtype is None for call in self.calls]

    def timed(self, kind: Kind, stage: int, microbatch: int) -> contextlib.AbstractContextManager:
        """The span of one action: for a Recorder when the step is recorded, and as a
        ``record_function`` named like the action (``fpipe::2F0``, see :func:`span_name`)
        while a profiler runs; else nothing (the common case costs one attribute read and one
        global read)."""
        clock = self.step.clock
        if clock is None and not profiler._is_profiler_enabled:
            return _NOTHING
        action = Action(stage, kind.op, microbatch)
        if clock is None:
            return profiler.record_function(span_name(action))
        span = clock.span(action, self.interpreter.devices[stage])
        if not profiler._is_profiler_enabled:
            return span
        both = contextlib.ExitStack()
        both.enter_context(profiler.record_function(span_name(action)))
        both.enter_context(span)
        return both


def span_name(action: Action) -> str:
    """The profiler's name of an action's span: ``fpipe::2F0``. Not the bare ``2F0``: torch's
    profiler demangles event names, and a digit followed by that many characters reads as a
    C++ identifier of that length, so ``2F0`` came out as ``F0`` (every action of stage 2 on
    micro-batches 0-9, of stage 3 on 10-99, ...)."""
    return f"fpipe::{action}"


def _forward(job: Job, kind: Kind, stage: int, microbatch: int) -> None:
    """Run a stage on a micro-batch, keeping its vjp (or only its input, for a recompute), and
    send its output and stashed skips on."""
    step, channel, call = job.step, job.channel, job.calls[stage]
    interpreter = job.interpreter
    device = interpreter.devices[stage]
    x = step.inputs[microbatch] if stage == 0 else \
        channel.receive(("x", stage, microbatch), device)
    job.received = x
    inputs = (x, *(channel.receive(("s", name, microbatch), device)
                   for name in interpreter.pops[stage])) if interpreter.pops[stage] else (x,)
    state, mb = step.state[stage], step.batch[microbatch]
    dropped = not kind.keep and step.training  # to be recomputed, from this state
    with interpreter.transport.compute(device), \
            interpreter.random.scope(step.seed, stage, microbatch, step.training, step.seeded,
                                     check=dropped) as drawing, \
            flags(checkpointing=dropped, owned=_made(step, stage, state)), \
            job.timed(kind, stage, microbatch):
        if kind.keep:
            outs, step.state[stage], vjp_fn = call.forward_vjp(
                step.params[stage], inputs, state, mb, split=kind.split,
                accumulate=_accumulate(job, kind, stage), trainable=step.grads.trainable[stage])
            step.vjps[stage, microbatch] = (vjp_fn, _grad_counts(call, inputs))
        else:
            outs, step.state[stage] = call.forward(
                step.params[stage], inputs, state, mb,
                step.grads.requiring(stage, step.params[stage]))
    if dropped:
        step.saved[stage, microbatch] = (inputs, state, drawing.drew)
    if stage == job.last:  # the output, or in a loss step the micro-batch's loss
        step.outputs[microbatch] = step.ends.output(outs)
        return
    channel.send(outs[0].leaves, device, stage + 1, ("x", stage + 1, microbatch), outs[0])
    if interpreter.stashes[stage]:
        for name, value in zip(interpreter.stashes[stage], outs[1:]):
            channel.send(value.leaves, device, interpreter.routes[name][1],
                         ("s", name, microbatch), value)


def _recompute(job: Job, kind: Kind, stage: int, microbatch: int) -> None:
    """The forward again, from the inputs and state it saw (its new state is dropped), drawing
    the random numbers it drew; keeps the vjp for the backward."""
    step, call, interpreter = job.step, job.calls[stage], job.interpreter
    inputs, state, drew = step.saved.pop((stage, microbatch))
    job.received = inputs[0]
    with interpreter.transport.compute(interpreter.devices[stage]), \
            interpreter.random.scope(step.seed, stage, microbatch, True, step.seeded,
                                     check=True) as drawing, \
            flags(recomputing=True, owned=_made(step, stage, state)), \
            job.timed(kind, stage, microbatch):
        *_, vjp_fn = call.forward_vjp(step.params[stage], inputs, state,
                                      step.batch[microbatch], split=kind.split,
                                      accumulate=_accumulate(job, kind, stage),
                                      trainable=step.grads.trainable[stage])
    if drawing.drew != drew:
        raise StageError(f"the stage drew random numbers in its "
                         f"{'forward' if drew else 'recompute'} but not in its "
                         f"{'recompute' if drew else 'forward'}, so the recompute cannot "
                         f"reproduce the forward: a stage must draw alike in both")
    step.vjps[stage, microbatch] = (vjp_fn, _grad_counts(call, inputs))


def _made(step: Step, stage: int, state: object) -> bool:
    """Whether the step made ``state`` (not the caller's): a call may then update it in place
    (:func:`~fpipe.recompute.state_owned`), except what its recompute would read."""
    return state is not None and state is not step.given_state[stage]


def _cotangent(job: Job, stage: int, microbatch: int) -> list:
    """What a backward receives: its output's cotangent, then each stashed skip's."""
    device, channel = job.interpreter.devices[stage], job.channel
    cotangent: list = []
    if stage < job.last:
        cotangent = list(channel.receive(("g", stage, microbatch), device))
    for name in job.interpreter.stashes[stage]:
        cotangent += channel.receive(("t", name, microbatch), device)
    return cotangent


def _await(job: Job, kind: Kind, stage: int, microbatch: int) -> None:
    """Receive the inputs of an overlapped pair's backward before its forward runs."""
    job.step.awaited[stage, microbatch] = _cotangent(job, stage, microbatch)


def _backward(job: Job, kind: Kind, stage: int, microbatch: int) -> None:
    """A backward (B), or its input half (I, which leaves the weight half pending): the output's
    cotangent in, parameter gradients summed, input gradients sent back."""
    step, interpreter = job.step, job.interpreter
    device = interpreter.devices[stage]
    cotangent = step.awaited.pop((stage, microbatch), None)
    if cotangent is None:
        cotangent = _cotangent(job, stage, microbatch)
    vjp_fn, counts = step.vjps.pop((stage, microbatch))
    # Everything below touches the device's tensors: on its compute stream.
    with interpreter.transport.compute(device), job.timed(kind, stage, microbatch):
        if stage == job.last:  # the loss's seed, or the cotangent a vjp's caller gave
            cotangent = step.ends.seed(microbatch, step.outputs[microbatch])
        if kind.split:
            input_grads = vjp_fn.input_grads(cotangent)
        else:
            param_grads, input_grads = vjp_fn(cotangent)
            if param_grads is not None:  # else added into the step's leaves by autograd
                step.grads.add(stage, param_grads, interpreter.grad_dtype)
    if kind.split:
        step.pending_weights[stage, microbatch] = vjp_fn
    if stage == 0:
        step.ends.input_grads(microbatch, input_grads)
    else:
        _send_input_grads(job, stage, microbatch, input_grads, counts)


def _send_input_grads(job: Job, stage: int, microbatch: int, input_grads: list,
                      counts: tuple[int, ...]) -> None:
    """Input gradients in input order: the previous stage's output first, then each popped
    skip's, back to the stage that stashed it."""
    device, routes = job.interpreter.devices[stage], job.interpreter.routes
    end = counts[0]
    job.channel.send(list(input_grads[:end]), device, stage - 1, ("g", stage - 1, microbatch),
                     None)
    for name, count in zip(job.interpreter.pops[stage], counts[1:]):
        job.channel.send(list(input_grads[end:end + count]), device, routes[name][0],
                         ("t", name, microbatch), None)
        end += count


def _backward_weight(job: Job, kind: Kind, stage: int, microbatch: int) -> None:
    """The weight half (W) of a split backward, from what its input half recorded."""
    step, interpreter = job.step, job.interpreter
    with interpreter.transport.compute(interpreter.devices[stage]), \
            job.timed(kind, stage, microbatch):
        grads = step.pending_weights.pop((stage, microbatch)).weight_grads()
        step.grads.add(stage, grads, interpreter.grad_dtype)


KINDS = _kinds()


def _accumulate(job: Job, kind: Kind, stage: int) -> list | None:
    """The step's leaves for ``stage``'s parameters where its backward adds into them (see
    :attr:`Job.accumulating`; a split backward's W half adds its own), else ``None``."""
    if kind.split or not job.accumulating[stage]:
        return None
    return job.step.grads.leaves(stage, job.step.params[stage])


def _grad_counts(call: StageCall, inputs: tuple[Value, ...]) -> tuple[int, ...]:
    """How many input gradients the backward returns for ``x`` and for each popped skip."""
    return tuple(len(value.grad_index) for value in inputs) if call.grad_input else ()


def located(exc: BaseException, kind: Kind | None, stage: int | None,
             microbatch: int | None, x: Value | None, params: list | None = None
             ) -> BaseException:
    """``exc`` with where it was raised: fpipe's own detections (:class:`StageError`) get it in
    their message and fields, a stage's own exception keeps its type and gets it attached
    (:func:`fpipe.errors.where`) and noted, with the input a later stage received and, where
    the input's floating dtypes are none of the stage's parameters', what to do about it."""
    if isinstance(exc, UnseededDraws) or stage is None:
        return exc
    loss = getattr(exc, "fpipe_loss", None)  # raised inside loss_fn (adapters.in_loss)
    op = LOSS if loss else kind.name if kind is not None else "setup"
    received = loss or (f"its input, from stage {stage - 1}: {summary(x.tree())}"
                        if x is not None and stage else None)
    at = Where(stage, microbatch, op)
    if isinstance(exc, StageError):
        if exc.stage is None:
            message = f"{at.failed()}: {exc}"
            if received:
                message += f"\n  {received}"
            located = StageError(message, stage, microbatch, op)
            located.__cause__, located.__traceback__ = exc.__cause__, exc.__traceback__
            return located
        return exc
    if getattr(exc, "fpipe_where", None) is None:
        locate(exc, at)
        hints = [received, None if loss else dtype_hint(stage, x, params),
                 device_hint(stage, exc, params)]
        for hint in hints:
            if hint and hasattr(exc, "add_note"):
                exc.add_note(f"fpipe: {hint}")
    return exc

