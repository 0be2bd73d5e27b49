"""Peak memory of a training step per schedule, and the largest model that trains in a budget.

    python benchmarks/memory.py [--quick] [--json PATH] [--workers K] [--chunks M]
        [--budget-mb MB] [--no-distributed]

The model is a stack of residual blocks ``x + tanh(x @ w) @ v`` (benchmarks/residual.py),
narrow and with a large batch, so that activations, not parameters, take the memory.

First table: one training step (``value_and_grad``, gradients included) of the same model with
naive-1 (plain ``torch.func`` on the whole batch: ``vjp`` with its backward run without grad
mode, and ``grad_and_value``, which differentiates with ``create_graph=True``), GPipe with each
remat policy, 1F1B and every other schedule ``fpipe.schedules`` exports, over K workers and M
micro-batches.
- *total_MB*: the peak of the whole step with fpipe's local driver, all K worker threads in one
  process, so all K workers' memory together (naive: the one thread).
- *per_worker_MB*: the same step with ``fpipe.distributed``, one process per worker (gloo on
  127.0.0.1), each measuring its own peak; the largest of the K. On CUDA with K devices, the
  largest per-device peak of the local driver instead.
- *sim_full* / *sim_live*: what ``fpipe.schedules.simulate`` predicts from the program alone:
  the most (stage, micro-batch) pairs one worker holds with full activations / alive at all
  (a pair to be recomputed holds only its input).
- *sim_total_MB* / *sim_per_worker_MB*: ``simulate(program, memory=...)``'s peak bytes (summed
  over the workers / the largest worker), from each stage's activation bytes measured by
  ``fpipe.timeline.stage_memory`` on one micro-batch and the gradients' bytes (the parameters
  exist before the step, so neither side counts them); a backward's workspace is taken to be
  as large as its stage's activations (the gradients of what it saved).

Second table ("largest model in a budget", after torchgpipe's AmoebaNet-D memory table): the
most layers of the same width that train in ``--budget-mb`` megabytes, found by doubling then
bisection: naive-1; pipeline-1, GPipe over M micro-batches with remat "always" on one worker;
pipeline-K, the same over K workers, where the budget holds for each worker's own peak (so the
K workers together may use up to K budgets, as K GPUs would). A trial's memory is its
parameters' bytes plus the step's measured peak (gradients and activations); the batch is not
counted.

How memory is measured. On CUDA: ``torch.cuda.max_memory_allocated`` per device, reset before
the step, minus what was allocated before it. On the CPU: the process's peak resident set during
the step (``VmHWM`` in /proc/self/status, reset by writing 5 to /proc/self/clear_refs) minus its
resident set just before. For that to follow the live tensors, the script re-executes itself
with ``MALLOC_MMAP_THRESHOLD_=4096`` (glibc maps every allocation of 4 KiB or more on its own
and unmaps it when freed, instead of keeping it in a heap where a freed block stays resident)
and calls ``malloc_trim(0)`` before each measurement (freed heap pages go back to the system).
With glibc's default 64 KiB-and-rising threshold, or 64 KiB fixed, small micro-batches' tensors
land in the heap and the same step measured up to 60% more after other configurations had
fragmented it. torch.profiler's memory events are
not used: with fpipe's worker threads they are missing (``profile_all_threads`` records those
threads' ops but not their allocations in torch 2.13), so they would undercount every pipelined
row. The CPU has one memory, so "per worker" needs one process per worker: that is what the
distributed driver gives.
"""

# ruff: noqa: E402 - the imports follow the re-execution below, which must come first.

from __future__ import annotations

import os
import sys

MMAP_THRESHOLD = "4096"

if __name__ == "__main__" and sys.platform == "linux" \
        and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
    # glibc reads this at start-up only; the spawned ranks inherit it.
    os.execve(sys.executable, [sys.executable, *sys.argv],
              dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD))

import ctypes
import gc
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from common import parser, report, run_jobs, spawn_ranks
from residual import (
    Model,
    distributed_step,
    fpipe_schedules,
    loss_fn,
    naive_step,
    split,
    stage,
    whole_loss,
)
from torch.func import grad_and_value

import fpipe
from fpipe.schedules import gpipe, one_f_one_b, simulate
from fpipe.timeline import stage_memory

MB = 1e6


# -- measuring -----------------------------------------------------------------------------------


