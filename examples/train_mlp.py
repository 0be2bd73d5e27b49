"""Train a small residual MLP with a 4-stage pipeline on the CPU, on synthetic data.

    python examples/train_mlp.py [--steps 200] [--schedule 1f1b] [--chunks 8]

Prints the schedule's program, then a progress bar (tqdm) with the loss, which goes down.
"""

from __future__ import annotations

import argparse

import optree
import torch
from tqdm import tqdm
from workers import fit

import fpipe
from fpipe.schedules import gpipe, one_f_one_b


def block(p, x):
    """A residual tanh layer: a pure function of its parameters and input."""
    return x + torch.tanh(x @ p["w"] + p["b"])


def head(p, x):
    return x @ p["w"] + p["b"]


def init(width: int, n_blocks: int, out: int) -> list:
    def layer(n_in, n_out):
        return {"w": torch.randn(n_in, n_out) / n_in ** 0.5, "b": torch.zeros(n_out)}
    return [layer(width, width) for _ in range(n_blocks)] + [layer(width, out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.manual_seed(0)
    width, batch = 64, 256
    params = init(width, n_blocks=3, out=1)
    stages = [block] * 3 + [head]
    make = gpipe if args.schedule == "gpipe" else one_f_one_b
    schedule = make(chunks=args.chunks)

    def loss_fn(y, target):
        return torch.nn.functional.mse_loss(y, target)

    # A fixed random "teacher" defines the regression target.
    teacher = torch.randn(width, 1)
    optimizer = torch.optim.Adam(optree.tree_leaves(params), lr=args.lr)

    # At most one worker thread per core (examples/workers.py): 2 cores, 2 workers of 2 stages.
    with fpipe.pipeline(stages, params, schedule=fit(schedule, len(stages)),
                        loss_fn=loss_fn) as pipe:
        print(f"{schedule!r} on {len(stages)} stages; the program each worker runs:")
        print(pipe.program)
        first = None
        for _ in (bar := tqdm(range(args.steps), desc="training")):
            x = torch.randn(batch, width)
            target = torch.sin(x @ teacher)
            loss, grads = pipe.value_and_grad(x, target)
            fpipe.optim.bind_grads(params, grads)
            optimizer.step()
            first = loss.item() if first is None else first
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        print(f"loss {first:.4f} -> {loss.item():.4f}")


if __name__ == "__main__":
    main()
