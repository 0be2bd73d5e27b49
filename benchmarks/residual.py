"""The benchmarks' model: a deep stack of equal residual blocks ``x + tanh(x @ w) @ v``.

The same layers run as plain ``torch.func`` (naive), as fpipe stages (local or distributed
driver) and as ``nn.Module`` stages of ``torch.distributed.pipelining``; every process builds
the same parameters and batch from fixed seeds, so a pipelined run can be checked against the
naive loss and gradient. Also here: which fpipe schedules to run, and the rank-side jobs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from common import timed_steps
from torch.func import vjp

import fpipe
import fpipe.schedules


@dataclass(frozen=True)
class Model:
    """``layers`` blocks of ``width``, trained on a batch of ``batch`` samples."""

    layers: int
    width: int
    batch: int

    def params(self, seed: int = 0) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        scale = self.width ** -0.5
        return [{"w": torch.randn(self.width, self.width, generator=g) * scale,
                 "v": torch.randn(self.width, self.width, generator=g) * scale}
                for _ in range(self.layers)]

    def data(self, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(self.batch, self.width, generator=g),
                torch.randn(self.batch, self.width, generator=g))

    def param_bytes(self) -> int:
        return self.layers * 2 * self.width * self.width * 4


def block(p, x):
    return x + torch.tanh(x @ p["w"]) @ p["v"]


def stage(ps, h):
    for q in ps:
        h = block(q, h)
    return h


def loss_fn(y, t):
    return torch.nn.functional.mse_loss(y, t)


def whole_loss(ps, x, t):
    return loss_fn(stage(ps, x), t)


def naive_step(params: list, x: torch.Tensor, t: torch.Tensor) -> tuple:
    """(grads, loss) of the whole batch through every layer: plain ``torch.func.vjp``, its
    backward run without grad mode. (``torch.func.grad_and_value`` computes the same, but
    differentiates with ``create_graph=True`` and, in benchmarks/memory.py, peaks about twice
    as high.)"""
    loss, vjp_fn = vjp(partial(whole_loss, x=x, t=t), params)
    with torch.no_grad():
        (grads,) = vjp_fn(torch.ones_like(loss))
    return grads, loss


def split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive parts as even as can be (the first parts one longer)."""
    if n > len(items):
        raise ValueError(f"{len(items)} layers cannot fill {n} stages: give the model more")
    size, extra = divmod(len(items), n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + size + (i < extra))
    return [items[bounds[i]:bounds[i + 1]] for i in range(n)]


# -- fpipe schedules -----------------------------------------------------------------------------

#: fpipe.schedules exports that are not schedule constructors.
_NOT_SCHEDULES = {"validate", "simulate", "apply_remat", "normalize_remat", "in_flight",
                  "colocate", "gpipe", "one_f_one_b"}


def fpipe_schedules(chunks: int, workers: int) -> list[tuple[str, object, int]]:
    """(name, schedule, n_stages) of each fpipe schedule to run on ``workers`` workers:
    GPipe without remat, 1F1B, and every other constructor ``fpipe.schedules`` exports now
    (interleaved, zero-bubble...), called as ``ctor(chunks)`` with one or two stages per
    worker, whichever gives ``workers`` workers."""
    found = [(repr(s), s, workers) for s in (fpipe.schedules.gpipe(chunks, remat="never"),
                                             fpipe.schedules.one_f_one_b(chunks))]
    for name in sorted(getattr(fpipe.schedules, "__all__", ())):
        ctor = getattr(fpipe.schedules, name, None)
        if name in _NOT_SCHEDULES or not name[:1].islower() or not callable(ctor):
            continue
        try:
            schedule = ctor(chunks)
        except Exception:  # noqa: BLE001, S112 - not a constructor of chunks alone
            continue
        if not hasattr(schedule, "program") or isinstance(schedule, fpipe.schedules.Program):
            continue
        for n_stages in (workers, 2 * workers):
            try:
                program = schedule.program(n_stages)
            except Exception:  # noqa: BLE001, S112 - this many stages is not accepted
                continue
            if program.n_workers == workers:
                found.append((repr(schedule), schedule, n_stages))
                break
    return found


# -- rank-side jobs (run by common.run_jobs on every rank of a spawned group) ---------------------


def distributed_step(rank: int, model: Model, schedule, n_stages: int,
                     timeout: float) -> Callable[[], tuple]:
    """This rank's part of the model as an ``fpipe.distributed`` pipeline: a function running
    one training step (the input and target passed only where they are needed)."""
    import fpipe.distributed as fdist

    stage_params = split(model.params(), n_stages)
    held = fdist.my_stages(schedule, n_stages)
    pipe = fdist.pipeline([stage] * n_stages, {s: stage_params[s] for s in held},
                          schedule=schedule, loss_fn=loss_fn, timeout=timeout)
    x, t = model.data()
    first, last = pipe.program.placement[0], pipe.program.placement[-1]
    return lambda: pipe.value_and_grad(x if rank == first else None,
                                       t if rank == last else None)


def fpipe_distributed_job(rank: int, world: int, group, model: Model, schedule, n_stages: int,
                          repeat: int) -> dict:
    """Time fpipe.distributed on this rank's stages; returns seconds, loss, stage-0 grad norm."""
    one_step = distributed_step(rank, model, schedule, n_stages, timeout=60)
    out = {}

    def step():
        out["result"] = one_step()

    seconds = timed_steps(step, group, repeat)
    loss, grads = out["result"]
    return {"seconds": seconds, "loss": float(loss),
            "grad0": float(grads[0][0]["w"].norm()) if 0 in grads else None}


