"""Train a small residual MLP with one pipeline stage per rank, over torch.distributed.

    torchrun --standalone --nproc-per-node=2 examples/train_distributed.py [--steps 50] [--chunks 4]

Each rank builds only its own stages' parameters; the loss is printed by rank 0.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import optree
import torch
import torch.distributed as dist

import fpipe.distributed as fdist
from fpipe.optim import bind_grads
from fpipe.schedules import one_f_one_b


def block(p, x):
    return x + torch.tanh(x @ p["w"] + p["b"])


def head(p, x):
    return x @ p["w"] + p["b"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE and the rendezvous address
        command = shlex.join(["torchrun", "--standalone", "--nproc-per-node=2", *sys.argv])
        sys.exit(f"{sys.argv[0]} runs one process per pipeline stage; launch it with torchrun:\n"
                 f"    {command}")

    device = fdist.init("cpu")  # gloo on CPU; init("cuda") would pick NCCL
    rank, world = dist.get_rank(), dist.get_world_size()
    width, batch = 32, 64
    stages = [block] * (world - 1) + [head]
    schedule = one_f_one_b(chunks=args.chunks)

    params = {}
    for s in fdist.my_stages(schedule, len(stages)):  # only this rank's stages
        torch.manual_seed(s)
        n_out = 1 if s == len(stages) - 1 else width
        params[s] = {"w": torch.randn(width, n_out, device=device) / width ** 0.5,
                     "b": torch.zeros(n_out, device=device)}
    optimizer = torch.optim.Adam(optree.tree_leaves(params), lr=0.02)
    teacher = torch.randn(width, 1, generator=torch.Generator().manual_seed(0))
    data = torch.Generator().manual_seed(1)  # every rank draws the same batches
    # The with block closes the pipeline on every rank together (a collective), after which
    # the process group can be torn down.
    with fdist.pipeline(stages, params, schedule=schedule,
                        loss_fn=torch.nn.functional.mse_loss, timeout=60) as pipe:
        for step in range(1, args.steps + 1):
            x = torch.randn(batch, width, generator=data)
            target = torch.sin(x @ teacher)
            loss, grads = pipe.value_and_grad(x, target)  # ranks without stage 0: None is fine
            bind_grads(params, grads)  # grads: {stage: pytree}, like params
            optimizer.step()
            if rank == 0 and (step % 10 == 0 or step == 1):
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
