"""Choosing a schedule for the user: the fastest program that fits the memory, with its evidence.

Which schedule is fastest depends on the costs (how dear a backward is, how long a transfer
takes, what each action costs the driver), on the chunk count and on the memory each worker
has, and the answer moves with all of them. :func:`choose_schedule` simulates every shipped
family over chunk counts and remat policies, drops what does not fit the budget, and returns
the fastest program with the table of everything it tried, so the choice can be checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fpipe.schedules.actions import Program, program_of
from fpipe.schedules.controllable_v import v_half, v_min
from fpipe.schedules.costs import Costs
from fpipe.schedules.dualpipe import dual_pipe_v
from fpipe.schedules.gpipe import gpipe
from fpipe.schedules.interleaved import (
    interleaved_one_f_one_b,
    interleaved_zero_bubble,
    looped_bfs,
)
from fpipe.schedules.memory import Memory, peak_bytes
from fpipe.schedules.one_f_one_b import one_f_one_b
from fpipe.schedules.remat import POLICIES
from fpipe.schedules.simulate import simulate
from fpipe.schedules.zero_bubble import zero_bubble, zero_bubble_v

__all__ = ["Trial", "Choice", "choose_schedule", "FAMILIES"]

#: A family: ``make(chunks, remat, n_stages, n_workers)``, the schedule it builds with that many
#: stages on that many workers, or None where it cannot.
Family = Callable[[int, str, int, int], object]


def _one_per_worker(make: Callable) -> Family:
    return lambda chunks, remat, n_stages, n_workers: (
        make(chunks, remat) if n_stages == n_workers else None)


def _looped(make: Callable) -> Family:
    def family(chunks: int, remat: str, n_stages: int, n_workers: int) -> object:
        v, left = divmod(n_stages, n_workers)
        return make(chunks, v, remat) if v >= 2 and not left else None
    return family


def _v_shape(make: Callable, chunks_per_stage: bool = False) -> Family:
    """A V: 2K stages on K workers (with ``chunks_per_stage``, at least one chunk per stage,
    as DualPipeV needs)."""
    def family(chunks: int, remat: str, n_stages: int, n_workers: int) -> object:
        fits = n_stages == 2 * n_workers and (not chunks_per_stage or chunks >= n_stages)
        return make(chunks, remat) if fits else None
    return family


#: The shipped families :func:`choose_schedule` tries by default, by name.
FAMILIES: dict[str, Family] = {
    "gpipe": _one_per_worker(gpipe),
    "one_f_one_b": _one_per_worker(one_f_one_b),
    "zero_bubble": _one_per_worker(zero_bubble),
    "interleaved_one_f_one_b": _looped(interleaved_one_f_one_b),
    "looped_bfs": _looped(looped_bfs),
    "zero_bubble_v": _v_shape(zero_bubble_v),
    "interleaved_zero_bubble": _looped(interleaved_zero_bubble),
    "dual_pipe_v": _v_shape(dual_pipe_v, chunks_per_stage=True),
    # DeepSeek's order with each action a unit of its own: fpipe runs one action at a time,
    # so a forward need not wait for its partner's gradient (faster where pairs do not overlap)
    "dual_pipe_v_unpaired": _v_shape(lambda chunks, remat: dual_pipe_v(chunks, remat, False),
                                     chunks_per_stage=True),
    # the controllable-memory Vs: about a half and a third of ZB-V's activations
    "v_half": _v_shape(v_half),
    "v_min": _v_shape(v_min),
}


@dataclass(frozen=True)
class Trial:
    """One row of the table: a candidate, its simulated step time and its memory.

    ``peak_bytes`` is the largest worker's (None without a memory model); ``fits`` says whether
    it is within the budget; ``error`` why the candidate could not be built (then ``program``
    is None and the times are infinite).
    """

    name: str
    schedule: object
    program: Program | None
    n_workers: int
    chunks: int
    remat: str
    makespan: float
    bubble: float
    peak_bytes: int | None
    fits: bool
    error: str = ""


@dataclass(frozen=True)
class Choice:
    """What :func:`choose_schedule` found: the fastest fitting trial, and every trial."""

    best: Trial
    trials: tuple[Trial, ...]

    @property
    def schedule(self) -> object:
        """The chosen schedule, to pass to ``fpipe.pipeline(..., schedule=...)``."""
        return self.best.schedule

    @property
    def program(self) -> Program:
        return self.best.program  # type: ignore[return-value]

    def table(self, limit: int | None = None) -> str:
        """The trials as text, fastest fitting first, then those over budget, then errors."""
        rows = sorted(self.trials, key=_rank)[:limit]
        lines = [f"{'schedule':<44} {'workers':>7} {'chunks':>6} {'remat':<11} "
                 f"{'step':>10} {'bubble':>7} {'peak bytes':>14}  fits"]
        for t in rows:
            peak = "-" if t.peak_bytes is None else f"{t.peak_bytes:,}"
            lines.append(f"{t.name:<44} {t.n_workers:>7} {t.chunks:>6} {t.remat:<11} "
                         f"{t.makespan:>10.4g} {t.bubble:>7.1%} {peak:>14}  "
                         f"{'yes' if t.fits else 'no: ' + (t.error or 'over budget')}")
        return "\n".join(lines)


def _rank(trial: Trial) -> tuple:
    return (not trial.fits, bool(trial.error), trial.makespan, trial.peak_bytes or 0)


def choose_schedule(
    n_stages: int | Iterable[int],
    costs: Costs | Mapping[int, Costs] | Mapping[tuple[int, int], Costs],
    *,
    n_workers: int | None = None,
    memory: Memory | None = None,
    budget: float | None = None,
    chunks: Iterable[int] = (1, 2, 4, 8, 16, 32),
    remat: Iterable[str] = POLICIES,
    families: Mapping[str, Family] | None = None,
    candidates: Sequence[object] = (),
) -> Choice:
    """The fastest program that fits ``budget`` bytes per worker, with the table it chose from.

    - ``n_stages``: the stage count, or several (with ``Costs(per="model")`` and
      ``Memory(per="model")``, whose values are split over each program's stages).
    - ``costs``: the whole batch's costs (one pass of the batch, not of a micro-batch); a
      candidate over M micro-batches runs each at ``costs.scaled(1 / M)``, with overhead and
      latency per action unchanged. Small micro-batches are often dearer than their share of
      the batch, so better: a mapping ``{M: costs of one micro-batch at M}`` measured at each
      chunk count tried (e.g. ``Costs.from_timeline`` of a step recorded at each M); its keys
      are then the chunk counts. Best of all, where the stage counts differ: a mapping
      ``{(M, n_stages): costs of one micro-batch}``, per-stage costs fitted on each stage
      count, each candidate priced as it runs. A model cut in twice the stages is not priced
      well by halving: the first stage of a loss step computes no input gradient, so the input
      half fitted on K stages is the work of K-1 of them, which ``Costs.as_model`` spreads
      over every stage (on 2 and 4 stages of 2 workers, split-backward programs measured
      11-18% slower than so predicted). The keys are then the (chunk count, stage count) pairs
      tried.
    - ``memory`` and ``budget``: the whole batch's :class:`Memory` (scaled by 1/M the same
      way) and each worker's bytes; without them every candidate fits.
    - ``n_workers``: keep the candidates on this many workers (default: any).
    - ``families`` (default :data:`FAMILIES`), ``chunks`` and ``remat`` span the candidates;
      a family's value that is built from costs (``zero_bubble_v``) is given the costs it is
      tried under;
      ``candidates`` adds schedules of any form (a value, a ``Program``, a function
      ``n_stages -> Program``), each tried as it is, with the first stage count.

    The best trial is the fitting one with the least simulated step time, then the least peak
    bytes, then the first tried; a ValueError says so when no candidate fits.
    """
    counts = (n_stages,) if isinstance(n_stages, int) else tuple(n_stages)
    priced = _pricing(costs, counts, chunks)
    chunk_counts = tuple(dict.fromkeys(m for m, _ in priced))
    if (memory is None) != (budget is None) and budget is not None:
        raise ValueError("a budget needs a memory model: pass memory=Memory(...) too")
    families = FAMILIES if families is None else families
    policies = tuple(remat)
    trials = []
    for count in counts:
        for m in chunk_counts:
            if (m, count) not in priced:
                continue
            for workers in range(1, count + 1):
                if n_workers is not None and workers != n_workers:
                    continue
                for name, family in families.items():
                    for policy in policies:
                        schedule = with_costs(family(m, policy, count, workers),
                                              priced[m, count])
                        if schedule is not None:
                            trials.append(_trial(name, schedule, count, priced[m, count],
                                                 memory, budget, m, policy))
    for schedule in candidates:
        program = program_of(schedule, counts[0])
        m = program.n_microbatches
        trials.append(_trial(getattr(schedule, "__name__", type(schedule).__name__), schedule,
                             counts[0], priced.get((m, counts[0])) or _scaled(costs, m),
                             memory, budget, m, "as given"))
    fitting = [t for t in trials if t.fits]
    if not fitting:
        measured = [t for t in trials if t.peak_bytes is not None]
        least = min(measured, key=lambda t: t.peak_bytes or 0, default=None)
        raise ValueError(f"no candidate of {len(trials)} fits {budget} bytes per worker"
                         + (f"; the least memory is {least.peak_bytes:,} bytes ({least.name}, "
                            f"{least.chunks} chunks, remat {least.remat})" if least else ""))
    return Choice(best=min(fitting, key=_rank), trials=tuple(trials))


def with_costs(schedule: object, costs: Costs) -> object:
    """``schedule`` built from the costs it is tried under, if it is a value built from costs
    and was given none (a ``costs`` field left None, as ``zero_bubble_v``'s)."""
    if (dataclasses.is_dataclass(schedule) and not isinstance(schedule, type)
            and any(f.name == "costs" for f in dataclasses.fields(schedule))
            and schedule.costs is None):  # type: ignore[attr-defined]
        return dataclasses.replace(schedule, costs=costs)  # type: ignore[arg-type]
    return schedule


def _pricing(costs: object, counts: tuple[int, ...],
             chunks: Iterable[int]) -> dict[tuple[int, int], Costs]:
    """``{(M, n_stages): costs of one micro-batch}`` for each pair tried, from any of the
    three forms :func:`choose_schedule` takes; a mapping keyed by pairs must price every stage
    count asked for (a ValueError names the one it lacks)."""
    if isinstance(costs, Costs):
        return {(m, count): costs.scaled(1.0 / m) for m in chunks for count in counts}
    if not isinstance(costs, Mapping) or not all(isinstance(c, Costs) for c in costs.values()):
        raise TypeError(f"costs must be a Costs value or a mapping from chunk counts (or "
                        f"(chunks, n_stages) pairs) to Costs, got {type(costs).__name__}")
    keys = list(costs)
    if all(isinstance(key, tuple) for key in keys):
        priced = {(int(m), int(s)): c for (m, s), c in costs.items()}
        lacking = [count for count in counts if all(s != count for _, s in priced)]
        if lacking:
            raise ValueError(f"the costs mapping prices no program of {lacking[0]} stages: its "
                             f"keys are (chunks, n_stages) pairs {sorted(priced)}")
        return priced
    if any(isinstance(key, tuple) for key in keys):
        raise TypeError("the costs mapping mixes chunk counts and (chunks, n_stages) pairs as "
                        "keys: use one form")
    return {(int(m), count): c for m, c in costs.items() for count in counts}


def _scaled(costs: object, chunks: int) -> Costs:
    if isinstance(costs, Mapping):
        raise ValueError(f"a candidate runs {chunks} micro-batches, for which the costs mapping "
                         f"has no entry")
    return costs.scaled(1.0 / chunks)  # type: ignore[attr-defined]


def _trial(name: str, schedule: object, n_stages: int, costs: Costs, memory: Memory | None,
           budget: float | None, chunks: int, remat: str) -> Trial:
    per_worker = getattr(schedule, "stages_per_worker", None)
    label = name if per_worker is None else f"{name}(v={per_worker})"
    try:
        program = program_of(schedule, n_stages)
        sim = simulate(program, costs)
    except ValueError as error:
        return Trial(label, schedule, None, 0, chunks, remat, float("inf"), 1.0, None, False,
                     str(error).splitlines()[0])
    peak = None
    if memory is not None:
        peak = max(peak_bytes(program, memory.scaled(1.0 / program.n_microbatches)))
    fits = budget is None or (peak is not None and peak <= budget)
    return Trial(label, schedule, program, program.n_workers, program.n_microbatches, remat,
                 sim.makespan, sim.bubble, peak, fits)
