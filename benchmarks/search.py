"""The schedule ``choose_schedule`` picks, checked against measurement: every candidate that
fits the budget, predicted and measured, and where the two rankings differ.

    python benchmarks/search.py [--quick] [--json PATH] [--workers K] [--budget-mb MB]
                                [--repeat N] [--top N]

1. Calibrate: on the residual-block model of benchmarks/residual.py (one worker thread each,
   one intra-op thread per worker), record steps at each chunk count tried and at each stage
   count (K stages: 1F1B, 1F1B with every forward recomputed and ZB-H1; 2K stages: their
   interleaved forms, two stages per worker), in rounds (one step of each in turn), and fit
   ``Costs.from_timeline`` (medians) to them, per stage, one per (chunk count, stage count):
   each candidate is priced on the stage count it runs at. Every op the search prices is
   measured: the full backward (1F1B), the recompute (remat ``always``: without it the fit
   would cost a recompute as a forward) and the split backward's halves (ZB-H1). Halving the
   K-stage costs for 2K stages priced split-backward programs 11-18% fast: the first stage
   of a loss step computes no input gradient, so at K=2 the fitted input half was half the
   model's, not the whole model's. Measure the activation bytes with
   ``fpipe.timeline.stage_memory``.
2. Choose: ``choose_schedule`` over K and 2K stages on K workers, every shipped family, the
   chunk counts calibrated and every remat policy, within ``--budget-mb`` per worker if given.
3. Measure every candidate that fits (the ``--top`` predicted fastest, default all), rows
   interleaved (one step of each in turn, ``--repeat`` rounds), median with min and max; rank
   them by prediction and by measurement, and report the pairs the two rankings order
   differently.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from common import parser, report
from residual import Model, loss_fn, split, stage

import fpipe
from fpipe.schedules import (
    Costs,
    Memory,
    Op,
    choose_schedule,
    interleaved_one_f_one_b,
    interleaved_zero_bubble,
    one_f_one_b,
    zero_bubble,
)
from fpipe.timeline import stage_memory

MB = 1e6


def calibrate(params: list, x, target, k: int, chunk_counts: tuple[int, ...],
              steps: int) -> dict[tuple[int, int], Costs]:
    """{(M, S): per-stage costs of one micro-batch at M micro-batches on S stages}, for S in
    K and 2K, fitted (medians) to recorded steps of 1F1B, 1F1B with remat ``always`` and ZB-H1
    (S = K) or their interleaved forms (S = 2K), so that the full backward, the recompute and
    the split backward's halves are each measured on every stage of every stage count. The
    steps are recorded in rounds, one of each (program, M, S) in turn, so that a machine
    busier at one moment than another weighs on every row alike."""
    families = {k: (one_f_one_b, partial(one_f_one_b, remat="always"), zero_bubble),
                2 * k: (interleaved_one_f_one_b, partial(interleaved_one_f_one_b,
                                                         remat="always"),
                        interleaved_zero_bubble)}
    runs = [(m, s, make(m)) for s, makes in families.items() for m in chunk_counts
            for make in makes]
    pipes = [fpipe.pipeline([stage] * s, split(params, s), schedule=schedule, loss_fn=loss_fn)
             for _, s, schedule in runs]
    recorders = {(m, s): fpipe.Recorder() for m, s, _ in runs}
    try:
        for pipe in pipes:
            pipe.value_and_grad(x, target)  # warm-up
        for _ in range(steps):
            for (m, s, _), pipe in zip(runs, pipes):
                pipe.value_and_grad(x, target, record=recorders[m, s])
    finally:
        for pipe in pipes:
            pipe.close()
    for (m, s), recorder in recorders.items():
        ops = {span.action.op for step in recorder.steps for row in step for span in row}
        missing = {Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD, Op.BACKWARD_INPUT,
                   Op.BACKWARD_WEIGHT} - ops
        if missing:
            raise RuntimeError(f"the calibration at {m} micro-batches on {s} stages recorded "
                               f"no {sorted(op.value for op in missing)}")
    return {key: Costs.from_timeline(*recorder.steps, n_stages=key[1], statistic="median")
            for key, recorder in recorders.items()}


def measure(programs: list, params: list, x, target, repeat: int) -> list[list[float]]:
    """Each program's step times over ``repeat`` rounds, one step of each in turn."""
    pipes = [fpipe.pipeline([stage] * p.n_stages, split(params, p.n_stages), schedule=p,
                            loss_fn=loss_fn) for p in programs]
    times: list[list[float]] = [[] for _ in programs]
    try:
        for pipe in pipes:
            pipe.value_and_grad(x, target)  # warm-up
        for _ in range(repeat):
            for pipe, samples in zip(pipes, times):
                begin = time.perf_counter()
                pipe.value_and_grad(x, target)
                samples.append(time.perf_counter() - begin)
    finally:
        for pipe in pipes:
            pipe.close()
    return [sorted(samples) for samples in times]


