"""fpipe against torchgpipe on one GPU: step time and peak memory of three models.

    python benchmarks/gpu.py [--smoke] [--json PATH] [--models transformer resnet mlp]
                             [--repeat N] [--threads N]

The one command for issue 23's figures, under 3 minutes on one H100. Every pipeline has its
partitions on one device (cuda:0, or the CPU without a GPU), so it measures what fpipe costs
over torchgpipe and over plain PyTorch, not what pipelining gains across devices:

- *transformer*: 12 x ``TransformerEncoderLayer(1024, 16, 4096, batch_first=True)``, batch 32
  x 512 tokens, 4 partitions of 3 layers, 8 micro-batches, remat ``except_last`` (torchgpipe's
  default) for the module faces and every policy, and 1F1B, for ``fpipe.pipeline``;
- *resnet*: ResNet-101 (built here, without torchvision), batch 128 at 224 px, one partition
  (``benchmarks/resnet101.py``'s pipeline-1), 4 micro-batches, each ``checkpoint``;
- *mlp*: 16 x (Linear(512) + Tanh), batch 512, 4 partitions, 32 micro-batches, no remat:
  kernels so small that the host's work per action is the step time.

Rows per model: the plain whole batch, a plain loop over the micro-batches (the floor of a
micro-batched step), torchgpipe when installed, ``fpipe.GPipe``, and ``fpipe.pipeline``.
Rows are timed interleaved (each round runs every row once), after two warm-up steps each;
a row's figure is the median over rounds, with min and max. *peak MB* is the most memory the
step allocated above what was allocated before it, gradients cleared first (CUDA's
``max_memory_allocated``; on the CPU the process's peak resident memory, where Linux gives
it). *x tg* divides by torchgpipe's row of the same policy (time, then memory); *x limit* is
the row's speed over the fastest a policy could be: ``always`` runs every forward twice,
(F+B)/(2F+B) of the whole batch's speed; ``except_last`` all but one, (F+B)/((2-1/M)F+B);
``never`` at best the plain loop (F and B: the whole batch's forward and backward).

``--smoke`` runs tiny models in seconds, on the CPU too (CI runs it).
"""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import parser, report
from resnet101 import resnet
from torch import nn

import fpipe
from fpipe.schedules import gpipe, one_f_one_b
from fpipe.stages import from_sequential

POLICIES = ("always", "except_last", "never")
MiB = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@dataclass
class Model:
    """One benchmark model: the layers, a batch, how it is cut and which policies run."""

    name: str
    layers: nn.Sequential
    x: torch.Tensor
    target: torch.Tensor
    loss_fn: Callable
    balance: list[int]
    chunks: int
    policies: tuple[str, ...]
    pipelines: bool = True  # fpipe.pipeline rows (stateless layers only)
    rows: list[dict] = field(default_factory=list)


