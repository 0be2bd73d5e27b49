"""Measured timelines: when each action of a real step ran, in the simulator's terms.

A schedule's promise is a picture (:func:`fpipe.schedules.simulate`); a :class:`Recorder` takes
the same picture of a real step, so predicted and measured schedules can be drawn, traced
(:mod:`fpipe.schedules.trace`) and compared span by span. The recorder is passed in and filled,
never held by the pipeline: a step without one costs no clock reads.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fpipe.schedules.actions import Action
from fpipe.schedules.simulate import Span

__all__ = ["Recorder", "StepFigures", "StepLog", "bubble", "stage_memory"]


class Recorder:
    """Collects the timeline of each step it is passed to, e.g.
    ``pipe.value_and_grad(x, y, record=recorder)``.

    :attr:`timeline` is the last step's: per worker, a tuple of
    :class:`~fpipe.schedules.simulate.Span` ``(action, start, end)`` in seconds from the step's
    start, in the worker's order, the shape of a simulation's timeline. A span covers the
    action's compute, from after its inputs arrived to its end: waiting is idle time, as in the
    simulator. On the CPU times come from the host clock; on CUDA from events recorded on each
    device's compute stream, read once the step has ended. A recorded CUDA step starts with
    one host wait (see :class:`StepClock`), and the actions of one device are enqueued one at a
    time, so that its spans do not overlap. A distributed rank records only its own worker; the
    other workers' tuples are empty.
    """

    def __init__(self) -> None:
        self.steps: list[tuple[tuple[Span, ...], ...]] = []

    @property
    def timeline(self) -> tuple[tuple[Span, ...], ...]:
        if not self.steps:
            raise ValueError("nothing recorded yet: pass record=recorder to a pipeline call")
        return self.steps[-1]

    def clock(self, placement: tuple, n_workers: int,
              devices: list[torch.device]) -> StepClock:
        """A clock for one step; its spans join :attr:`steps` when it is finished."""
        return StepClock(self, placement, n_workers, devices)


class StepClock:
    """One step's clock: marks from worker threads, turned into spans at the end.

    On CUDA, two rules make the spans true (see :class:`_Span` for the second):

    - The origin comes first. Spans are recorded on the compute streams, not on the stream the
      origin is recorded on, so the origin event is *waited for on the host* before the step
      starts: every event recorded afterwards, on any stream, executes after it, whatever
      order the driver gives the streams, so no span starts before 0. The host clock's origin
      is read after that wait, so every device's origin and the CPU's are one moment (to a
      kernel launch), and spans of CPU stages and of several devices can be compared. The
      cost: a recorded step first waits for what the caller had enqueued.
    - Spans sharing a stream do not overlap: a device's actions are enqueued one at a time.
    """

    def __init__(self, recorder: Recorder, placement: tuple, n_workers: int,
                 devices: list[torch.device]) -> None:
        self.recorder = recorder
        self.placement = placement
        self.marks: list[list[tuple]] = [[] for _ in range(n_workers)]
        self.cuda = {d for d in devices if d.type == "cuda"}
        self.locks = {d: threading.Lock() for d in self.cuda}
        self.origins = {d: _event(d) for d in self.cuda}
        for origin in self.origins.values():
            origin.synchronize()
        self.origin = time.perf_counter()

    def now(self, device: torch.device) -> Any:
        """A mark on ``device``'s current stream (CUDA) or the host clock."""
        return _event(device) if device in self.cuda else time.perf_counter()

    def span(self, action: Action, device: torch.device) -> _Span:
        """A context that marks ``action``'s start and, if it ends without an error, its end."""
        return _Span(self, action, device)

    def finish(self) -> None:
        """Resolve the marks (waiting for CUDA events) and hand the timeline to the recorder."""
        def seconds(device: torch.device, mark: Any) -> float:
            if device in self.cuda:
                mark.synchronize()
                return self.origins[device].elapsed_time(mark) / 1e3
            return mark - self.origin

        self.recorder.steps.append(tuple(
            tuple(Span(action, seconds(device, start), seconds(device, end))
                  for action, device, start, end in marks)
            for marks in self.marks))


