"""fpipe.distributed 1F1B against torch.distributed.pipelining's Schedule1F1B on 2 ranks.

    python benchmarks/transformer_ranks.py [--quick] [--json PATH] [--batch 16 256]
        [--pairs N]

A small transformer (an embedding of 256 tokens into width 64, 4 x
``nn.TransformerEncoderLayer(64, 4, 128, dropout=0, batch_first=True)``, a linear head back to
the 256 tokens; sequences of 32), cut in two stages (embedding and layers 0-1; layers 2-3 and the
head), one per rank (gloo on 127.0.0.1, one process per rank, one intra-op thread each, set
explicitly), 4 micro-batches, the cross-entropy of the next token as the loss of both. fpipe runs
the stages that ``fpipe.stages.from_modules`` makes of the two parts, under
``fpipe.schedules.one_f_one_b(4)``; torch runs the same parts as ``PipelineStage``s under
``Schedule1F1B``. Both start from the same parameters and batch (fixed seeds).

At a small batch each action is little arithmetic, so the host's work per action decides; at a
large one the kernels do. **The two libraries alternate step by step** in the same two
processes (A, B, B, A, A, B ...: each pair's order alternates too), every step timed from a
barrier to a barrier after two warm-up steps of each: a shared machine's slow seconds then
fall on both alike, where rounds of ten steps of one library and then the other gave ratios
from 0.6 to 1.7 on this 2-core machine. *step_ms* is a library's median step with its
interquartile range; *fpipe/torch* is the median over ``--pairs`` pairs of the pair's ratio,
with its interquartile range. *host_ms* is each rank's host time per step (rank 0/rank 1): the
CPU time of its main thread, median over steps (see ``_host``). *check* compares the two
libraries' loss of the first step (relative 1e-5).
"""

from __future__ import annotations

import time
from functools import partial

import torch
from common import parser, report, run_jobs, spawn_ranks
from residual import TORCH_PIPELINING_MISSING
from torch import nn

VOCAB, SEQ, WIDTH, CHUNKS, WORLD = 256, 32, 64, 4, 2
LIBRARIES = ("fpipe.distributed one_f_one_b", "torch Schedule1F1B")

COLUMNS = ["batch", "row", "step_ms", "iqr_ms", "fpipe/torch", "ratio_iqr", "host_ms",
           "check"]


def parts(seed: int = 0) -> list[nn.Module]:
    """The model's two stages, built alike on every rank from ``seed``."""
    torch.manual_seed(seed)
    layers = [nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
              for _ in range(4)]
    return [nn.Sequential(nn.Embedding(VOCAB, WIDTH), *layers[:2]),
            nn.Sequential(*layers[2:], nn.Linear(WIDTH, VOCAB))]


