"""The schedule ``choose_schedule`` picks, measured against the hand-picked shipped schedules.

    python benchmarks/search.py [--quick] [--json PATH] [--workers K] [--budget-mb MB]

1. Calibrate: on the residual-block model of benchmarks/residual.py (K stages, one worker
   thread each, one intra-op thread per worker), record steps of 1F1B and of ZB-H1 at each
   chunk count tried, in rounds (one step of each in turn), and fit ``Costs.from_timeline``
   (medians) to them (ZB-H1's steps give the split backward's halves, 1F1B's the full
   backward), as whole-model costs (``Costs.as_model``), one per chunk count. Measure the
   activation bytes with ``fpipe.timeline.stage_memory``.
2. Choose: ``choose_schedule`` over K and 2K stages on K workers, every shipped family, the
   chunk counts calibrated and every remat policy, within ``--budget-mb`` per worker if given.
3. Measure: the chosen program's step time beside every shipped family at 8 micro-batches
   (the hand-picked schedules of cpu_scaling.py), rows interleaved (one step of each in turn,
   ``--repeat`` rounds), median with min and max.
"""

from __future__ import annotations

import time

import torch
from common import parser, report
from residual import Model, loss_fn, split, stage

import fpipe
from fpipe.schedules import (
    Costs,
    Memory,
    choose_schedule,
    dual_pipe_v,
    gpipe,
    interleaved_one_f_one_b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    zero_bubble,
    zero_bubble_v,
)
from fpipe.timeline import stage_memory

MB = 1e6


def calibrate(params: list, x, target, k: int, chunk_counts: tuple[int, ...],
              steps: int) -> dict[int, Costs]:
    """{M: whole-model costs of one micro-batch at M}, fitted (medians) to recorded 1F1B and
    ZB-H1 steps on ``k`` stages. The steps are recorded in rounds, one of each (program, M)
    in turn, so that a machine busier at one moment than another weighs on every M alike."""
    runs = [(m, schedule) for m in chunk_counts for schedule in (one_f_one_b(m), zero_bubble(m))]
    pipes = [fpipe.pipeline([stage] * k, split(params, k), schedule=schedule, loss_fn=loss_fn)
             for _, schedule in runs]
    recorders = {m: fpipe.Recorder() for m in chunk_counts}
    try:
        for pipe in pipes:
            pipe.value_and_grad(x, target)  # warm-up
        for _ in range(steps):
            for (m, _), pipe in zip(runs, pipes):
                pipe.value_and_grad(x, target, record=recorders[m])
    finally:
        for pipe in pipes:
            pipe.close()
    return {m: Costs.from_timeline(*recorder.steps, n_stages=k, statistic="median").as_model(k)
            for m, recorder in recorders.items()}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="K (default 2)")
    p.add_argument("--budget-mb", type=float, help="memory per worker (default: no budget)")
    p.add_argument("--repeat", type=int, help="measured rounds (default 7; quick 3)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    k = args.workers
    model = Model(8, 128, 256) if args.quick else Model(16, 512, 512)
    chunk_counts = (4, 8) if args.quick else (4, 8, 16)
    repeat = args.repeat or (3 if args.quick else 7)
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

    chosen = choice.best
    hand = [("gpipe(8, never)", gpipe(8, "never"), k), ("one_f_one_b(8)", one_f_one_b(8), k),
            ("zero_bubble(8)", zero_bubble(8), k),
            ("interleaved_one_f_one_b(8, v=2)", interleaved_one_f_one_b(8, 2), 2 * k),
            ("looped_bfs(8, v=2)", looped_bfs(8, 2), 2 * k),
            ("interleaved_zero_bubble(8, v=2)", interleaved_zero_bubble(8, 2), 2 * k),
            ("zero_bubble_v(8)", zero_bubble_v(8), 2 * k),
            ("dual_pipe_v(8)", dual_pipe_v(8), 2 * k)]
    label = f"chosen: {chosen.name}({chosen.chunks}, {chosen.remat})"
    runs = [(label, chosen.program, chosen.program.n_stages)] + [
        (name, schedule.program(n), n) for name, schedule, n in hand]
    pipes = [fpipe.pipeline([stage] * n, split(params, n), schedule=program, loss_fn=loss_fn)
             for _, program, n in runs]
    times: list[list[float]] = [[] for _ in runs]
    try:
        for pipe in pipes:
            pipe.value_and_grad(x, target)  # warm-up
        for _ in range(repeat):  # interleaved: one step of each in turn
            for pipe, samples in zip(pipes, times):
                begin = time.perf_counter()
                pipe.value_and_grad(x, target)
                samples.append(time.perf_counter() - begin)
    finally:
        for pipe in pipes:
            pipe.close()
    rows = []
    for (name, program, n), samples in zip(runs, times):
        samples.sort()
        trial = next((t for t in choice.trials if t.program == program), None)
        rows.append({"program": name, "stages": n, "chunks": program.n_microbatches,
                     "simulated_ms": None if trial is None else trial.makespan * 1e3,
                     "median_ms": samples[len(samples) // 2] * 1e3,
                     "min_ms": samples[0] * 1e3, "max_ms": samples[-1] * 1e3,
                     "peak_MB": None if trial is None or trial.peak_bytes is None
                     else trial.peak_bytes / MB})
    best_hand = min(rows[1:], key=lambda r: r["median_ms"])
    notes = [f"model: {model.layers} blocks of width {model.width}, batch {model.batch}; "
             f"{k} workers; calibration and search took {calibrated_s:.1f} s; "
             f"{len(choice.trials)} candidates simulated",
             f"chosen/best hand-picked ({best_hand['program']}): "
             f"{rows[0]['median_ms'] / best_hand['median_ms']:.3f}",
             f"budget: {'none' if budget is None else f'{budget / MB:g} MB per worker'}; "
             f"simulated_ms: under the costs fitted at that chunk count (- where none was)"]
    report("choose_schedule's pick against the hand-picked shipped schedules",
           ["program", "stages", "chunks", "simulated_ms", "median_ms", "min_ms", "max_ms",
            "peak_MB"], rows, args.json, notes,
           tables={"choose_schedule's table (best first)": [
               {"schedule": t.name, "stages": t.program.n_stages if t.program else None,
                "chunks": t.chunks, "remat": t.remat, "simulated_ms": t.makespan * 1e3,
                "peak_MB": None if t.peak_bytes is None else t.peak_bytes / MB,
                "fits": t.fits} for t in sorted(choice.trials, key=lambda t: t.makespan)]})


if __name__ == "__main__":
    main()
