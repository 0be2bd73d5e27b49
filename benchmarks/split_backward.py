"""What splitting a stage's backward into I and W costs, against one fused backward.

    python benchmarks/split_backward.py [--quick] [--json PATH]

One stage of residual MLP blocks (Linear, ReLU, Linear) on one thread: the time of a forward
and backward through ``torch.func.vjp`` (what B runs) beside the same forward through
``fpipe._runtime.split_backward.split_vjp`` followed by its input half (I) and weight half
(W). The split runs each node's arithmetic once; what it adds is host work (a walk of the
graph, one autograd call per recorded node), so the relative cost falls as the layers grow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import parser, report, seconds_per_call
from torch.func import vjp

from fpipe._runtime.split_backward import split_vjp


def stage(params: list, inputs: list) -> list:
    h = inputs[0]
    for i in range(0, len(params), 4):
        h = h + F.linear(torch.relu(F.linear(h, params[i], params[i + 1])), params[i + 2],
                         params[i + 3])
    return [h]


def measure(width: int, batch: int, blocks: int, repeat: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    params = [t for _ in range(blocks) for t in (
        torch.randn(width, width, generator=generator) / width ** 0.5, torch.zeros(width),
        torch.randn(width, width, generator=generator) / width ** 0.5, torch.zeros(width))]
    x = torch.randn(batch, width, generator=generator)
    cotangent = torch.randn(batch, width, generator=generator)

    def forward() -> None:
        with torch.no_grad():
            stage(params, [x])

    def fused() -> None:
        _, vjp_fn = vjp(lambda p, h: stage(p, [h]), params, x)
        vjp_fn([cotangent])

    def split() -> None:
        _, halves = split_vjp(stage, params, [x])
        halves.input_grads([cotangent])
        halves.weight_grads()

    def split_input() -> None:
        _, halves = split_vjp(stage, params, [x])
        halves.input_grads([cotangent])

    f, b, s, i = (seconds_per_call(fn, repeat) for fn in (forward, fused, split, split_input))
    return {"width": width, "batch": batch, "blocks": blocks, "forward_ms": f * 1e3,
            "fused_F+B_ms": b * 1e3, "split_F+I+W_ms": s * 1e3,
            "I_ms (approx)": (i - f) * 1e3, "W_ms (approx)": (s - i) * 1e3,
            "split/fused": s / b}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    shapes = [(128, 64, 2)] if args.quick else [
        (64, 64, 8), (256, 64, 4), (512, 128, 4), (1024, 256, 2), (2048, 256, 1)]
    rows = [measure(width, batch, blocks, 5 if args.quick else 30)
            for width, batch, blocks in shapes]
    report("Split backward (I + W) against a fused backward, one thread",
           list(rows[0]), rows, args.json)


if __name__ == "__main__":
    main()
