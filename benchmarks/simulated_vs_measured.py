"""The simulator's prediction beside the measured step time, per schedule (DESIGN contract 7).

    python benchmarks/simulated_vs_measured.py [--quick] [--json PATH] [--trace PATH]
        [--draw DIR]

Each stage's forward (with its vjp built, as a kept forward is), backward, its split backward's
two halves, and forward without a graph (a forward that will be recomputed) are timed alone on
one thread, per micro-batch.
``fpipe.schedules.simulate`` turns those costs into a predicted step time for each program,
which is then run for real with one worker thread per stage (one intra-op thread each).
A ratio near 1 means the cost model explains the step; above 1, the driver (hand-offs,
Python) or the machine (cores shared) costs what the model leaves out.

Calibrated: ``Costs.from_timeline`` fitted to half of each program's recorded steps (its op
times, the driver's overhead per action and the latency of a hand-off between workers), and
its prediction compared with the other half, which the fit has not seen. ``--trace`` writes
one Chrome/Perfetto trace with, per program, the simulated, calibrated and a recorded
timeline; ``--draw`` draws 1F1B's recorded step and its calibrated simulation.
"""

from __future__ import annotations

import os
import time
from functools import partial

import optree
import torch
from common import parser, report, seconds_per_call
from residual import stage
from torch.func import vjp

import fpipe
from fpipe._runtime.split_backward import split_vjp
from fpipe.schedules import (
    Costs,
    colocate,
    draw,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
    write_chrome_trace,
    zero_bubble,
)


