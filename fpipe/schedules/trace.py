"""Timelines as Chrome trace-event JSON, for chrome://tracing and https://ui.perfetto.dev.

A simulated timeline and one recorded while running have the same shape (per worker, spans of
``action``, ``start``, ``end``), so both become "complete" events the same way: one event per
action, named by its spelling (``2F0``), on a track per worker. Several timelines go into one
trace as separate processes, so the prediction and the measurement of a step can be compared
in one view::

    write_chrome_trace("step.json", {"simulated": simulate(program, costs),
                                     "measured": recorded})
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fpipe.schedules.actions import Program
from fpipe.schedules.render import Timeline, timeline_of
from fpipe.schedules.simulate import Costs, Simulation

__all__ = ["chrome_trace", "write_chrome_trace"]

Schedule = Program | Simulation | Timeline


def chrome_trace(timelines: Schedule | Mapping[str, Schedule], *,
                 unit: float | Mapping[str, float] = 1e6, align: bool = True,
                 costs: Costs | None = None) -> dict[str, Any]:
    """A trace of one timeline, or of several given as ``{name: timeline}`` (one process
    each, in the order given), as a JSON-ready dict.

    Each entry is a :class:`~fpipe.schedules.Simulation`, a recorded timeline, or a program
    (simulated under ``costs``). ``unit`` is how many microseconds one unit of a timeline's
    time is: the default, 1e6, reads times as seconds (a recorded timeline's, and a simulation
    whose costs were measured in seconds); give one number for all, or one per name. With
    ``align`` each timeline is shifted to start at 0, so timelines recorded at different
    moments line up.
    """
    if isinstance(timelines, Mapping):
        named = dict(timelines)
        if not named:
            raise ValueError("no timelines given")
    else:
        named = {"simulated" if isinstance(timelines, (Simulation, Program))
                 else "timeline": timelines}
    if isinstance(unit, Mapping):
        missing = [name for name in named if name not in unit]
        if missing:
            raise ValueError(f"unit gives no scale for {', '.join(map(repr, missing))}")
        units = {name: unit[name] for name in named}
    else:
        units = dict.fromkeys(named, unit)
    for name, scale in units.items():
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"unit for {name!r} must be a positive number of microseconds, "
                             f"got {scale!r}")
    events: list[dict[str, Any]] = []
    for pid, (name, schedule) in enumerate(named.items()):
        timeline = timeline_of(schedule, costs if isinstance(schedule, Program) else None)
        scale = float(units[name])
        origin = min((s.start for row in timeline for s in row), default=0.0) if align else 0.0
        events.append(_meta("process_name", pid, 0, name=str(name)))
        events.append(_meta("process_sort_index", pid, 0, sort_index=pid))
        for worker, row in enumerate(timeline):
            events.append(_meta("thread_name", pid, worker, name=f"worker {worker}"))
            events.append(_meta("thread_sort_index", pid, worker, sort_index=worker))
            for span in row:
                action = span.action
                events.append({
                    "name": str(action), "cat": action.op.name.lower(), "ph": "X",
                    "ts": (span.start - origin) * scale, "dur": (span.end - span.start) * scale,
                    "pid": pid, "tid": worker,
                    "args": {"stage": action.stage, "op": action.op.value,
                             "microbatch": action.microbatch},
                })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str],
                       timelines: Schedule | Mapping[str, Schedule], **options: Any) -> Path:
    """Write :func:`chrome_trace` of ``timelines`` (``options`` go to it) to ``path`` as
    JSON; open it in https://ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timelines, **options)), encoding="utf-8")
    return path


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}
