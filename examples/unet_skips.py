"""A small U-Net trained as a 4-stage pipeline, its skip connections carried by fpipe.

    python examples/unet_skips.py [--steps 60] [--chunks 4]

The encoder stages stash their feature maps; the decoder stages pop them. Each skip travels
straight from the stage that stashes it to the one that pops it (never through the stages
between), and its gradient comes back the same way. The task: denoise random blobs.
"""

from __future__ import annotations

import argparse

import optree
import torch
import torch.nn.functional as F
from tqdm import tqdm
from workers import fit

import fpipe
from fpipe.schedules import gpipe
from fpipe.stages import skippable


def conv(p, x):
    return F.relu(F.conv2d(x, p["w"], p["b"], padding=1))


@skippable(stash=["full"])
def encode_full(p, x):
    h = conv(p, x)                                  # 16 x 16
    return F.max_pool2d(h, 2), {"full": h}


@skippable(stash=["half"])
def encode_half(p, x):
    h = conv(p, x)                                  # 8 x 8
    return F.max_pool2d(h, 2), {"half": h}


@skippable(pop=["half"])
def decode_half(p, x, skips):
    up = F.interpolate(conv(p["bottom"], x), scale_factor=2)   # 4 x 4 -> 8 x 8
    return conv(p["merge"], torch.cat([up, skips["half"]], dim=1))


@skippable(pop=["full"])
def decode_full(p, x, skips):
    up = F.interpolate(x, scale_factor=2)                       # 8 x 8 -> 16 x 16
    h = conv(p["merge"], torch.cat([up, skips["full"]], dim=1))
    return F.conv2d(h, p["out"]["w"], p["out"]["b"])


def layer(c_in, c_out, k=3):
    return {"w": torch.randn(c_out, c_in, k, k) * (2 / (c_in * k * k)) ** 0.5,
            "b": torch.zeros(c_out)}


def blobs(n: int, generator: torch.Generator) -> torch.Tensor:
    grid = torch.linspace(-1, 1, 16)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    centre = torch.rand(n, 2, 1, 1, generator=generator) * 1.4 - 0.7
    width = torch.rand(n, 1, 1, generator=generator) * 0.3 + 0.15
    d2 = (xx - centre[:, 0]) ** 2 + (yy - centre[:, 1]) ** 2
    return torch.exp(-d2 / (2 * width ** 2))[:, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    params = [layer(1, 8), layer(8, 16),
              {"bottom": layer(16, 16), "merge": layer(32, 16)},
              {"merge": layer(24, 8), "out": layer(8, 1, k=1)}]
    stages = [encode_full, encode_half, decode_half, decode_full]
    optimizer = torch.optim.Adam(optree.tree_leaves(params), lr=3e-3)
    data = torch.Generator().manual_seed(1)

    with fpipe.pipeline(stages, params, schedule=fit(gpipe(chunks=args.chunks), len(stages)),
                        loss_fn=F.mse_loss) as pipe:
        first = None
        for _ in (bar := tqdm(range(args.steps), desc="training")):
            clean = blobs(32, data)
            noisy = clean + 0.3 * torch.randn(clean.shape, generator=data)
            loss, grads = pipe.value_and_grad(noisy, clean)
            fpipe.optim.bind_grads(params, grads)
            optimizer.step()
            first = loss.item() if first is None else first
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    print(f"skips carried: {[(s.stash, s.pop) for s in stages]}")
    print(f"denoising loss {first:.4f} -> {loss.item():.4f}")


if __name__ == "__main__":
    main()
