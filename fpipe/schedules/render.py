"""Pictures of schedules: text timelines for terminals, Gantt charts through matplotlib.

:func:`render` draws one row per worker with time flowing right, each action spelt as in a
program (``2F0``), and idle time as dots. A program is simulated first (default or given costs)
to place its actions in time; a :class:`~fpipe.schedules.Simulation`, or a timeline recorded
while running (per worker, a tuple of spans with ``action``, ``start`` and ``end``), is drawn as
it is. :func:`draw` writes the same as a PNG, SVG or PDF file; it needs matplotlib
(``pip install matplotlib``, or the ``[plot]`` extra), which nothing else in fpipe does.

:func:`listing` shows a program as written, per worker, with chosen actions marked; it is what
:class:`~fpipe.schedules.ScheduleError` shows, since an invalid program cannot be simulated.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from fpipe.schedules.actions import Action, Op, Program
from fpipe.schedules.simulate import Costs, Simulation, Span, simulate

__all__ = ["render", "draw", "listing", "timeline_of"]

#: A timeline: per worker, the spans of its actions in the order it ran them.
Timeline = Sequence[Sequence[Span]]


def timeline_of(schedule: Program | Simulation | Timeline,
                costs: Costs | None = None) -> tuple[tuple[Span, ...], ...]:
    """The timeline of a program (simulated under ``costs``), a simulation, or a timeline."""
    if isinstance(schedule, Program):
        return simulate(schedule, costs).timeline
    if costs is not None:
        raise ValueError("costs apply to a program only; a simulation or a timeline is already "
                         "placed in time")
    if isinstance(schedule, Simulation):
        return schedule.timeline
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Iterable):
        raise TypeError(f"expected a Program, a Simulation or a timeline, got "
                        f"{type(schedule).__name__}")
    timeline = tuple(tuple(spans) for spans in schedule)
    for spans in timeline:
        for span in spans:
            if not all(hasattr(span, name) for name in ("action", "start", "end")):
                raise TypeError(f"a timeline holds, per worker, spans with action, start and "
                                f"end; got {span!r}")
            if not (math.isfinite(span.start) and math.isfinite(span.end)):
                raise ValueError(f"span of {span.action} has a start or end that is not a "
                                 f"finite number: {span.start}, {span.end}")
            if span.end < span.start:
                raise ValueError(f"span of {span.action} ends ({span.end}) before it starts "
                                 f"({span.start})")
    return timeline


_MAX_COLUMNS = 4096


def render(schedule: Program | Simulation | Timeline, costs: Costs | None = None, *,
           max_width: int | None = None, idle: str = ".", ruler: bool = True) -> str:
    """A text timeline: one row per worker, time flowing right, idle time as ``idle``.

    The scale gives the shortest action room for the longest spelling and a space, so each
    action shows its name and longer ones stretch in proportion. An action that takes no time
    (or next to none: under 1/4096 of the whole) still shows, pushing the rest of its row
    right. The whole program is shown by default; with ``max_width``, lines longer than that
    many characters are cut after the last action that fits whole, and a last line says at
    what time and how many actions are not shown. ``ruler`` adds a first line with times.
    """
    if len(idle) != 1:
        raise ValueError(f"idle must be one character, got {idle!r}")
    timeline = timeline_of(schedule, costs)
    spans = [s for row in timeline for s in row]
    labels = {id(s): str(s.action) for s in spans}
    cell = 1 + max((len(label) for label in labels.values()), default=3)
    origin = min((s.start for s in spans), default=0.0)
    extent = max((s.end for s in spans), default=origin) - origin
    # Actions shorter than this are drawn like those that take no time: the scale, set by the
    # shortest of the others, keeps the grid under _MAX_COLUMNS action widths wide.
    negligible = extent / _MAX_COLUMNS
    shortest = min((s.end - s.start for s in spans if s.end - s.start > negligible),
                   default=1.0)
    per_unit = cell / shortest  # characters per unit of time
    if not math.isfinite(per_unit * max(extent, 1.0)):  # all but vanishingly short: as if none
        per_unit = float(cell)

    def column(t: float) -> int:
        return math.floor((t - origin) * per_unit + 1e-9)

    placed = []  # per worker: (first column, end column, label)
    for row in timeline:
        cursor = 0
        cells = []
        for span in row:
            label = labels[id(span)]
            first = max(column(span.start), cursor)
            cursor = max(column(span.end), first + len(label) + 1)
            cells.append((first, cursor, label))
        placed.append(cells)
    width = max([column(s.end) for s in spans] + [c[-1][1] for c in placed if c] + [0])
    names = [f"worker {w}" for w in range(len(timeline))]
    margin = max(map(len, names), default=0) + 1
    if max_width is not None and width > max(max_width - margin, cell):
        width = max(max_width - margin, cell)
    hidden = 0
    lines = []
    for name, cells in zip(names, placed):
        text = [idle] * width
        for first, last, label in cells:
            if first + len(label) > width:
                hidden += 1
                text[first:width] = " " * max(0, width - first)
            else:
                text[first:min(last, width)] = label.ljust(min(last, width) - first)
        lines.append((name.ljust(margin) + "".join(text)).rstrip())
    if ruler and spans:
        lines.insert(0, " " * margin + _ruler(width, origin, per_unit))
    if hidden:
        shown = origin + width / per_unit
        last = max(s.end for s in spans)
        lines.append(f"(cut at time {_number(shown)} of {_number(last)}: {hidden} of "
                     f"{len(spans)} actions not shown)")
    return "\n".join(lines)


def _number(t: float) -> str:
    return f"{t:.6g}"


def _ruler(width: int, origin: float, per_unit: float) -> str:
    """Times at round values, far enough apart for their digits."""
    units = width / per_unit
    step = 10 ** math.floor(math.log10(max(units, 1e-12)))
    for factor in (0.1, 0.2, 0.5, 1, 2, 5, 10):
        if step * factor * per_unit >= 8:
            step *= factor
            break
    else:
        step *= 10
    text = [" "] * width
    n = math.ceil(origin / step - 1e-9)
    while True:
        t = n * step
        at = math.floor((t - origin) * per_unit + 1e-9)
        label = _number(t)
        if at + len(label) > width:
            break
        if at >= 0 and all(ch == " " for ch in text[max(0, at - 1):at + len(label)]):
            text[at:at + len(label)] = label
        n += 1
    return "".join(text).rstrip()


def listing(program: Program, marks: Iterable[tuple[int, int]] = (), *,
            max_actions: int = 16, max_workers: int = 8) -> str:
    """``program`` as written, one line per worker, with the actions at ``marks`` (pairs of
    worker and position in its list) in brackets.

    Long programs show a window of ``max_actions`` actions per worker, around its mark or else
    the first mark's position, and at most ``max_workers`` workers: the marked ones (the first
    marks first), then the first mark's neighbours; ``...`` stands for what is left out.
    """
    marks = list(dict.fromkeys(marks))  # in the order given, which sets the priority
    marked: dict[int, set[int]] = {}
    for worker, index in marks:
        marked.setdefault(worker, set()).add(index)
    first_worker, first_index = marks[0] if marks else (0, 0)
    workers = set(list(marked)[:max_workers])
    distance = 0
    while len(workers) < min(max_workers, program.n_workers):
        for w in (first_worker - distance, first_worker + distance):
            if 0 <= w < program.n_workers and len(workers) < max_workers:
                workers.add(w)
        distance += 1
    lines = []
    previous = -1
    name_width = len(f"worker {program.n_workers - 1}:")
    for w in sorted(workers):
        if w > previous + 1:
            lines.append("...")
        previous = w
        actions = program.workers[w]
        center = min(marked[w]) if w in marked else first_index
        lo = max(0, min(center - max_actions // 2, len(actions) - max_actions))
        hi = min(len(actions), lo + max_actions)
        cells = [f"[{a}]" if i in marked.get(w, ()) else str(a)
                 for i, a in enumerate(actions[lo:hi], start=lo)]
        if lo > 0:
            cells.insert(0, "...")
        if hi < len(actions):
            cells.append("...")
        lines.append(f"worker {w}:".ljust(name_width) + " " + " ".join(cells))
    if previous < program.n_workers - 1:
        lines.append("...")
    return "\n".join(line.rstrip() for line in lines)


_COLORS = {
    Op.FORWARD: "#4c78a8",
    Op.RECOMPUTE: "#9ecae9",
    Op.BACKWARD: "#f58518",
    Op.BACKWARD_INPUT: "#e45756",
    Op.BACKWARD_WEIGHT: "#54a24b",
}


#: The chart's drawing width per panel, in points (10 inches), and its label font size.
_PANEL_POINTS = 720.0
_FONT = 8.0
_MAX_PANELS = 16
#: A panel holds at least this many actions of the busiest worker.
_ACTIONS_PER_PANEL = 12


def draw(schedule: Program | Simulation | Timeline, path: str | os.PathLike[str],
         costs: Costs | None = None, *, title: str | None = None,
         time_unit: str | None = None) -> Path:
    """Write a Gantt chart of ``schedule`` to ``path``, as PNG, SVG or PDF by its suffix.

    One lane per worker (worker 0 on top), one bar per action coloured by op and labelled with
    its micro-batch (``stage:micro-batch`` where a worker holds several stages). Programs are
    simulated under ``costs`` first. ``time_unit`` names the time axis (e.g. ``"s"``).

    Labels stay legible however long the program: the time axis is folded into panels, one
    under the other (at most 16), each short enough that an action of typical length has room
    for its label; a bar too narrow for its label (a tiny action of a measured step) goes
    without it rather than with an unreadable one. Needs matplotlib: ``pip install
    matplotlib`` (the ``[plot]`` extra).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".png", ".svg", ".pdf"):
        raise ValueError(f"cannot tell the format of {str(path)!r}: use a .png, .svg or .pdf "
                         f"suffix")
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError("draw() needs matplotlib: pip install matplotlib (or, in fpipe's "
                          "clone, pip install -e '.[plot]')") from error
    timeline = timeline_of(schedule, costs)
    plan = chart_plan(timeline)
    spans = [s for row in timeline for s in row]
    n_workers = max(len(timeline), 1)
    panels = plan.panels
    figure = Figure(figsize=(12, len(panels) * (0.4 + 0.38 * n_workers) + 0.9),
                    layout="constrained")
    axes_list = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    for index, (axes, (low, high)) in enumerate(zip(axes_list, panels)):
        points_per_unit = _PANEL_POINTS / (high - low)
        for worker, row in enumerate(timeline):
            for span in row:
                if span.end < low or span.start > high:
                    continue
                action: Action = span.action
                width = span.end - span.start
                axes.barh(worker, width, left=span.start, height=0.8,
                          color=_COLORS[action.op], edgecolor="white",
                          linewidth=0.5 if width * points_per_unit > 3 else 0.0)
                if plan.panel_of(span) == index and plan.labelled(span):
                    axes.text(span.start + width / 2, worker, plan.labels[id(span)],
                              ha="center", va="center", fontsize=_FONT, clip_on=True,
                              color="black" if action.op is Op.RECOMPUTE else "white")
        axes.set_yticks(range(len(timeline)),
                        [f"worker {w}" for w in range(len(timeline))])
        axes.set_ylim(n_workers - 0.5, -0.5)
        axes.set_xlim(low, high)
    axes_list[-1].set_xlabel(f"time ({time_unit})" if time_unit else "time")
    used = [op for op in Op if any(s.action.op is op for s in spans)]
    axes_list[0].legend(handles=[Patch(color=_COLORS[op], label=_op_name(op)) for op in used],
                        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                        frameon=False)
    if title:
        axes_list[0].set_title(title)
    figure.savefig(path, format=suffix[1:])
    return path


