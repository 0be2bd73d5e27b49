"""The host's time in one rank's step: fpipe.distributed 1F1B against Schedule1F1B, on a model
too small for its arithmetic to matter.

    python benchmarks/rank_host.py [--quick] [--json PATH] [--rounds R] [--steps N]

Two stages of one ``nn.Linear(8, 8)``, one per rank (gloo on 127.0.0.1, one process per rank,
one intra-op thread each), a batch of 16 in 4 micro-batches, the mean squared error: each
action is a few microseconds of arithmetic, so what a step costs is the library's own work on
the host (handling actions, posting messages, agreeing with the other rank). *host_us* is the
CPU time of a rank's main thread per step (the thread that runs every action and posts every
message): unlike wall time it hardly moves with what else runs on the machine. fpipe's is also
split by phase: the header (posted, and agreed before the first action on every rank but stage
0's, which agrees it at its first message), the step's set-up (micro-batches and the channel),
the actions (with the receives and the loss broadcast they post), the end of the step (sends
completed, the loss received) and the rest of the call. Rows are interleaved (fpipe, torch,
every round); each figure is the median over rounds of a round's mean over ``--steps`` steps,
with the rounds' range for the whole step.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from common import parser, report, run_jobs, spawn_ranks
from residual import TORCH_PIPELINING_MISSING
from torch import nn

BATCH, CHUNKS, WIDTH, WORLD = 16, 4, 8, 2
PHASES = ("header", "set-up", "actions", "end", "rest")
COLUMNS = ["row", "rank", "host_us", "rounds_us", *PHASES]


def parts() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH)) for _ in range(WORLD)]


def loss_fn(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _phased() -> dict[str, float]:
    """Each of fpipe's phases timed (this thread's CPU time) into the returned dict: the rank
    driver's and the interpreter's methods wrapped for this process, which runs nothing else."""
    from fpipe._runtime.interpreter import Interpreter
    from fpipe._runtime.ranks.driver import RankDriver

    spent = dict.fromkeys(PHASES[:4], 0.0)

    def timing(run, phase: str):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                spent[phase] += time.thread_time() - start
        return timed

    for cls, name, phase in ((RankDriver, "agreed", "header"), (RankDriver, "new_step", "set-up"),
                             (Interpreter, "run", "actions"), (RankDriver, "finish", "end")):
        setattr(cls, name, timing(getattr(cls, name), phase))
    return spent


def fpipe_job(rank: int, world: int, group, steps: int) -> dict:
    import fpipe.distributed as fdist
    import fpipe.schedules
    import fpipe.stages

    torch.set_num_threads(1)
    spent = _phased()
    schedule = fpipe.schedules.one_f_one_b(CHUNKS)
    held = fdist.my_stages(schedule, WORLD)
    s = fpipe.stages.from_modules(parts(), held=held)
    pipe = fdist.pipeline(s.stages, {i: s.params[i] for i in held}, schedule=schedule,
                          loss_fn=loss_fn, timeout=120, group=group)
    x, target = _data()
    result = _timed(lambda: pipe.value_and_grad(x if rank == 0 else None,
                                                target if rank == WORLD - 1 else None),
                    group, steps, spent)
    pipe.close()
    return result


def torch_job(rank: int, world: int, group, steps: int) -> dict:
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    module = parts()[rank]
    example = torch.empty(BATCH // CHUNKS, WIDTH, requires_grad=rank > 0)
    stage = pipelining.PipelineStage(module, rank, WORLD, torch.device("cpu"),
                                     input_args=(example,), group=group)
    schedule = pipelining.Schedule1F1B(stage, CHUNKS, loss_fn=loss_fn)
    x, target = _data()

    def step() -> None:
        for p in module.parameters():
            p.grad = None
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=[])
    return _timed(step, group, steps, None)


def _timed(step, group, steps: int, spent: dict | None) -> dict:
    """This thread's CPU time per step over ``steps`` steps (after 5 warm-up steps), and per
    phase where ``spent`` collects them."""
    import torch.distributed as dist

    for _ in range(5):
        step()
    if spent is not None:
        spent.update(dict.fromkeys(spent, 0.0))
    dist.barrier(group=group)
    start = time.thread_time()
    for _ in range(steps):
        step()
    total = (time.thread_time() - start) / steps
    out = {"host": total}
    if spent is not None:
        out.update({phase: value / steps for phase, value in spent.items()})
        out["rest"] = total - sum(spent.values()) / steps
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, help="rounds (5; 1 with --quick)")
    p.add_argument("--steps", type=int, help="steps per row and round (300; 20 with --quick)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (20 if args.quick else 300)
    title = (f"host time per step of one rank: 1F1B on {WORLD} ranks (gloo), "
             f"2 x Linear({WIDTH}, {WIDTH}), batch {BATCH} in {CHUNKS} micro-batches")
    if TORCH_PIPELINING_MISSING:
        jobs = {"fpipe.distributed one_f_one_b": fpipe_job}
    else:
        jobs = {"fpipe.distributed one_f_one_b": fpipe_job, "torch Schedule1F1B": torch_job}
    one_round = [partial(job, steps=steps) for job in jobs.values()]
    results = spawn_ranks(partial(run_jobs, timeout=120, strict=args.quick), WORLD,
                          one_round * rounds, timeout=120 if args.quick else 600,
                          strict=args.quick)
    rows = []
    for i, name in enumerate(jobs):
        for rank, runs in enumerate(results):
            if not isinstance(runs, list):  # the rank failed or timed out as a whole
                rows.append({"row": name, "rank": rank,
                             "host_us": "failed" if runs is None else runs["error"][-120:]})
                continue
            mine = [runs[k * len(jobs) + i] for k in range(rounds)]
            failed = next((r for r in mine if "error" in r), None)
            if failed is not None:
                rows.append({"row": name, "rank": rank, "host_us": failed["error"][-120:]})
                continue
            host = [r["host"] * 1e6 for r in mine]
            row = {"row": name, "rank": rank, "host_us": round(_median(host)),
                   "rounds_us": f"{min(host):.0f}-{max(host):.0f}"}
            for phase in PHASES:
                if phase in mine[0]:
                    row[phase] = round(_median([r[phase] * 1e6 for r in mine]))
            rows.append(row)
    notes = [f"{rounds} rounds of {steps} steps, rows interleaved; host_us: the main thread's "
             f"CPU time per step, median over rounds (range: min-max over rounds); the phases "
             f"(fpipe only) in us, medians over rounds"]
    if TORCH_PIPELINING_MISSING:
        notes.append(TORCH_PIPELINING_MISSING)
    report(title, COLUMNS, rows, args.json, notes)


if __name__ == "__main__":
    main()