class _Span:
    """One action's span. On CUDA it holds its device's lock from its start event to its end
    event: the actions of workers sharing a device share its compute stream, and without the
    lock their kernels and events would interleave there (start A, start B, kernels of A, end
    A, kernels of B, end B), so spans would overlap though the stream ran them one after the
    other. With it, each action's kernels lie between its own two events on the stream.

    It must be an action's innermost context: nothing inside it may wait for another worker
    (which could be waiting for this lock). Waiting for inputs happens before it starts."""

    __slots__ = ("clock", "action", "device", "start", "lock")

    def __init__(self, clock: StepClock, action: Action, device: torch.device) -> None:
        self.clock, self.action, self.device = clock, action, device
        self.lock = clock.locks.get(device)

    def __enter__(self) -> None:
        if self.lock is not None:
            self.lock.acquire()
        try:
            self.start = self.clock.now(self.device)
        except BaseException:
            self._release()
            raise

    def __exit__(self, error_type: Any, *_: Any) -> None:
        try:
            if error_type is None:
                clock = self.clock
                clock.marks[clock.placement[self.action.stage]].append(
                    (self.action, self.device, self.start, clock.now(self.device)))
        finally:
            self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _event(device: torch.device) -> torch.cuda.Event:
    """A timing event on ``device``'s current stream: in an action, its compute stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def stage_memory(stages: Any, params: Any, x: Any, *, optimizer: float = 0.0) -> Any:
    """The :class:`~fpipe.schedules.Memory` of plain stages (``stage(params, x) -> y``),
    measured by one profiling call on ``x``, one micro-batch's input to the first stage.

    Each stage runs once under autograd with its parameters as leaves. Its ``activations`` are
    the bytes of the distinct storages its graph saves for the backward, its input included
    and its parameters excluded (as a kept forward holds them); its ``inputs``, the bytes of
    its input (what a pair to be recomputed keeps; a view counts its own elements, not its
    base's); its ``parameters`` and ``gradients``, the bytes of its parameters; its
    ``optimizer``, ``optimizer`` bytes per parameter byte (Adam: 2). Stages that hold state
    or skip connections are not measured here: give :class:`~fpipe.schedules.Memory` by hand.
    """
    import optree

    from fpipe.schedules.memory import Memory

    activations, inputs, parameters = [], [], []
    for stage, stage_params in zip(stages, params, strict=True):
        leaves, spec = optree.tree_flatten(stage_params)
        leaves = [leaf.detach().requires_grad_(leaf.is_floating_point()) for leaf in leaves]
        x_leaves = [leaf for leaf in optree.tree_leaves(x) if isinstance(leaf, torch.Tensor)]
        inputs.append(sum(t.numel() * t.element_size() for t in x_leaves))
        y, saved = _saved_bytes(stage, optree.tree_unflatten(spec, leaves), x, leaves, x_leaves)
        activations.append(saved)
        parameters.append(sum(_nbytes(leaf) for leaf in leaves))
        x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    return Memory(activations=tuple(activations), inputs=tuple(inputs),
                  parameters=tuple(parameters),
                  optimizer=tuple(optimizer * p for p in parameters))


def _saved_bytes(stage: Any, params: Any, x: Any, leaves: list[torch.Tensor],
                 x_leaves: list[torch.Tensor]) -> tuple[Any, int]:
    """``stage(params, x)`` and the bytes its graph saves: distinct storages, the parameters'
    left out, the input's counted by their own elements."""
    held = {_storage(leaf) for leaf in leaves}
    saved = {_storage(t): t.numel() * t.element_size() for t in x_leaves}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in held and key not in saved:
            saved[key] = _nbytes(tensor)
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = stage(params, x)
    return y, sum(saved.values())


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


@dataclass(frozen=True)
class StepLog:
    """How a pipeline reports each step (``pipe.step_log = StepLog(...)``).

    ``level``: the logging level of each step's :class:`StepFigures` line on
    ``logging.getLogger("fpipe")`` (DEBUG by default; ``logging.INFO`` to see them beside the
    pipeline's build). ``bubble``: record every step's timeline (as ``record=`` does) to
    measure its bubble; off by default, since on CUDA a recorded step first waits for what
    the caller had enqueued and serialises the actions sharing a device (on the CPU it costs
    two clock reads per action). A step given ``record=`` has its bubble measured anyway.
    """

    level: int = logging.DEBUG
    bubble: bool = False


@dataclass(frozen=True)
class StepFigures:
    """What one step of a pipeline did, measured (``pipe.last_step``), logged per step.

    ``seconds``: the step's wall-clock time, from the call's start to its results (on CUDA,
    the results are ready on the caller's stream, not necessarily computed). ``samples``: the
    batch size (on a data-parallel rank, its replica's shard). ``tokens``: the count the call
    was given (``tokens=``), or, for one integer tensor of token ids of two or more
    dimensions as input, its element count; ``None`` otherwise (on ``fpipe.distributed``,
    on the ranks without the input). ``peak_memory``: per CUDA device of the pipeline, the
    most bytes allocated during the step (``torch.cuda.max_memory_allocated``, its peak
    reset at the step's start); empty on the CPU. ``bubble``: idle time over total on the
    workers, from the step's timeline: ``1 - busy / (makespan * workers)``, ``None`` when the
    step recorded none (see :class:`StepLog`); a distributed rank measures its own worker
    only, ``1 - busy / makespan`` of its spans.
    """

    what: str
    seconds: float
    samples: int
    tokens: int | None = None
    peak_memory: Mapping[str, int] = field(default_factory=dict)
    bubble: float | None = None

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.inf

    @property
    def tokens_per_second(self) -> float | None:
        if self.tokens is None:
            return None
        return self.tokens / self.seconds if self.seconds > 0 else math.inf

    def __str__(self) -> str:
        said = [f"{self.what} took {self.seconds * 1e3:.3f} ms",
                f"{self.samples} samples ({self.samples_per_second:.1f}/s)"]
        if self.tokens is not None:
            said.append(f"{self.tokens} tokens ({self.tokens_per_second:.1f}/s)")
        said += [f"peak {device} {size / 2**20:.1f} MiB"
                 for device, size in self.peak_memory.items()]
        if self.bubble is not None:
            said.append(f"bubble {self.bubble:.3f}")
        return ", ".join(said)


def bubble(timeline: tuple[tuple[Span, ...], ...],
           workers: tuple[int, ...] | None = None) -> float | None:
    """Idle time over total on the workers of a step's timeline: ``1 - busy / (makespan *
    workers)``, over ``workers`` (indices into the timeline; by default every worker) that
    ran an action (``None`` if none did). A distributed rank gives its own worker: the
    others' idle time is theirs to measure."""
    chosen = range(len(timeline)) if workers is None else workers
    workers = [timeline[w] for w in chosen if timeline[w]]
    if not workers:
        return None
    makespan = max(span.end for spans in workers for span in spans)
    busy = sum(span.end - span.start for spans in workers for span in spans)
    return max(0.0, 1.0 - busy / (makespan * len(workers))) if makespan > 0 else 0.0
