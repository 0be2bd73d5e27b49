"""ResNet-101 on one device: pipeline-1 against naive-1 and the limits of rematerialisation.

    python benchmarks/resnet101.py [--quick] [--json PATH] [--batch N] [--size PX]

The experiment of torchgpipe's README and GPipe's Figure 3(b). One partition holds the whole
model (pipeline-1), so the pipeline cannot overlap anything: what it costs against naive-1 (a
plain forward and backward of the batch) is the price of micro-batching and rematerialisation,
plus the driver's own work. Each row is set beside its limit:

- remat "always" runs every forward twice: at best (F+B)/(2F+B) of naive-1's speed;
- "except_last" re-runs all but the last micro-batch's forward: (F+B)/(F+(M-1)/M*F+B);
- "never" does naive-1's arithmetic on micro-batches: at best a plain loop over them.

F and B are naive-1's forward and backward, measured. torchgpipe's rows are added when it is
installed. On CUDA the defaults are torchgpipe's setting (batch 128, 224x224); on a CPU a
smaller batch and image keep the run to minutes. ``--quick`` uses a four-block ResNet, a
quarter as wide, with 10 classes.
"""

from __future__ import annotations

import torch
from common import parser, report, seconds_per_call
from torch import nn

import fpipe

CHECKPOINTS = ("always", "except_last", "never")


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with a residual connection (ResNet v1.5)."""

    def __init__(self, channels: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.shortcut = nn.Identity() if stride == 1 and channels == out else nn.Sequential(
            nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet(blocks: tuple[int, ...], classes: int = 1000, base: int = 64) -> nn.Sequential:
    """A flat nn.Sequential (one layer per block), as pipelines partition it; ``base`` is the
    first stage's width (64 in ResNets; the quick runs' is narrower)."""
    layers: list[nn.Module] = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    channels = base
    for stage, count in enumerate(blocks):
        width = base * 2 ** stage
        for i in range(count):
            layers.append(Bottleneck(channels, width, 2 if i == 0 and stage > 0 else 1))
            channels = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int)
    p.add_argument("--size", type=int)
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    blocks = (1, 1, 1, 1) if args.quick else (3, 4, 23, 3)
    batch = args.batch or (8 if args.quick else 128 if cuda else 16)
    size = args.size or (32 if args.quick else 224 if cuda else 96)
    repeat = 2 if args.quick else 10 if cuda else 3
    chunk_counts = [2] if args.quick else args.chunks
    torch.manual_seed(0)
    classes = 10 if args.quick else 1000
    model = resnet(blocks, classes, base=16 if args.quick else 64).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    target = torch.randint(0, classes, (batch,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    def step(module: nn.Module, inputs=x, labels=target) -> None:
        loss_fn(module(inputs), labels).backward()

    def forward() -> None:
        model(x)  # builds the graph, as naive-1's forward does

    naive = seconds_per_call(lambda: step(model), repeat)
    forward_time = seconds_per_call(forward, repeat)
    backward_time = max(naive - forward_time, 1e-9)
    rows = [{"configuration": "naive-1", "chunks": 1, "ms": naive * 1e3, "x naive-1": 1.0,
             "limit": 1.0, "x limit": 1.0}]
    for chunks in chunk_counts:
        def plain_loop(chunks=chunks) -> None:
            for xs, ts in zip(x.chunk(chunks), target.chunk(chunks)):
                (loss_fn(model(xs), ts) / chunks).backward()

        loop = seconds_per_call(plain_loop, repeat)
        rows.append({"configuration": "micro-batched loop", "chunks": chunks, "ms": loop * 1e3,
                     "x naive-1": naive / loop, "limit": 1.0, "x limit": naive / loop})
        limits = {"always": naive / (2 * forward_time + backward_time),
                  "except_last": naive / (forward_time * (2 - 1 / chunks) + backward_time),
                  "never": naive / loop}
        faces = [("fpipe.GPipe", lambda c, chunks=chunks: fpipe.GPipe(
            model, [len(model)], devices=[device], chunks=chunks, checkpoint=c))]
        try:
            import torchgpipe
            faces.append(("torchgpipe", lambda c, chunks=chunks: torchgpipe.GPipe(
                model, [len(model)], devices=[device], chunks=chunks, checkpoint=c)))
        except ImportError:
            pass
        for name, make in faces:
            for checkpoint in CHECKPOINTS:
                piped = make(checkpoint)
                seconds = seconds_per_call(lambda piped=piped: step(piped), repeat)
                speed = naive / seconds
                rows.append({"configuration": f"{name} pipeline-1, {checkpoint}",
                             "chunks": chunks, "ms": seconds * 1e3, "x naive-1": speed,
                             "limit": limits[checkpoint], "x limit": speed / limits[checkpoint]})
    report(f"ResNet-{3 * sum(blocks) + 2} pipeline-1 on {device} (batch {batch}, {size}x{size}; "
           f"naive-1 forward {forward_time * 1e3:.1f} ms, backward {backward_time * 1e3:.1f} ms)",
           ["configuration", "chunks", "ms", "x naive-1", "limit", "x limit"], rows, args.json)


if __name__ == "__main__":
    main()