class ChartPlan:
    """How :func:`draw` lays a timeline out: the time window of each panel, and each span's
    label (keyed by ``id(span)``), drawn where the bar is wide enough for it."""

    def __init__(self, panels: list[tuple[float, float]], labels: dict[int, str]) -> None:
        self.panels = panels
        self.labels = labels

    def panel_of(self, span: Span) -> int:
        """The panel holding the middle of ``span``, where its label goes."""
        middle = (span.start + span.end) / 2
        return next((i for i, (_, high) in enumerate(self.panels) if middle < high),
                    len(self.panels) - 1)

    def labelled(self, span: Span) -> bool:
        """Whether ``span``'s bar has room for its label."""
        low, high = self.panels[self.panel_of(span)]
        width = (span.end - span.start) * _PANEL_POINTS / (high - low)
        return width >= _label_points(self.labels[id(span)])


def chart_plan(timeline: Sequence[Sequence[Span]]) -> ChartPlan:
    """Panels as few as can be such that an action of the shortest op's median length has
    room for the longest label (the median over all actions would be a backward's when there
    are as many of them as forwards, leaving every forward unlabelled), each covering an
    equal stretch of time; but no more than one per 12 actions of the busiest worker (a
    measured step's few long actions would otherwise spread its many short ones over empty
    panels), and at most 16."""
    spans = [s for row in timeline for s in row]
    stages_on = [{s.action.stage for s in row} for row in timeline]
    labels = {id(span): (f"{span.action.microbatch}" if len(stages_on[worker]) == 1
                         else f"{span.action.stage}:{span.action.microbatch}")
              for worker, row in enumerate(timeline) for span in row}
    start = min((s.start for s in spans), default=0.0)
    end = max((s.end for s in spans), default=1.0)
    extent = max(end - start, 1e-12)
    by_op: dict[Op, list[float]] = {}
    for span in spans:
        if span.end > span.start:
            by_op.setdefault(span.action.op, []).append(span.end - span.start)
    count = 1
    if by_op:
        typical = min(statistics.median(lengths) for lengths in by_op.values())
        widest = max(_label_points(label) for label in labels.values())
        busiest = max(len(row) for row in timeline)
        count = min(_MAX_PANELS, math.ceil(busiest / _ACTIONS_PER_PANEL),
                    max(1, math.ceil(extent * widest / (typical * _PANEL_POINTS))))
    step = extent / count
    return ChartPlan([(start + i * step, start + (i + 1) * step) for i in range(count)], labels)


def _label_points(label: str) -> float:
    """The width a label needs, in points: digits are about 0.6 em wide, plus a margin."""
    return 0.6 * _FONT * len(label) + 3.0


def _op_name(op: Op) -> str:
    return {Op.FORWARD: "forward (F)", Op.RECOMPUTE: "recompute (R)",
            Op.BACKWARD: "backward (B)", Op.BACKWARD_INPUT: "input grad (I)",
            Op.BACKWARD_WEIGHT: "weight grad (W)"}[op]
