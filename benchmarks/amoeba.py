"""fpipe.GPipe against torchgpipe on a model of many small parameter tensors.

    python benchmarks/amoeba.py [--quick] [--json PATH] [--threads N] [--repeat N]

torchgpipe's AmoebaNet-D benchmark model is 24 layers holding 831 parameter tensors, most of
them small (separable convolutions and their BatchNorms). On such a model what a face does per
parameter tensor and per call (finding and swapping each tensor in, checking it, handing it to
autograd) weighs against little arithmetic, so this is where a per-parameter cost shows. The
model here has that shape: a stem, 22 cells of separable convolutions with BatchNorm (36 or 40
tensors each) and a head, 24 layers and 841 tensors; the same model and batch run through both
faces, one training step (forward, backward) per call, with torch at ``--threads`` threads
(default 1). Rows alternate between the faces (A, B, B, A ...), over two builds of both (each
face built first in one: the face built second ran about 2% faster, whichever it was, so each
build gives half of the ``--repeat`` pairs); the table gives each face's
median and its spread (the fastest and slowest call), and the median over pairs of fpipe's
time over torchgpipe's with its interquartile range (a shared machine's slow second falls on
both faces of a pair alike, where the ratio of two medians moved by 0.1 from run to run).
"""

from __future__ import annotations

import time

import torch
from common import parser, report
from torch import nn

import fpipe


def unit(channels: int) -> list[nn.Module]:
    """A separable convolution: depthwise 3x3, pointwise 1x1, BatchNorm (4 tensors)."""
    return [nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
            nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]


def cell(channels: int, units: int, reduce: bool) -> nn.Sequential:
    layers = [m for _ in range(units) for m in unit(channels)]
    if reduce:  # a 1x1 convolution with bias and its BatchNorm (4 tensors more)
        layers += [nn.Conv2d(channels, channels, 1), nn.BatchNorm2d(channels)]
    return nn.Sequential(*layers)


def amoeba_like(channels: int, units: int, classes: int = 10) -> nn.Sequential:
    """24 layers: the stem, 22 cells (every other one with a reduction), the head."""
    stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                         nn.BatchNorm2d(channels))
    cells = [cell(channels, units, reduce=i % 2 == 1) for i in range(22)]
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))
    return nn.Sequential(stem, *cells, head)


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=15, help="timed calls per face")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--chunks", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    repeat, units = (3, 2) if args.quick else (args.repeat, 9)
    x, size = torch.randn(args.batch, 3, 8, 8), 24
    faces = {"fpipe": fpipe.GPipe}
    try:
        import torchgpipe
        faces["torchgpipe"] = torchgpipe.GPipe
    except ImportError:
        pass
    tensors = len(list(amoeba_like(16, units).parameters()))
    times: dict[str, list[float]] = {name: [] for name in faces}
    # Two builds, each face first once: the face built second ran about 2% faster here
    # whichever it was (memory layout), so each order gives half of the pairs.
    for order in (list(faces), list(faces)[::-1]):
        steps = {}
        for name in order:
            torch.manual_seed(0)
            model = faces[name](amoeba_like(16, units), [size // 2, size - size // 2],
                                devices=["cpu", "cpu"], chunks=args.chunks)

            def step(model=model) -> None:
                model(x).sum().backward()
            for _ in range(2):  # warm-up: threads started, pipelines built
                step()
            steps[name] = step
        for i in range((repeat + 1) // 2):
            # interleaved, each pair's order alternating: A, B, B, A, A, B ...
            for name in (order if i % 2 == 0 else order[::-1]):
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
        del steps, step, model
    rows = []
    for name, spent in times.items():
        ordered = sorted(spent)
        rows.append({"face": name, "tensors": tensors, "threads": args.threads,
                     "median_ms": round(ordered[len(ordered) // 2] * 1e3, 1),
                     "fastest_ms": round(ordered[0] * 1e3, 1),
                     "slowest_ms": round(ordered[-1] * 1e3, 1)})
    if "torchgpipe" in times:
        # each pair's ratio (a slow second on the shared machine falls on both faces alike),
        # its median and interquartile range
        ratios = sorted(f / t for f, t in zip(times["fpipe"], times["torchgpipe"]))
        n = len(ratios)
        for row in rows:
            fpipe_row = row["face"] == "fpipe"
            row["vs_torchgpipe"] = round(ratios[n // 2], 3) if fpipe_row else 1
            row["ratio_iqr"] = f"{ratios[n // 4]:.3f}-{ratios[(3 * n) // 4]:.3f}" \
                if fpipe_row else "-"
    report(f"fpipe.GPipe vs torchgpipe, 24 layers of {tensors} parameter tensors, batch "
           f"{args.batch} in {args.chunks} chunks, 2 partitions",
           list(rows[0]), rows, args.json,
           notes=["one training step per call (forward, sum, backward); rows interleaved "
                  "between faces over two builds (each face built first in one), each pair's "
                  "order alternating; vs_torchgpipe: the median over "
                  "pairs of the pair's ratio (ratio_iqr: its interquartile range)"])


if __name__ == "__main__":
    main()
