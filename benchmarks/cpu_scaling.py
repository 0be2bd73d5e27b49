"""Pipeline scaling on the CPU: a deep stack of equal blocks over K workers, one thread each.

    python benchmarks/cpu_scaling.py [--quick] [--json PATH] [--workers 1 2 4 8]
        [--chunks 8 32] [--no-distributed | --only-distributed] [--rounds R]

Torch's intra-op threads are set to 1, so a worker (thread or process) uses one core. The same
model, batch and M micro-batches run as:
- naive-1: plain ``torch.func`` on the whole batch on one thread, the reference of *speedup*;
- "K copies at once": K naive-1 steps on K threads, what the machine itself allows;
- "M micro-batches in a loop": naive-1's work micro-batched on one thread (on a CPU small
  micro-batches re-read every weight, so this isolates what pipelining itself gains);
- fpipe's local driver (one thread per worker) and its ``fpipe.distributed`` driver (one
  process per worker, gloo on 127.0.0.1), with GPipe (no remat), 1F1B and every other
  schedule ``fpipe.schedules`` exports;
- ``torch.distributed.pipelining`` with one process per rank: ScheduleGPipe, Schedule1F1B,
  ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (stages r and r+K on rank r),
  ScheduleZBVZeroBubble and ScheduleDualPipeV (stages r and 2K-1-r); without numpy (which
  torch.distributed.pipelining needs, but neither torch nor fpipe requires) these rows are
  marked not run. A schedule that fails is a row with its error (with --quick, a smoke run, a
  failure on a spawned rank instead ends the run at once with that rank's error).
speedup = naive-1 time / step time; bound = K*M/(M+K-1), the most a fill-drain pipeline can
gain; efficiency = speedup / bound. *check* compares the step's loss and its first gradient
with naive-1's. K larger than the machine's cores is run only when asked (--workers), and its
rows are marked oversubscribed. A distributed step is timed from a barrier to a barrier.

``--only-distributed`` keeps naive-1 (the reference) and the spawned rows only. The pipeline
rows run in ``--rounds`` rounds (3 by default, 1 with --quick): per round, every local row,
then every spawned job in one group of ranks, so a load that comes and goes on a shared machine
touches the local and the distributed rows alike; a row's step_ms is the median over rounds
of each round's median step, and its note gives the rounds' range.
"""

from __future__ import annotations

import os
import threading
from functools import partial

import torch
from common import parser, report, run_jobs, seconds_per_call, spawn_ranks
from residual import (
    TORCH_PIPELINING_MISSING,
    Model,
    check,
    distributed_jobs,
    fpipe_schedules,
    loss_fn,
    merge_ranks,
    naive_step,
    split,
    stage,
)

import fpipe

COLUMNS = ["K", "M", "driver", "schedule", "step_ms", "speedup", "bound", "efficiency", "check",
           "note"]


def row(k: int, m: int, driver: str, schedule: str, seconds: float | None, speedup: float | None,
        bound: float, check_: str = "", note: str = "") -> dict:
    return {"K": k, "M": m, "driver": driver, "schedule": schedule,
            "step_ms": None if seconds is None else seconds * 1e3, "speedup": speedup,
            "bound": bound, "efficiency": None if speedup is None else speedup / bound,
            "check": check_, "note": note}


def time_local(schedule: object, n_stages: int, params: list, x: torch.Tensor,
               target: torch.Tensor, repeat: int) -> tuple[float, dict]:
    """One round of a local row: the median step of ``repeat``, and the step's loss and first
    gradient norm (for *check*)."""
    with fpipe.pipeline([stage] * n_stages, split(params, n_stages), schedule=schedule,
                        loss_fn=loss_fn) as pipe:
        t = seconds_per_call(lambda: pipe.value_and_grad(x, target), repeat)
        loss, grads = pipe.value_and_grad(x, target)
    return t, {"loss": float(loss), "grad0": float(grads[0][0]["w"].norm())}


