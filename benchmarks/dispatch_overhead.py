"""Driver cost per action: many tiny stages, where the driver's own work dominates.

    python benchmarks/dispatch_overhead.py [--quick] [--json PATH]

16 stages of Linear(64, 64) + tanh, batch 64, over M micro-batches, one worker thread per stage
(and, to isolate the threads' cost, all stages on one worker; and with ``autodiff="autograd"``),
and the same layers as an
``nn.Sequential`` under ``fpipe.GPipe`` and, when it is installed, torchgpipe (both with
checkpoint="never", so every action is one forward or one backward). The time of a plain
(unpipelined) loop over the same micro-batches, differentiated the same way (``torch.func`` or
``torch.autograd``), is subtracted, so what remains is what the pipeline adds, divided by the
number of actions of the program.
"""

from __future__ import annotations

import torch
from common import parser, report, seconds_per_call
from torch.func import grad_and_value

import fpipe
from fpipe.schedules import Program, gpipe, one_f_one_b


def stage(p, x):
    return torch.tanh(x @ p["w"] + p["b"])


def one_worker(n_stages: int, chunks: int) -> Program:
    """GPipe's arithmetic with every stage on one worker: the driver without thread hand-offs."""
    forwards = [f"{s}F{m}" for s in range(n_stages) for m in range(chunks)]
    backwards = [f"{s}B{m}" for s in reversed(range(n_stages)) for m in range(chunks)]
    return Program([forwards + backwards], n_stages, chunks)


def layers(params: list) -> torch.nn.Sequential:
    """The benchmark's stages as an nn.Sequential of Linear + Tanh, with the same weights."""
    blocks = []
    for p in params:
        linear = torch.nn.Linear(*p["w"].shape)
        with torch.no_grad():
            linear.weight.copy_(p["w"].T)
            linear.bias.copy_(p["b"])
        blocks.append(torch.nn.Sequential(linear, torch.nn.Tanh()))
    return torch.nn.Sequential(*blocks)


def module_faces() -> list:
    faces = [("fpipe.GPipe (never)", lambda module, chunks: fpipe.GPipe(
        module, [1] * len(module), chunks=chunks, checkpoint="never"))]
    try:
        import torchgpipe
    except ImportError:
        return faces
    faces.append(("torchgpipe (never)", lambda module, chunks: torchgpipe.GPipe(
        module, [1] * len(module), devices=["cpu"] * len(module), chunks=chunks,
        checkpoint="never")))
    return faces


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    n_stages, width, batch = 16, 64, 64
    params = [{"w": torch.randn(width, width) * 0.1, "b": torch.zeros(width)}
              for _ in range(n_stages)]
    x, target = torch.randn(batch, width), torch.randn(batch, width)

    def loss_fn(y, t):
        return torch.nn.functional.mse_loss(y, t)

    def plain(ps, chunks):
        def loss(ps, xm, tm):
            h = xm
            for p in ps:
                h = stage(p, h)
            return loss_fn(h, tm)
        return [grad_and_value(loss)(ps, xm, tm)
                for xm, tm in zip(x.tensor_split(chunks), target.tensor_split(chunks))]

    def plain_autograd(ps, chunks):
        leaves = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in ps]
        flat = [v for p in leaves for v in p.values()]
        for xm, tm in zip(x.tensor_split(chunks), target.tensor_split(chunks)):
            h = xm
            for p in leaves:
                h = stage(p, h)
            torch.autograd.grad(loss_fn(h, tm), flat)

    repeat = 5 if args.quick else 20
    rows = []
    for chunks in ([8, 32] if args.quick else [8, 16, 32, 64]):
        func_loop = seconds_per_call(lambda chunks=chunks: plain(params, chunks), repeat)
        autograd_loop = seconds_per_call(lambda chunks=chunks: plain_autograd(params, chunks),
                                         repeat)
        # Each row's overhead is against the plain loop that differentiates the same way.
        for name, schedule, autodiff, baseline in (
                ("GPipe", gpipe(chunks=chunks, remat="never"), "func", func_loop),
                ("1F1B", one_f_one_b(chunks=chunks), "func", func_loop),
                ("GPipe, 1 worker", one_worker(n_stages, chunks), "func", func_loop),
                ("1F1B, autograd", one_f_one_b(chunks=chunks), "autograd", autograd_loop),
                ("GPipe, 1 worker, autograd", one_worker(n_stages, chunks), "autograd",
                 autograd_loop)):
            with fpipe.pipeline([stage] * n_stages, params, schedule=schedule,
                                loss_fn=loss_fn, autodiff=autodiff) as pipe:
                t = seconds_per_call(lambda: pipe.value_and_grad(x, target), repeat)
                actions = sum(len(w) for w in pipe.program.workers)
            rows.append({"schedule": name, "chunks": chunks, "actions": actions,
                         "step_ms": t * 1e3, "plain_ms": baseline * 1e3,
                         "us_per_action": (t - baseline) / actions * 1e6})
        baseline = autograd_loop  # the module faces differentiate with autograd
        # The torchgpipe-style module faces, fpipe's and (when installed) torchgpipe's own,
        # on the same layers: one (stage, micro-batch) forward and backward each.
        for name, wrap in module_faces():
            model = wrap(layers(params), chunks)
            t = seconds_per_call(lambda model=model: loss_fn(model(x), target).backward(),
                                 repeat)
            actions = 2 * n_stages * chunks
            rows.append({"schedule": name, "chunks": chunks, "actions": actions,
                         "step_ms": t * 1e3, "plain_ms": baseline * 1e3,
                         "us_per_action": (t - baseline) / actions * 1e6})
    report("fpipe driver overhead per action (16 x Linear(64,64), batch 64)",
           ["schedule", "chunks", "actions", "step_ms", "plain_ms", "us_per_action"],
           rows, args.json)


if __name__ == "__main__":
    main()
