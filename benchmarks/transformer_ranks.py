"""fpipe.distributed 1F1B against torch.distributed.pipelining's Schedule1F1B on 2 ranks.

    python benchmarks/transformer_ranks.py [--quick] [--json PATH] [--batch 16 256]
        [--rounds R] [--steps N]

A small transformer (an embedding of 256 tokens into width 64, 4 x
``nn.TransformerEncoderLayer(64, 4, 128, dropout=0, batch_first=True)``, a linear head back to
the 256 tokens; sequences of 32), cut in two stages (embedding and layers 0-1; layers 2-3 and the
head), one per rank (gloo on 127.0.0.1, one process per rank, one intra-op thread each, set
explicitly), 4 micro-batches, the cross-entropy of the next token as the loss of both. fpipe runs
the stages that ``fpipe.stages.from_modules`` makes of the two parts, under
``fpipe.schedules.one_f_one_b(4)``; torch runs the same parts as ``PipelineStage``s under
``Schedule1F1B``. Both start from the same parameters and batch (fixed seeds).

At a small batch each action is little arithmetic, so the host's work per action decides; at a
large one the kernels do. Rows are interleaved: every round runs fpipe then torch at each batch
(A, B, A, B ...), each ``--steps`` timed steps (from a barrier to a barrier) after two warm-up
steps; a row's step_ms is the median over rounds of each round's median step, with the rounds'
range, and *fpipe/torch* is the median over rounds of that round's ratio, with its range.
*host_ms* is each rank's host time per step (rank 0/rank 1): the CPU time of its main thread,
median over rounds (see ``_timed``). *check* compares the two libraries' loss of the first step
(relative 1e-5).
"""

from __future__ import annotations

import time
from functools import partial

import torch
from common import parser, report, run_jobs, spawn_ranks, timed_steps
from residual import TORCH_PIPELINING_MISSING, merge_ranks
from torch import nn

VOCAB, SEQ, WIDTH, CHUNKS, WORLD = 256, 32, 64, 4, 2

COLUMNS = ["batch", "row", "step_ms", "rounds_ms", "fpipe/torch", "ratio_rounds", "host_ms",
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


def _timed(rank: int, group, step, steps: int) -> dict:
    """The first step's loss (from the rank that has it), the median of ``steps`` more, and
    the host time per step: the CPU time of this rank's main thread (which runs every action
    and posts every message), the most of a small batch's step and, unlike wall time, hardly
    moved by what else runs on the machine."""
    torch.set_num_threads(1)
    first = step()
    cpu = time.thread_time()
    seconds = timed_steps(step, group, steps, warmup=1)
    return {"seconds": seconds, "loss": None if first is None else float(first),
            "host": (time.thread_time() - cpu) / (steps + 1), "threads": torch.get_num_threads()}


def fpipe_job(rank: int, world: int, group, batch: int, steps: int) -> dict:
    """fpipe.distributed's 1F1B on this rank's stage."""
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

    return _timed(rank, group, step, steps)


def torch_job(rank: int, world: int, group, batch: int, steps: int) -> dict:
    """torch.distributed.pipelining's Schedule1F1B on this rank's stage."""
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

    return _timed(rank, group, step, steps)


def _check(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "no loss"
    return "ok" if abs(a - b) <= 1e-5 * abs(b) else f"loss {a:.6g} != {b:.6g}"


def _rows(batch: int, fpipe_runs: list[dict], torch_runs: list[dict]) -> list[dict]:
    failed = next((r for r in fpipe_runs + torch_runs if "error" in r), None)
    if failed is not None:
        error = failed["error"].strip().splitlines()[-1][:200]
        return [{"batch": batch, "row": name, "check": f"failed: {error}"}
                for name in ("fpipe.distributed one_f_one_b", "torch Schedule1F1B")]

    def spread(values: list[float], scale: float = 1.0, fmt: str = ".4g") -> tuple:
        values = sorted(v * scale for v in values)
        return values[len(values) // 2], f"{values[0]:{fmt}}-{values[-1]:{fmt}}"

    ratio, ratio_range = spread([f["seconds"] / t["seconds"]
                                 for f, t in zip(fpipe_runs, torch_runs)], fmt=".3f")
    check = _check(fpipe_runs[0]["loss"], torch_runs[0]["loss"])
    rows = []
    for name, runs in (("fpipe.distributed one_f_one_b", fpipe_runs),
                       ("torch Schedule1F1B", torch_runs)):
        ms, ms_range = spread([r["seconds"] for r in runs], 1e3)
        host = "/".join(f"{spread([r['host'][k] for r in runs], 1e3)[0]:.3g}"
                        for k in range(WORLD))
        rows.append({"batch": batch, "row": name, "step_ms": ms, "rounds_ms": ms_range,
                     "fpipe/torch": ratio, "ratio_rounds": ratio_range, "host_ms": host,
                     "check": check})
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[16, 256])
    p.add_argument("--rounds", type=int, help="rounds (5; 1 with --quick)")
    p.add_argument("--steps", type=int, help="timed steps per row and round (10; 2 with --quick)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (2 if args.quick else 10)
    if TORCH_PIPELINING_MISSING:
        report("fpipe.distributed 1F1B against Schedule1F1B", COLUMNS,
               [{"batch": b, "row": "torch Schedule1F1B", "check": "not run"}
                for b in args.batch], args.json, [TORCH_PIPELINING_MISSING])
        return
    one_round = [partial(job, batch=b, steps=steps) for b in args.batch
                 for job in (fpipe_job, torch_job)]
    results = spawn_ranks(partial(run_jobs, timeout=120, strict=args.quick), WORLD,
                          one_round * rounds, timeout=120 if args.quick else 600 * rounds,
                          strict=args.quick)
    merged = []
    for j in range(len(one_round) * rounds):
        each = [r if r is None or isinstance(r, dict) else r[j] for r in results]
        merged.append(merge_ranks(each))
        if "error" not in merged[-1]:
            merged[-1]["host"] = [r["host"] for r in each]
    rows = []
    for i, batch in enumerate(args.batch):
        per_round = [merged[k * len(one_round) + 2 * i: k * len(one_round) + 2 * i + 2]
                     for k in range(rounds)]
        rows += _rows(batch, [f for f, _ in per_round], [t for _, t in per_round])
    report(f"fpipe.distributed 1F1B against torch Schedule1F1B: a transformer (embedding, 4 x "
           f"TransformerEncoderLayer({WIDTH}), head; sequence {SEQ}), {WORLD} ranks, gloo, "
           f"{CHUNKS} micro-batches, 1 intra-op thread per rank", COLUMNS, rows, args.json,
           [f"{rounds} rounds of {steps} steps, rows interleaved (fpipe, torch per batch, "
            f"each round); step_ms: median over rounds of each round's median; fpipe/torch: "
            f"median over rounds of the round's ratio; ranges are min-max over rounds"])


if __name__ == "__main__":
    main()
