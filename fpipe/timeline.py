"""Measured timelines: when each action of a real step ran, in the simulator's terms.

A schedule's promise is a picture (:func:`fpipe.schedules.simulate`); a :class:`Recorder` takes
the same picture of a real step, so predicted and measured schedules can be drawn, traced
(:mod:`fpipe.schedules.trace`) and compared span by span. The recorder is passed in and filled,
never held by the pipeline: a step without one costs no clock reads.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fpipe.schedules.actions import Action
from fpipe.schedules.simulate import Span

__all__ = ["Recorder"]


class Recorder:
    """Collects the timeline of each step it is passed to, e.g.
    ``pipe.value_and_grad(x, y, record=recorder)``.

    :attr:`timeline` is the last step's: per worker, a tuple of
    :class:`~fpipe.schedules.simulate.Span` ``(action, start, end)`` in seconds from the step's
    start, in the worker's order, the shape of a simulation's timeline. A span covers the
    action's compute, from after its inputs arrived to its end: waiting is idle time, as in the
    simulator. On the CPU times come from the host clock; on CUDA from events recorded on each
    device's compute stream, read once the step has ended. A distributed rank records only its
    own worker; the other workers' tuples are empty.
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
    """One step's clock: marks from worker threads, turned into spans at the end."""

    def __init__(self, recorder: Recorder, placement: tuple, n_workers: int,
                 devices: list[torch.device]) -> None:
        self.recorder = recorder
        self.placement = placement
        self.marks: list[list[tuple]] = [[] for _ in range(n_workers)]
        self.cuda = {d for d in devices if d.type == "cuda"}
        # Every device's origin is taken at the same host moment; CUDA events count from it.
        self.origins = {d: _event(d) for d in self.cuda}
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
    __slots__ = ("clock", "action", "device", "start")

    def __init__(self, clock: StepClock, action: Action, device: torch.device) -> None:
        self.clock, self.action, self.device = clock, action, device

    def __enter__(self) -> None:
        self.start = self.clock.now(self.device)

    def __exit__(self, error_type: Any, *_: Any) -> None:
        if error_type is None:
            clock = self.clock
            clock.marks[clock.placement[self.action.stage]].append(
                (self.action, self.device, self.start, clock.now(self.device)))


def _event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event