def transformer(device: torch.device, smoke: bool) -> Model:
    width, heads, layers, batch, tokens = (32, 2, 4, 8, 16) if smoke else (1024, 16, 12, 32, 512)
    stack = nn.Sequential(*(nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True)
                            for _ in range(layers))).to(device)
    x = torch.randn(batch, tokens, width, device=device)
    return Model("transformer", stack, x, torch.randn_like(x), nn.functional.mse_loss,
                 [layers // 4] * 4, 2 if smoke else 8, ("except_last",))


def resnet_model(device: torch.device, smoke: bool) -> Model:
    blocks, batch, size = ((1, 1, 1, 1), 4, 32) if smoke else ((3, 4, 23, 3), 128, 224)
    classes = 10 if smoke else 1000
    net = resnet(blocks, classes, base=16 if smoke else 64).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    target = torch.randint(0, classes, (batch,), device=device)
    return Model("resnet", net, x, target, nn.functional.cross_entropy, [len(net)],
                 2 if smoke else 4, POLICIES, pipelines=False)


def mlp(device: torch.device, smoke: bool) -> Model:
    width, depth, batch = (32, 4, 16) if smoke else (512, 16, 512)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    x = torch.randn(batch, width, device=device)
    return Model("mlp", nn.Sequential(*layers).to(device), x, torch.randn_like(x),
                 nn.functional.mse_loss, [len(layers) // 4] * 4, 4 if smoke else 32, ("never",))


MODELS = {"transformer": transformer, "resnet": resnet_model, "mlp": mlp}


# -- steps --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """A row's training step, and the module whose ``.grad`` it fills (None: the step returns
    its gradients)."""

    step: Callable[[], object]
    module: nn.Module | None = None

    def clear(self) -> None:
        if self.module is not None:
            self.module.zero_grad(set_to_none=True)


def module_step(module: nn.Module, model: Model) -> Row:
    def step() -> None:
        model.loss_fn(module(model.x), model.target).backward()
    return Row(step, module)


def loop_step(module: nn.Module, model: Model) -> Row:
    def step() -> None:
        for xs, ts in zip(model.x.chunk(model.chunks), model.target.chunk(model.chunks)):
            (model.loss_fn(module(xs), ts) / model.chunks).backward()
    return Row(step, module)


def rows_of(model: Model, device: torch.device) -> dict[tuple[str, str], Row]:
    """Every row's step for ``model``, by (row, policy); each row has its own parameters."""
    devices = [device] * len(model.balance)

    def own() -> nn.Sequential:
        return copy.deepcopy(model.layers)

    rows = {("plain whole batch", "-"): module_step(own(), model),
            ("plain micro-batch loop", "-"): loop_step(own(), model)}
    try:
        import torchgpipe
    except ImportError:
        torchgpipe = None
    for policy in model.policies:
        if torchgpipe is not None:
            rows["torchgpipe", policy] = module_step(torchgpipe.GPipe(
                own(), model.balance, devices=devices, chunks=model.chunks, checkpoint=policy),
                model)
        rows["fpipe.GPipe", policy] = module_step(fpipe.GPipe(
            own(), model.balance, devices=devices, chunks=model.chunks, checkpoint=policy), model)
    if model.pipelines:
        cut = from_sequential(own(), model.balance, devices, stateful=False)
        schedules = {f"fpipe.pipeline gpipe {p}": (p, gpipe(model.chunks, p)) for p in POLICIES}
        schedules["fpipe.pipeline 1F1B"] = ("never", one_f_one_b(model.chunks))
        for name, (policy, schedule) in schedules.items():
            pipe = fpipe.pipeline(cut.stages, cut.params, schedule=schedule,
                                  loss_fn=model.loss_fn)
            rows[name, policy] = Row(
                lambda pipe=pipe: pipe.value_and_grad(model.x, model.target))
    return rows


# -- measuring ----------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resident(field_name: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    line = next(line for line in status.read_text().splitlines() if line.startswith(field_name))
    return int(line.split()[1]) * 1024


def peak_bytes(row: Row, device: torch.device) -> int | None:
    """The most memory ``row``'s step allocated above what was allocated before it, its
    gradients cleared first."""
    row.clear()
    gc.collect()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        row.step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    clear = Path("/proc/self/clear_refs")
    if not clear.exists():
        return None
    clear.write_text("5")  # the kernel's high-water mark starts again from here
    before = _resident("VmRSS")
    row.step()
    return _resident("VmHWM") - before


def timed(step: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def measure(model: Model, device: torch.device, repeat: int, warmup: int) -> None:
    """Time every row interleaved, then each one's peak memory; rows go to ``model.rows``."""
    rows = rows_of(model, device)
    for row in rows.values():
        for _ in range(warmup):
            row.clear()
            row.step()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in rows}
    for _ in range(repeat):
        for key, row in rows.items():
            row.clear()
            times[key].append(timed(row.step, device))
    for (name, policy), row in rows.items():
        spent = times[name, policy]
        peak = peak_bytes(row, device)
        model.rows.append({
            "model": model.name, "row": name, "remat": policy, "chunks": model.chunks,
            "ms": statistics.median(spent) * 1e3, "min ms": min(spent) * 1e3,
            "max ms": max(spent) * 1e3, "peak MB": None if peak is None else peak / MiB})
        row.clear()


def forward_backward(model: Model, device: torch.device, repeat: int) -> tuple[float, float]:
    """The whole batch's forward (building its graph) and backward, in seconds."""
    layers = copy.deepcopy(model.layers)
    forward = statistics.median(timed(lambda: layers(model.x), device) for _ in range(repeat))
    whole = statistics.median(timed(module_step(layers, model).step, device)
                              for _ in range(repeat))
    return forward, max(whole - forward, 1e-9)


def add_ratios(model: Model, forward: float, backward: float) -> None:
    """Each row's time and memory over torchgpipe's of the same policy, and its speed over
    its policy's limit."""
    by_key = {(row["row"], row["remat"]): row for row in model.rows}
    loop = by_key["plain micro-batch loop", "-"]["ms"] / 1e3
    m = model.chunks
    limits = {"always": 2 * forward + backward, "except_last": (2 - 1 / m) * forward + backward,
              "never": loop}
    for row in model.rows:
        theirs = by_key.get(("torchgpipe", row["remat"]))
        if theirs is not None:
            row["x tg time"] = row["ms"] / theirs["ms"]
            if row["peak MB"] is not None and theirs["peak MB"]:
                row["x tg peak"] = row["peak MB"] / theirs["peak MB"]
        if row["remat"] in limits:
            row["x limit"] = limits[row["remat"]] * 1e3 / row["ms"]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny models, a few seconds on a CPU (for CI)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--repeat", type=int, help="timed rounds (default 10, smoke 2)")
    p.add_argument("--threads", type=int,
                   help="torch's intra-op threads (default 1 on the CPU, else min(8, cores))")
    args = p.parse_args()
    smoke = args.smoke or args.quick
    gc.freeze()  # what the imports made: the collections before each peak skip it
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    warnings.simplefilter("ignore", fpipe.OversubscriptionWarning)  # the CPU's 4 workers
    if device.type == "cpu" and Path("/proc/self/clear_refs").exists():
        # Tensors from 64 KiB up on pages of their own, given back when freed, so the peak
        # resident memory follows the live tensors (glibc's M_MMAP_THRESHOLD).
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    torch.set_num_threads(args.threads or (min(8, os.cpu_count() or 1)
                                           if device.type == "cuda" else 1))
    repeat = args.repeat or (2 if smoke else 10)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model = MODELS[name](device, smoke)
        forward, backward = forward_backward(model, device, repeat)
        measure(model, device, repeat, warmup=1 if smoke else 2)
        add_ratios(model, forward, backward)
        rows += model.rows
        del model
        gc.collect()
    report(f"fpipe against torchgpipe on {device}, every partition on it "
           f"({torch.get_num_threads()} intra-op threads)",
           ["model", "row", "remat", "chunks", "ms", "min ms", "max ms", "peak MB", "x tg time",
            "x tg peak", "x limit"], rows, args.json, notes=[
               f"{repeat} interleaved rounds; ms: median, with min and max",
               "peak MB: allocated above the memory before the step, gradients cleared first",
               "x tg: over torchgpipe's row of the same remat (time, peak); "
               "x limit: speed over the policy's bound"])


if __name__ == "__main__":
    main()