def data(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their next tokens (the target)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def fpipe_step(rank: int, group, batch: int):
    """fpipe.distributed's 1F1B on this rank's stage: one step, returning the loss on the rank
    of the last stage."""
    import fpipe.distributed as fdist
    import fpipe.schedules
    import fpipe.stages

    schedule = fpipe.schedules.one_f_one_b(CHUNKS)
    held = fdist.my_stages(schedule, WORLD)
    s = fpipe.stages.from_modules(parts(), held=held)
    pipe = fdist.pipeline(s.stages, {i: s.params[i] for i in held}, schedule=schedule,
                          loss_fn=loss_fn, timeout=120, group=group)
    x, t = data(batch)

    def step():
        loss, _ = pipe.value_and_grad(x if rank == 0 else None, t if rank == WORLD - 1 else None)
        return loss if rank == WORLD - 1 else None

    return step


def torch_step(rank: int, group, batch: int):
    """torch.distributed.pipelining's Schedule1F1B on this rank's stage: one step, returning
    the mean loss on the rank of the last stage."""
    import torch.distributed.pipelining as pipelining

    module = parts()[rank]
    micro = batch // CHUNKS
    example = (torch.zeros(micro, SEQ, dtype=torch.long) if rank == 0
               else torch.empty(micro, SEQ, WIDTH, requires_grad=True))
    stage = pipelining.PipelineStage(module, rank, WORLD, torch.device("cpu"),
                                     input_args=(example,), group=group)
    schedule = pipelining.Schedule1F1B(stage, CHUNKS, loss_fn=loss_fn)
    x, t = data(batch)
    losses: list = []

    def step():
        for p in module.parameters():
            p.grad = None
        losses.clear()
        if rank == 0:
            schedule.step(x)
            return None
        schedule.step(target=t, losses=losses)
        return torch.stack(losses).detach().mean()

    return step


def _host(step, group) -> tuple[float, float, object]:
    """One step from a barrier to a barrier: its wall seconds (until the slowest rank is
    done), this rank's host time (the CPU time of its main thread, which runs every action and
    posts every message: the most of a small batch's step), and what it returned."""
    import torch.distributed as dist

    dist.barrier(group=group)
    start, cpu = time.perf_counter(), time.thread_time()
    out = step()
    host = time.thread_time() - cpu
    dist.barrier(group=group)
    return time.perf_counter() - start, host, out


def pairs_job(rank: int, world: int, group, batch: int, pairs: int) -> dict:
    """Both libraries on this rank, alternating step by step (see the module's docstring)."""
    torch.set_num_threads(1)
    steps = (fpipe_step(rank, group, batch), torch_step(rank, group, batch))
    first = [_host(step, group)[2] for step in steps]
    for _ in range(2):
        for step in steps:
            _host(step, group)
    seconds: list[list[float]] = [[], []]
    host: list[list[float]] = [[], []]
    for i in range(pairs):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            wall, cpu, _ = _host(steps[which], group)
            seconds[which].append(wall)
            host[which].append(cpu)
    return {"seconds": seconds, "host": host,
            "loss": [None if out is None else float(out) for out in first]}


def _check(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "no loss"
    return "ok" if abs(a - b) <= 1e-5 * abs(b) else f"loss {a:.6g} != {b:.6g}"


def _quartiles(values: list[float], scale: float = 1.0) -> tuple[float, float, float]:
    values = sorted(v * scale for v in values)
    n = len(values)
    return values[n // 4], values[n // 2], values[(3 * n) // 4]


def _rows(batch: int, ranks: list) -> list[dict]:
    failed = next((r for r in ranks if r is None or "error" in r), False)
    if failed is not False:
        error = "a rank timed out" if failed is None else failed["error"]
        error = error.strip().splitlines()[-1][:200]
        return [{"batch": batch, "row": name, "check": f"failed: {error}"} for name in LIBRARIES]
    seconds = ranks[0]["seconds"]  # every rank's steps end at the same barrier
    losses = [next((r["loss"][k] for r in ranks if r["loss"][k] is not None), None)
              for k in range(2)]
    low, ratio, high = _quartiles([f / t for f, t in zip(*seconds)])
    rows = []
    for k, name in enumerate(LIBRARIES):
        q1, ms, q3 = _quartiles(seconds[k], 1e3)
        host = "/".join(f"{_quartiles(r['host'][k], 1e3)[1]:.3g}" for r in ranks)
        rows.append({"batch": batch, "row": name, "step_ms": round(ms, 2),
                     "iqr_ms": f"{q1:.3g}-{q3:.3g}", "fpipe/torch": round(ratio, 3),
                     "ratio_iqr": f"{low:.3f}-{high:.3f}", "host_ms": host,
                     "check": _check(*losses)})
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[16, 256])
    p.add_argument("--pairs", type=int,
                   help="timed pairs of steps per batch (200 at batch 16, 40 at 256; 2 with "
                        "--quick)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if TORCH_PIPELINING_MISSING:
        report("fpipe.distributed 1F1B against Schedule1F1B", COLUMNS,
               [{"batch": b, "row": LIBRARIES[1], "check": "not run"}
                for b in args.batch], args.json, [TORCH_PIPELINING_MISSING])
        return

    def pairs(batch: int) -> int:
        return args.pairs or (2 if args.quick else 200 if batch <= 64 else 40)

    jobs = [partial(pairs_job, batch=b, pairs=pairs(b)) for b in args.batch]
    results = spawn_ranks(partial(run_jobs, timeout=120, strict=args.quick), WORLD, jobs,
                          timeout=120 if args.quick else 1200, strict=args.quick)
    rows = []
    for j, batch in enumerate(args.batch):
        rows += _rows(batch, [r if r is None or isinstance(r, dict) else r[j] for r in results])
    report(f"fpipe.distributed 1F1B against torch Schedule1F1B: a transformer (embedding, 4 x "
           f"TransformerEncoderLayer({WIDTH}), head; sequence {SEQ}), {WORLD} ranks, gloo, "
           f"{CHUNKS} micro-batches, 1 intra-op thread per rank", COLUMNS, rows, args.json,
           ["the two libraries alternate step by step in the same ranks; step_ms: median step "
            "(iqr_ms: its interquartile range); fpipe/torch: median over pairs of the pair's "
            "ratio (ratio_iqr: its interquartile range); host_ms: median main-thread CPU time "
            "per step, rank 0/rank 1"])


if __name__ == "__main__":
    main()