class _Stack(torch.nn.Module):
    """Some of the model's blocks as an ``nn.Module``, for torch.distributed.pipelining."""

    def __init__(self, params: list[dict]) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(p["w"].clone()) for p in params])
        self.v = torch.nn.ParameterList([torch.nn.Parameter(p["v"].clone()) for p in params])

    def forward(self, h):
        for w, v in zip(self.w, self.v):
            h = h + torch.tanh(h @ w) @ v
        return h


#: torch.distributed.pipelining's schedules: (class name, stages per rank, placement), where
#: "loop" puts stages r, r + K, ... on rank r and "v" puts stages r and 2K - 1 - r.
TORCH_SCHEDULES = [("ScheduleGPipe", 1, "loop"), ("Schedule1F1B", 1, "loop"),
                   ("ScheduleInterleaved1F1B", 2, "loop"),
                   ("ScheduleInterleavedZeroBubble", 2, "loop"),
                   ("ScheduleZBVZeroBubble", 2, "v"), ("ScheduleDualPipeV", 2, "v")]


def torch_pipelining_job(rank: int, world: int, group, model: Model, name: str, per_rank: int,
                         placement: str, chunks: int, repeat: int) -> dict:
    """Time one torch.distributed.pipelining schedule with one process per rank."""
    import torch.distributed.pipelining as pipelining

    n_stages = per_rank * world
    mine = ([rank, n_stages - 1 - rank] if placement == "v"
            else list(range(rank, n_stages, world)))
    stage_params = split(model.params(), n_stages)
    stages = []
    for s in mine:
        # A stage's example input must require grad (except stage 0's), or no gradient is
        # passed back to the stage before it.
        example = torch.empty(model.batch // chunks, model.width, requires_grad=s > 0)
        stages.append(pipelining.PipelineStage(_Stack(stage_params[s]), s, n_stages,
                                               torch.device("cpu"), input_args=(example,),
                                               group=group))
    cls = getattr(pipelining, name)
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, loss_fn=loss_fn)
    x, t = model.data()
    losses: list = []

    def step():
        for s in stages:
            for p in s.submod.parameters():
                p.grad = None
        losses.clear()
        kwargs = {"target": t, "losses": losses} if n_stages - 1 in mine else {}
        if 0 in mine:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)

    seconds = timed_steps(step, group, repeat)
    loss = float(torch.stack(losses).detach().mean()) if losses else None
    grad0 = None
    if 0 in mine:
        grad = stages[mine.index(0)].submod.w[0].grad
        grad0 = float(grad.norm()) if grad is not None else 0.0
    return {"seconds": seconds, "loss": loss, "grad0": grad0}


#: Why torch.distributed.pipelining cannot run here, or None: its stages exchange their shapes
#: with ``recv_object_list``, which needs numpy, a dependency of neither torch nor fpipe.
TORCH_PIPELINING_MISSING = None if importlib.util.find_spec("numpy") else \
    "torch.distributed.pipelining needs numpy: pip install numpy (or the [bench] extra)"


def distributed_jobs(model: Model, chunks_list: list[int], world: int, repeat: int) -> list:
    """(driver, schedule name, M, job) for every distributed configuration at ``world`` ranks;
    job is None for one that cannot run here (:data:`TORCH_PIPELINING_MISSING`)."""
    jobs = []
    for chunks in chunks_list:
        for name, schedule, n_stages in fpipe_schedules(chunks, world):
            jobs.append(("fpipe distributed", name, chunks,
                         partial(fpipe_distributed_job, model=model, schedule=schedule,
                                 n_stages=n_stages, repeat=repeat)))
        for name, per_rank, placement in TORCH_SCHEDULES:
            jobs.append(("torch pipelining", name, chunks, None if TORCH_PIPELINING_MISSING
                         else partial(torch_pipelining_job, model=model, name=name,
                                      per_rank=per_rank, placement=placement, chunks=chunks,
                                      repeat=repeat)))
    return jobs


def merge_ranks(results: list) -> dict:
    """One job's outcome from every rank's: rank 0's seconds, the loss and the stage-0 grad
    norm from whichever rank has them, or the first error (before a rank that was stopped)."""
    for r in results:
        if r is not None and "error" in r:
            return r
    if None in results:
        return {"error": "a rank timed out or was stopped"}
    out = {"seconds": results[0]["seconds"]}
    for key in ("loss", "grad0"):
        out[key] = next((r[key] for r in results if r.get(key) is not None), None)
    return out


def check(result: dict, loss: float, grad0: float) -> str:
    """'ok' if the loss and the first stage's first gradient match the naive ones."""
    got_loss, got_grad = result.get("loss"), result.get("grad0")
    if got_loss is None or got_grad is None:
        return "no loss/grad"
    if abs(got_loss - loss) > 1e-3 * abs(loss):
        return f"loss {got_loss:.4g} != {loss:.4g}"
    if abs(got_grad - grad0) > 1e-3 * abs(grad0):
        return f"grad {got_grad:.4g} != {grad0:.4g}"
    return "ok"

