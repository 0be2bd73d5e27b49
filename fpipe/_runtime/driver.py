"""The local interpreter: runs a program for stages on devices, in one process.

The driver knows no particular schedule. Each worker of the program becomes a thread that
executes its actions in order; activations and cotangents go to the worker that needs them
through its inbox, crossing devices on copy streams (see :mod:`fpipe._runtime.stream`). A program is
validated and compiled once into per-worker tuples, so a step allocates little beyond the
values it carries.

What each action means lives in :mod:`fpipe._runtime.instructions`, run by the
:class:`~fpipe._runtime.interpreter.Interpreter` that :mod:`fpipe.distributed` runs too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import optree
import torch

from fpipe._runtime.autodiff import Value
from fpipe._runtime.instructions import after_turn, before_turn, check_turn, compiled
from fpipe._runtime.interpreter import Interpreter
from fpipe._runtime.rng import StepSeed, UnseededDraws
from fpipe._runtime.skips import Skips
from fpipe._runtime.step import Ends, Step, TrainResult, Vjp
from fpipe._runtime.stream import Transport
from fpipe._runtime.thread_state import ThreadState
from fpipe._runtime.workers import (
    Inbox,
    WorkerPool,
    warn_if_oversubscribed,
    warn_if_profiler_misses_workers,
)
from fpipe.errors import StageError
from fpipe.schedules.actions import Program
from fpipe.schedules.colocate import colocate
from fpipe.timeline import Recorder

__all__ = ["LocalDriver", "one_worker_per_gpu"]


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
        leaves, event, like = self.inbox.take(key)
        if event is not None:
            leaves = self.transport.receive(leaves, event, device)
        if like is None or leaves is like.leaves:  # (a value that did not move is itself)
            return leaves if like is None else like
        return Value(leaves, like.spec, like.grad_index)

    def send(self, leaves: list, src: torch.device, stage: int, key: tuple,
             like: Value | None) -> None:
        dst, event = self.devices[stage], None
        if dst != src:  # (on one device, nothing moves)
            leaves, event = self.transport.send(leaves, src, dst)
        self.inboxes[self.owners[stage]].put(key, (leaves, event, like))


class LocalDriver:
    """Runs programs for ``stages`` placed on ``devices`` with one thread per worker.

    One step runs at a time: calls from several threads are served one after the other (a
    training loop and an evaluation thread may share a pipeline), and a stage that calls its
    own pipeline is refused rather than left waiting for itself.
    """

    def __init__(self, stages: Sequence[Callable], param_specs: Sequence[optree.PyTreeSpec],
                 devices: Sequence[torch.device], n_workers: int,
                 loss_fn: Callable | None, stateful: bool = False,
                 grad_dtype: torch.dtype | None = None, autodiff: str = "autograd",
                 skips: Skips | None = None) -> None:
        self.devices = list(devices)
        self.stateful = stateful
        self.transport = Transport(self.devices)
        self.interpreter = Interpreter(stages, param_specs, self.devices, loss_fn,
                                       self.transport, stateful, grad_dtype, autodiff,
                                       concurrent=n_workers > 1, skips=skips)
        warn_if_oversubscribed(n_workers)
        self.pool = WorkerPool(n_workers)
        self._compiled: dict[tuple, tuple] = {}
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
        return TrainResult(step.outputs, step.grads.out(), step.state)

    def begin(self, program: Program, params: list, state: list, inputs: list[Value],
              sizes: list[int]) -> Step:
        """The first half of an open-ended training step: every worker's leading forwards.

        For programs whose workers run all their forwards first (GPipe): ``step.outputs`` then
        holds the last stage's output per micro-batch, and :meth:`finish` runs the rest once
        their cotangents are known, as an autograd backward does.
        """
        plan = self.prepare(program, True)
        check_turn(plan)
        return self._step(program, before_turn, partial(
            self._start, program, True, params, state, inputs, None, [1.0] * len(inputs),
            sizes, ends=Vjp(len(inputs))))

    def finish(self, program: Program, step: Step, cotangents: list[list]) -> TrainResult:
        """The rest of a step :meth:`begin` started, given the outputs' cotangents; the
        inputs' gradients are left in ``step.ends.grads``.

        The worker of the last stage runs in the calling thread. Called from an autograd
        backward (``fpipe.GPipe``) on a CUDA output, that thread is autograd's thread for the
        output's device, which every vjp on that device needs: were it to wait for another
        thread running those vjps, the backward would wait on itself.
        """
        step.ends.cotangents = cotangents
        try:
            self._run(program, step, after_turn, inline=program.placement[-1])
        except UnseededDraws as exc:
            raise StageError(
                f"stage {exc.stage} drew random numbers in the recompute of micro-batch "
                f"{exc.microbatch} but not in its forward, so the recompute cannot reproduce "
                f"the forward: a stage must draw alike in both (its forward ran when the "
                f"pipeline was called, the recompute in the backward)",
                exc.stage, exc.microbatch, "recompute") from None
        return TrainResult(None, step.grads.out(), step.state)

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
               ends: Ends | None = None, record: Recorder | None = None,
               seed: int | None = None, seeded: bool = False) -> Step:
        inboxes = [Inbox() for _ in range(program.n_workers)]

        def abort() -> None:
            for inbox in inboxes:
                inbox.abort()

        clock = (None if record is None else
                 record.clock(program.placement, program.n_workers, self.devices))
        context = ThreadState.capture(self.devices)  # None: workers need apply nothing
        step = Step(params, state, inputs, targets, weights, sizes, seed, training, abort,
                    ends, clock, seeded, None if context.plain else context)
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
            warn_if_profiler_misses_workers(len(plan))
            self.transport.begin_step()
            try:
                self.pool.run(jobs, step.abort, inline)
            finally:
                self.transport.end_step()
                seed.restore()
        if step.error is not None:
            raise step.error
        if step.clock is not None and part is not before_turn:
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


def one_worker_per_gpu(program: Program, devices: Sequence[torch.device]) -> Program:
    """``program`` with the workers whose stages share a CUDA device merged into one (by
    :func:`~fpipe.schedules.colocate`), as torchgpipe and ``fpipe.GPipe`` run one thread per
    device; workers of CPU stages are left as they are.

    Why by device type: a CUDA worker only launches kernels, which its device runs one after
    the other on its compute stream whatever thread launched them, so more workers on one GPU
    add no parallelism; they let the host run ahead on several stages at once, each holding
    the memory of the graph it builds (on an H100, 3.26 GB against 2.00 GB for one worker per
    device on a 12-layer transformer) and contending for the GIL (102.3 ms against 85.7 ms for
    16 small layers; ``docs/benchmarks.md``). On the CPU the workers are what computes in
    parallel (``benchmarks/cpu_scaling.py``), and a step's peak stays within torchgpipe's
    (``tests/test_step_memory.py``), so each keeps its thread.
    """
    root = list(range(program.n_workers))  # each worker's group, by its least member

    def find(w: int) -> int:
        while root[w] != w:
            w = root[w]
        return w

    first_on: dict[torch.device, int] = {}
    for stage, device in enumerate(devices):
        if device.type == "cuda":
            a = find(program.placement[stage])
            b = find(first_on.setdefault(device, a))
            root[max(a, b)] = min(a, b)
    groups = [find(w) for w in range(program.n_workers)]
    if len(set(groups)) == program.n_workers:
        return program
    number: dict[int, int] = {}
    return colocate(program, [number.setdefault(groups[w], len(number))
                              for w in program.placement])


def _everything(actions: tuple) -> tuple:
    return actions