class CpuMeter:
    """``with meter: ...`` leaves in ``meter.peak`` the growth of the process's resident set
    over the block, at its highest (bytes)."""

    def __init__(self) -> None:
        if sys.platform != "linux":
            raise RuntimeError("measuring CPU memory needs Linux (/proc/self/clear_refs)")
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
            raise RuntimeError(f"run with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (the script "
                               f"sets it by re-executing itself)")
        self.libc = ctypes.CDLL("libc.so.6")
        self.peak = 0
        self._base = 0
        self._reset_peak()  # fails here, not mid-run, where clear_refs is not writable

    def __enter__(self) -> CpuMeter:
        gc.collect()
        self.libc.malloc_trim(0)
        self._base = _status("VmRSS")
        self._reset_peak()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = _status("VmHWM") - self._base

    @staticmethod
    def _reset_peak() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


class CudaMeter:
    """``with meter: ...`` leaves in ``meter.peaks`` each device's peak allocation over the
    block, above what it held before, and in ``meter.peak`` the sum over the devices."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = sorted(set(devices), key=str)
        self.peaks: dict[torch.device, int] = {}
        self.peak = 0
        self._base: dict[torch.device, int] = {}

    def __enter__(self) -> CudaMeter:
        for d in self.devices:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
            self._base[d] = torch.cuda.memory_allocated(d)
        return self

    def __exit__(self, *exc: object) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)
        self.peaks = {d: torch.cuda.max_memory_allocated(d) - self._base[d]
                      for d in self.devices}
        self.peak = sum(self.peaks.values())


def to(params: list, device: torch.device) -> list:
    return [{k: v.to(device) for k, v in p.items()} for p in params]


def tree_bytes(tree: list) -> int:
    return sum(v.numel() * v.element_size() for p in tree for v in p.values())


# -- the largest model in a budget ---------------------------------------------------------------


def largest(peak_of: Callable[[int], float], start: int, budget: float, tol: float,
            most: int = 1 << 16) -> tuple[int, float | None, list]:
    """The most layers ``n`` with ``peak_of(n) <= budget``: from ``start``, doubling while it
    fits (or halving the bracket below it while it does not), then bisection until the
    bracket is within ``tol`` of its low end or one layer wide. Returns it (0 if not even
    one layer fits), its peak and every (layers, peak) tried."""
    lo, hi, lo_peak, tried = 0, None, None, []
    n = max(1, start)
    while n <= most:
        peak = peak_of(n)
        tried.append((n, peak))
        if peak <= budget:
            lo, lo_peak = n, peak
        else:
            hi = n
        if hi is None:
            n *= 2
        elif hi - lo <= max(1, int(lo * tol)):
            break
        else:
            n = (lo + hi) // 2
    return lo, lo_peak, tried


def local_peak(width: int, batch: int, chunks: int | None, devices: list[torch.device],
               layers: int) -> float:
    """The most any one device holds over one training step of ``layers`` blocks: its
    parameters' bytes plus its measured peak. Naive on ``devices[0]`` when ``chunks`` is None,
    else GPipe over ``chunks`` with remat "always", stage s on ``devices[s]`` (one worker per
    stage, in this process: on the CPU only one stage, since the workers' memory would mix)."""
    n = len(devices)
    layers = max(layers, n)
    model = Model(layers, width, batch)
    params = [to(ps, d) for ps, d in zip(split(model.params(), n), devices)]
    x, t = model.data()
    x, t = x.to(devices[0]), t.to(devices[-1])
    cuda = devices[0].type == "cuda"
    meter = CudaMeter(devices) if cuda else CpuMeter()
    if chunks is None:
        with meter:
            naive_step(params[0], x, t)
    else:
        with fpipe.pipeline([stage] * n, params, schedule=gpipe(chunks, remat="always"),
                            loss_fn=loss_fn) as pipe:
            with meter:
                pipe.value_and_grad(x, t)
    if not cuda:
        return tree_bytes(params[0]) + meter.peak
    return max(tree_bytes(ps) + meter.peaks[d] for ps, d in zip(params, devices))


def budget_job(rank: int, world: int, group, width: int, batch: int, chunks: int,
               budget: float, tol: float, start: int) -> dict:
    """Rank-side: the largest pipeline-K model whose every rank's peak stays in ``budget``."""
    import torch.distributed as dist

    import fpipe.distributed as fdist

    meter = CpuMeter()

    def peak_of(layers: int) -> float:
        layers = max(layers, world)
        model = Model(layers, width, batch)
        mine = split(model.params(), world)[rank]
        x, t = model.data()
        pipe = fdist.pipeline([stage] * world, {rank: mine},
                              schedule=gpipe(chunks, remat="always"), loss_fn=loss_fn,
                              timeout=300)
        dist.barrier(group=group)
        with meter:
            pipe.value_and_grad(x if rank == 0 else None, t if rank == world - 1 else None)
        peak = torch.tensor([float(tree_bytes(mine) + meter.peak)], dtype=torch.float64)
        dist.all_reduce(peak, dist.ReduceOp.MAX, group=group)
        return peak.item()

    peak_of(world)  # warm-up: the first step of a process allocates for good
    layers, peak, tried = largest(peak_of, start, budget, tol)
    return {"layers": layers, "peak": peak, "tried": tried}


# -- peak per schedule ---------------------------------------------------------------------------


def schedules(chunks: int, workers: int) -> list[tuple[str, object, int]]:
    """GPipe with each remat policy, 1F1B, then whatever else fpipe.schedules exports."""
    found = [(repr(s), s, workers) for s in (
        gpipe(chunks, remat="always"), gpipe(chunks, remat="except_last"),
        gpipe(chunks, remat="never"), one_f_one_b(chunks))]
    return found + fpipe_schedules(chunks, workers)[2:]


def memory_job(rank: int, world: int, group, model: Model, schedule, n_stages: int) -> dict:
    """Rank-side: this rank's peak over one step of ``fpipe.distributed`` (after a warm-up)."""
    import torch.distributed as dist

    meter = CpuMeter()
    step = distributed_step(rank, model, schedule, n_stages, timeout=120)
    step()
    dist.barrier(group=group)
    with meter:
        step()
    return {"peak": meter.peak}


def main() -> None:
    cores = os.cpu_count() or 1
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=min(2, cores), help="K (default 2)")
    p.add_argument("--chunks", type=int, default=8, help="M (default 8)")
    p.add_argument("--budget-mb", type=float, help="the budget (default 128; 8 in quick)")
    p.add_argument("--model", type=int, nargs=3, metavar=("LAYERS", "WIDTH", "BATCH"),
                   help="another model size than the mode's")
    p.add_argument("--no-distributed", action="store_true",
                   help="no spawned ranks: no per-worker column, no pipeline-K row on CPU")
    args = p.parse_args()
    torch.set_num_threads(1)
    gc.freeze()  # what the imports made: each meter's collection skips it
    k, m = args.workers, args.chunks
    cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if cuda else 0
    notes = []
    if k > cores:
        notes.append(f"{k} workers on {cores} cores: oversubscribed (memory is still right, "
                     f"but slow)")
    model = Model(*(args.model or ((8, 64, 512) if args.quick else (16, 256, 4096))))
    params = model.params()
    x, target = model.data()

    def devices_for(n_stages: int, placement: tuple[int, ...] | None = None,
                    n_workers: int | None = None) -> list[torch.device]:
        """Stage s on the device of its worker (of ``placement``), workers spread over the
        GPUs there are; all on the CPU without CUDA."""
        if not cuda:
            return [torch.device("cpu")] * n_stages
        placement = placement or tuple(range(n_stages))
        n_workers = n_workers or n_stages
        return [torch.device("cuda", w * n_gpus // n_workers) for w in placement]

    def meter_for(devices: list[torch.device]):
        return CudaMeter(devices) if cuda else CpuMeter()

    # -- peak per schedule
    device0 = devices_for(1)[0]
    p0, x0, t0 = to(params, device0), x.to(device0), target.to(device0)
    rows = []
    for name, naive in (("naive-1: torch.func.vjp, whole batch", naive_step),
                        ("naive-1: torch.func.grad_and_value", grad_and_value(whole_loss))):
        naive(p0, x0, t0)  # warm-up
        with meter_for([device0]) as meter:
            naive(p0, x0, t0)
        rows.append({"schedule": name, "K": 1, "total_MB": meter.peak / MB,
                     "per_worker_MB": meter.peak / MB, "sim_full": None, "sim_live": None,
                     "sim_total_MB": None, "sim_per_worker_MB": None})
    del p0
    configs = schedules(m, k)
    for name, schedule, n_stages in configs:
        program = schedule.program(n_stages)
        devices = devices_for(n_stages, program.placement, program.n_workers)
        stage_params = [to(ps, d) for ps, d in zip(split(params, n_stages), devices)]
        # Bytes: activations measured by one profiling call on a micro-batch; the parameters
        # are there before the step (not in its peak), their gradients are made during it.
        measured = stage_memory([stage] * n_stages, split(params, n_stages),
                                x[: -(-model.batch // m)])
        sim = simulate(program, memory=replace(measured, parameters=0.0,
                                               gradients=measured.parameters,
                                               workspace=measured.activations))
        with fpipe.pipeline([stage] * n_stages, stage_params, schedule=schedule,
                            loss_fn=loss_fn) as pipe:
            xd, td = x.to(devices[0]), target.to(devices[-1])
            pipe.value_and_grad(xd, td)  # warm-up: threads started, first calls made
            with meter_for(devices) as meter:
                pipe.value_and_grad(xd, td)
        per_worker = None
        if cuda and n_gpus >= k:
            per_worker = max(meter.peaks.values()) / MB
        rows.append({"schedule": name, "K": k, "total_MB": meter.peak / MB,
                     "per_worker_MB": per_worker, "sim_full": max(sim.peak_full_activations),
                     "sim_live": max(sim.peak_activations),
                     "sim_total_MB": sum(sim.peak_bytes) / MB,
                     "sim_per_worker_MB": max(sim.peak_bytes) / MB})
    # -- the largest model in a budget
    budget = (args.budget_mb or (8 if args.quick else 128)) * MB
    width, batch = (64, 512) if args.quick else (128, 2048)
    tol = 0.25 if args.quick else 0.03
    local_peak(width, batch, m, [device0], 2)  # warm-up
    budget_rows = []
    start = 4
    for what, chunks in (("naive-1", None), (f"pipeline-1 (GPipe, M={m}, remat always)", m)):
        layers, peak, _ = largest(partial(local_peak, width, batch, chunks, [device0]), start,
                                  budget, tol)
        budget_rows.append({"what": what, "layers": layers,
                            "peak_MB": None if peak is None else peak / MB})
        start = max(layers, 1)
    pipelined = f"pipeline-{k} (GPipe, M={m}, remat always, per-worker peak)"
    if cuda and n_gpus >= k and k > 1:
        layers, peak, _ = largest(partial(local_peak, width, batch, m, devices_for(k)), start,
                                  budget, tol)
        budget_rows.append({"what": pipelined, "layers": layers,
                            "peak_MB": None if peak is None else peak / MB})
    elif cuda and k > 1:
        notes.append(f"{pipelined} needs {k} GPUs; this machine has {n_gpus}")

    # -- one process per worker (CPU): per-worker peaks, and pipeline-K in the budget
    if not cuda and not args.no_distributed:
        jobs = [partial(memory_job, model=model, schedule=s, n_stages=n) for _, s, n in configs]
        if k > 1:
            jobs.append(partial(budget_job, width=width, batch=batch, chunks=m, budget=budget,
                                tol=tol, start=start))
        results = spawn_ranks(partial(run_jobs, strict=args.quick), k, jobs,
                              timeout=120 if args.quick else 3600, strict=args.quick)
        per_job = [[res if res is None or isinstance(res, dict) else res[j] for res in results]
                   for j in range(len(jobs))]
        for what, per_rank in zip([r["schedule"] for r in rows[2:]] + [pipelined], per_job):
            if any(res is None or "error" in res for res in per_rank):
                failed = next((res["error"] for res in per_rank if res and "error" in res),
                              "a rank died or timed out")
                notes.append(f"{what} failed: {failed.strip().splitlines()[-1]}")
            elif what == pipelined:
                result = per_rank[0]
                budget_rows.append({"what": pipelined, "layers": result["layers"],
                                    "peak_MB": None if result["peak"] is None
                                    else result["peak"] / MB})
            else:
                row = next(r for r in rows if r["schedule"] == what)
                row["per_worker_MB"] = max(res["peak"] for res in per_rank) / MB
    elif cuda and n_gpus < k:
        notes.append(f"per_worker_MB needs {k} GPUs (this machine has {n_gpus}): total_MB is "
                     f"all {k} workers on the GPUs there are")
    naive_layers = budget_rows[0]["layers"]
    for r in budget_rows:
        r["x_naive"] = r["layers"] / naive_layers if naive_layers else None

    method = ("torch.cuda.max_memory_allocated per device" if cuda else
              "peak resident set growth (VmHWM after clear_refs), glibc "
              f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}, malloc_trim before each step")
    notes.append(f"memory: {method}; MB = 10^6 bytes")
    notes.append(f"budget table: blocks of width {width}, batch {batch}, budget "
                 f"{budget / MB:g} MB; bisection to within {tol:.0%}; a trial counts its "
                 f"parameters' bytes plus the step's measured peak")
    report(f"Peak memory of one training step ({model.layers} blocks of width {model.width}, "
           f"batch {model.batch}, K={k} workers, M={m} micro-batches)",
           ["schedule", "K", "total_MB", "sim_total_MB", "per_worker_MB", "sim_per_worker_MB",
            "sim_full", "sim_live"], rows,
           args.json, notes, tables={f"Largest model in {budget / MB:g} MB": budget_rows})


if __name__ == "__main__":
    main()