def _median_round(times: list[float]) -> tuple[float, str]:
    """The median over rounds of each round's median step, and the rounds' range."""
    times = sorted(times)
    spread = f"rounds {times[0] * 1e3:.4g}-{times[-1] * 1e3:.4g} ms" if len(times) > 1 else ""
    return times[len(times) // 2], spread


def main() -> None:
    cores = os.cpu_count() or 1
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+",
                   default=[k for k in (1, 2, 4, 8) if k <= cores])
    p.add_argument("--chunks", type=int, nargs="+", help="M values (default 8; 8 32 in full)")
    p.add_argument("--model", type=int, nargs=3, metavar=("LAYERS", "WIDTH", "BATCH"),
                   help="another model size than the mode's")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--no-distributed", action="store_true",
                      help="only the in-process rows (no spawned ranks)")
    only.add_argument("--only-distributed", action="store_true",
                      help="only naive-1 and the spawned rows (fpipe.distributed, "
                           "torch.distributed.pipelining)")
    p.add_argument("--rounds", type=int, help="rounds of the spawned jobs (3; 1 with --quick)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = Model(*(args.model or ((8, 256, 256) if args.quick else (16, 512, 512))))
    chunks_list = args.chunks or ([8] if args.quick else [8, 32])
    repeat = 3 if args.quick else 7
    params = model.params()
    x, target = model.data()
    grads, loss = naive_step(params, x, target)
    ref = (float(loss), float(grads[0]["w"].norm()))

    naive = seconds_per_call(lambda: naive_step(params, x, target), repeat)
    rows = [row(1, 1, "naive-1", "whole batch", naive, 1.0, 1.0, "ok")]
    notes = []
    unrun = [k for k in (1, 2, 4, 8) if k > cores and k not in args.workers]
    if unrun:
        notes.append(f"K = {', '.join(map(str, unrun))} not run: this machine has {cores} "
                     f"cores (pass --workers to run them; their rows are then marked "
                     f"oversubscribed and are not scaling figures)")
    # The quick mode spawns ranks for one K only (the largest), to stay under a minute.
    spawned = [] if args.no_distributed else \
        [max(args.workers)] if args.quick else list(args.workers)
    rounds = args.rounds or (1 if args.quick else 3)
    for k in args.workers:
        over = f"oversubscribed: {k} workers on {cores} cores" if k > cores else ""
        if k > 1 and not args.only_distributed:
            def copies(k=k):
                threads = [threading.Thread(target=naive_step, args=(params, x, target))
                           for _ in range(k)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            t = seconds_per_call(copies, repeat)
            rows.append(row(k, 1, f"{k} x naive-1", "copies at once", t, k * naive / t,
                            float(k), "", over))
        if k == 1 and not args.only_distributed:
            for m in chunks_list:
                def micro_batched(m=m):
                    for xm, tm in zip(x.tensor_split(m), target.tensor_split(m)):
                        naive_step(params, xm, tm)
                t = seconds_per_call(micro_batched, repeat)
                rows.append(row(1, m, "naive-1", f"{m} micro-batches in a loop", t, naive / t,
                                1.0))
        local = [] if args.only_distributed else \
            [(m, name, schedule, n) for m in chunks_list
             for name, schedule, n in fpipe_schedules(m, k)]
        jobs = distributed_jobs(model, chunks_list, k, repeat) if k in spawned else []
        runnable = [job for *_, job in jobs if job is not None]
        # Round by round: every local row, then every spawned job, so that a slow phase of
        # the machine falls on the local and the distributed rows alike.
        measured: dict = {}  # (m, name) -> each round's (seconds, result) or the error
        by_round: list = []  # each round's ranks' results of the spawned jobs
        for _ in range(rounds):
            for m, name, schedule, n in local:
                if isinstance(measured.get((m, name)), Exception):
                    continue
                try:
                    measured.setdefault((m, name), []).append(
                        time_local(schedule, n, params, x, target, repeat))
                except Exception as exc:  # noqa: BLE001 - a failing schedule is a row
                    measured[m, name] = exc
            if runnable:
                by_round.append(spawn_ranks(partial(run_jobs, strict=args.quick), k, runnable,
                                            timeout=120 if args.quick else 1800,
                                            strict=args.quick))
        for m, name, _, _ in local:
            bound = k * m / (m + k - 1)
            got = measured[m, name]
            if isinstance(got, Exception):
                rows.append(row(k, m, "fpipe local", name, None, None, bound, "failed",
                                f"{type(got).__name__}: {got}"[:200]))
                continue
            t, spread = _median_round([seconds for seconds, _ in got])
            rows.append(row(k, m, "fpipe local", name, t, naive / t, bound,
                            check(got[0][1], *ref), "; ".join(filter(None, (over, spread)))))
        for driver, name, m, job in jobs:
            bound = k * m / (m + k - 1)
            if job is None:
                rows.append(row(k, m, driver, name, None, None, bound, "not run",
                                TORCH_PIPELINING_MISSING or ""))
                continue
            j = runnable.index(job)
            merged = [merge_ranks([r if r is None or isinstance(r, dict) else r[j]
                                   for r in results]) for results in by_round]
            failed = next((result for result in merged if "error" in result), None)
            if failed is not None:
                rows.append(row(k, m, driver, name, None, None, bound, "failed",
                                failed["error"].strip().splitlines()[-1][:200]))
                continue
            t, spread = _median_round([result["seconds"] for result in merged])
            rows.append(row(k, m, driver, name, t, naive / t, bound,
                            check(merged[0], *ref), "; ".join(filter(None, (over, spread)))))
    report(f"CPU pipeline scaling ({model.layers} blocks of width {model.width}, batch "
           f"{model.batch}, 1 intra-op thread per worker)", COLUMNS, rows, args.json, notes)


if __name__ == "__main__":
    main()