def stage_costs(stage_params: list, x: torch.Tensor, repeat: int) -> tuple[Costs, tuple]:
    """Per stage: kept forward (vjp built), backward, the split backward's halves, and forward
    without a graph (the cost of a forward that will be recomputed)."""
    forward, backward, inputs, weights, plain = [], [], [], [], []
    for ps in stage_params:
        out, vjp_fn = vjp(stage, ps, x)
        ones = torch.ones_like(out)
        forward.append(seconds_per_call(lambda ps=ps, x=x: vjp(stage, ps, x), repeat))
        backward.append(seconds_per_call(lambda f=vjp_fn, g=ones: f(g), repeat))

        def halves(ps=ps, x=x, g=ones) -> tuple[float, float]:
            leaves, spec = optree.tree_flatten(ps)
            _, split = split_vjp(lambda p, h: [stage(optree.tree_unflatten(spec, p), h[0])],
                                 leaves, [x])
            started = time.perf_counter()
            split.input_grads([g])
            middle = time.perf_counter()
            split.weight_grads()
            return middle - started, time.perf_counter() - middle

        measured = sorted(halves() for _ in range(repeat))
        inputs.append(measured[len(measured) // 2][0])
        weights.append(measured[len(measured) // 2][1])
        with torch.no_grad():
            plain.append(seconds_per_call(lambda ps=ps, x=x: stage(ps, x), repeat))
        x = out.detach()
    costs = Costs(forward=tuple(forward), backward=tuple(backward), recompute=tuple(forward),
                  backward_input=tuple(inputs), backward_weight=tuple(weights))
    return costs, tuple(plain)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--trace", metavar="PATH", help="write simulated and measured timelines")
    p.add_argument("--draw", metavar="DIR", help="draw 1F1B's measured step and its calibrated "
                   "simulation as DIR/measured.png and DIR/calibrated.png (needs matplotlib)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, batch, layers, chunks = (128, 128, 8, 8) if args.quick else (512, 512, 16, 8)
    repeat = 3 if args.quick else 7
    k = args.workers
    params = [{"w": torch.randn(width, width) / width ** 0.5,
               "v": torch.randn(width, width) / width ** 0.5} for _ in range(layers)]
    x, target = torch.randn(batch, width), torch.randn(batch, width)
    micro = x[: batch // chunks]

    def split(n_stages: int) -> list:
        per = layers // n_stages
        return [params[i * per:(i + 1) * per] for i in range(n_stages)]

    costs, plain = stage_costs(split(k), micro, repeat)
    costs_2k, _ = stage_costs(split(2 * k), micro, repeat)

    def loss_fn(y, t):
        return torch.nn.functional.mse_loss(y, t)

    # A forward that will be recomputed runs without a graph: the cheaper ``plain`` cost.
    programs = [
        (f"GPipe(never), {k} workers", gpipe(chunks, remat="never").program(k), costs),
        (f"GPipe(always), {k} workers", gpipe(chunks, remat="always").program(k),
         Costs(forward=plain, backward=costs.backward, recompute=costs.forward)),
        (f"1F1B, {k} workers", one_f_one_b(chunks).program(k), costs),
        (f"ZB-H1, {k} workers", zero_bubble(chunks).program(k), costs),
        (f"interleaved 1F1B, {k} workers x 2 stages",
         interleaved_one_f_one_b(chunks, 2).program(2 * k), costs_2k),
        ("GPipe(never), 1 worker", colocate(gpipe(chunks, remat="never").program(k), [0] * k),
         costs),
    ]
    pipes = [fpipe.pipeline([stage] * program.n_stages, split(program.n_stages),
                            schedule=program, loss_fn=loss_fn) for _, program, _ in programs]
    recorders = [fpipe.Recorder() for _ in programs]
    walls: list[list[float]] = [[] for _ in programs]
    try:
        for pipe in pipes:
            pipe.value_and_grad(x, target)  # warm-up: threads started, first calls made
        # Rounds: one timed and one recorded step of each program in turn, so that what else
        # the machine runs weighs on every row alike.
        for _ in range(2 * repeat):
            for pipe, recorder, wall in zip(pipes, recorders, walls):
                wall.append(seconds_per_call(partial(pipe.value_and_grad, x, target), 1, 0))
                pipe.value_and_grad(x, target, record=recorder)
    finally:
        for pipe in pipes:
            pipe.close()
    rows, timelines = [], {}
    reference = Costs.from_timeline(*recorders[2].steps[0::2], n_stages=k,  # 1F1B's fit
                                    statistic="median")
    for (name, program, program_costs), recorder, wall in zip(programs, recorders, walls):
        simulation = simulate(program, program_costs)
        # Calibrated on the even steps, compared with the odd ones: a prediction, not a fit.
        fitted = Costs.from_timeline(*recorder.steps[0::2], n_stages=program.n_stages,
                                     statistic="median")
        calibrated = simulate(program, fitted)
        held_out = sorted(max((s.end for row in step for s in row), default=0.0)
                          for step in recorder.steps[1::2])
        recorded = held_out[len(held_out) // 2]
        cross = (simulate(program, reference).makespan if program.n_stages == k else None)
        timelines[f"{name}: simulated"] = simulation
        timelines[f"{name}: calibrated"] = calibrated
        timelines[f"{name}: measured"] = recorder.steps[1]
        rows.append({"program": name, "predicted_ms": simulation.makespan * 1e3,
                     "calibrated_ms": calibrated.makespan * 1e3,
                     "from_1f1b_ms": None if cross is None else cross * 1e3,
                     "recorded_ms": recorded * 1e3, "recorded_min_ms": held_out[0] * 1e3,
                     "recorded_max_ms": held_out[-1] * 1e3,
                     "wall_ms": sorted(wall)[len(wall) // 2] * 1e3,
                     "recorded/predicted": recorded / simulation.makespan,
                     "recorded/calibrated": recorded / calibrated.makespan,
                     "overhead_us": fitted.overhead * 1e6, "latency_us": fitted.latency * 1e6})
        if args.draw and name.startswith("1F1B"):
            draw(recorder.steps[1], f"{args.draw}/measured.png", title=f"{name}: measured "
                 f"(a held-out step)", time_unit="s")
            draw(calibrated, f"{args.draw}/calibrated.png", title=f"{name}: calibrated "
                 f"simulation", time_unit="s")
    report(f"Simulated vs measured step time ({layers} blocks of width {width} in {k} stages, "
           f"batch {batch}, {chunks} micro-batches, 1 intra-op thread)",
           ["program", "predicted_ms", "calibrated_ms", "from_1f1b_ms", "recorded_ms",
            "recorded_min_ms", "recorded_max_ms", "wall_ms", "recorded/predicted",
            "recorded/calibrated", "overhead_us", "latency_us"], rows, args.json,
           [f"{2 * repeat} "
            "rounds, one timed and one recorded step of each program per round; calibrated: "
            "Costs.from_timeline (medians) on the even recorded steps; recorded: median (min,"
            " max) last span end of the odd ones, which the fit has not seen; from_1f1b: the "
            "costs fitted to 1F1B's even steps (full backwards, so I and W are halves of B), "
            "for the programs with one stage per worker; wall: median wall time of the timed "
            "steps (the step around its spans: splitting, loss, hand-back)"])
    if args.trace:
        write_chrome_trace(args.trace, timelines)
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")


if __name__ == "__main__":
    main()