def inversions(rows: list[dict]) -> list[tuple[str, str]]:
    """The pairs (a, b) predicted a before b but measured b before a, with b's slowest step
    faster than a's fastest: a disagreement the spread of the steps cannot explain."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if b["max_ms"] < a["min_ms"]:
                out.append((a["program"], b["program"]))
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="K (default 2)")
    p.add_argument("--budget-mb", type=float, help="memory per worker (default: no budget)")
    p.add_argument("--repeat", type=int, help="measured rounds (default 7; quick 3)")
    p.add_argument("--top", type=int, help="measure the N predicted fastest fitting "
                                           "candidates (default all; quick 6)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    k = args.workers
    model = Model(8, 128, 256) if args.quick else Model(16, 512, 512)
    chunk_counts = (4, 8) if args.quick else (4, 8, 16)
    repeat = args.repeat or (3 if args.quick else 7)
    top = args.top or (6 if args.quick else None)
    params = model.params()
    x, target = model.data()

    started = time.perf_counter()
    costs = calibrate(params, x, target, k, chunk_counts, steps=2 if args.quick else 5)
    stages_memory = stage_memory([stage] * k, split(params, k), x)  # the whole batch
    memory = Memory(activations=sum(stages_memory.activations), inputs=stages_memory.inputs[0],
                    parameters=0.0, gradients=sum(stages_memory.gradients), per="model")
    budget = None if args.budget_mb is None else args.budget_mb * MB
    choice = choose_schedule((k, 2 * k), costs, n_workers=k, memory=memory, budget=budget)
    calibrated_s = time.perf_counter() - started
    print(choice.table(limit=12))

    fitting, seen = [], set()
    for trial in sorted((t for t in choice.trials if t.fits), key=lambda t: t.makespan):
        if trial.program not in seen:  # remat policies that make the same program
            seen.add(trial.program)
            fitting.append(trial)
    fitting = fitting[:top]
    times = measure([t.program for t in fitting], params, x, target, repeat)
    rows = [{"program": f"{t.name}({t.chunks}, {t.remat})", "stages": t.program.n_stages,
             "chunks": t.chunks, "predicted_ms": t.makespan * 1e3,
             "median_ms": s[len(s) // 2] * 1e3, "min_ms": s[0] * 1e3, "max_ms": s[-1] * 1e3,
             "measured/predicted": s[len(s) // 2] / t.makespan,
             "peak_MB": None if t.peak_bytes is None else t.peak_bytes / MB}
            for t, s in zip(fitting, times)]
    by_measure = sorted(range(len(rows)), key=lambda i: rows[i]["median_ms"])
    for rank, i in enumerate(by_measure, 1):
        rows[i]["measured_rank"] = rank
    for rank, row in enumerate(rows, 1):
        row["predicted_rank"] = rank
    flips = inversions(rows)
    ratio = [sum(c.recompute) / sum(c.forward) for c in costs.values()]
    notes = [f"model: {model.layers} blocks of width {model.width}, batch {model.batch}; "
             f"{k} workers; calibration and search took {calibrated_s:.1f} s; "
             f"{len(choice.trials)} candidates simulated, {len(rows)} measured",
             f"budget: {'none' if budget is None else f'{budget / MB:g} MB per worker'}",
             "fitted recompute / forward at each (chunk count, stage count): "
             + ", ".join(f"{m}x{s}: {r:.2f}" for (m, s), r in zip(costs, ratio)),
             f"chosen: {rows[0]['program']}, predicted {rows[0]['predicted_ms']:.1f} ms, "
             f"measured {rows[0]['median_ms']:.1f} ms (measured rank "
             f"{rows[0]['measured_rank']})"]
    if len(rows) > 1:
        notes.append(f"runner-up: {rows[1]['program']}, predicted "
                     f"{rows[1]['predicted_ms']:.1f} ms, measured {rows[1]['median_ms']:.1f} ms "
                     f"(measured rank {rows[1]['measured_rank']})")
    notes.append(f"measured fastest: {rows[by_measure[0]]['program']} (predicted rank "
                 f"{by_measure[0] + 1}), {rows[by_measure[0]]['median_ms']:.1f} ms")
    notes.append(f"rankings disagree beyond the spread on {len(flips)} of "
                 f"{len(rows) * (len(rows) - 1) // 2} pairs"
                 + (": " + "; ".join(f"{a} predicted before {b}" for a, b in flips[:8])
                    if flips else ""))
    report("choose_schedule's candidates that fit: predicted against measured",
           ["predicted_rank", "measured_rank", "program", "stages", "chunks", "predicted_ms",
            "median_ms", "min_ms", "max_ms", "measured/predicted", "peak_MB"],
           rows, args.json, notes)


if __name__ == "__main__":
    main()
