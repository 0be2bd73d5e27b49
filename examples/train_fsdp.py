"""Pipeline x FSDP2, as torchtitan trains: each pipeline stage sharded with ``fully_shard``
over the data-parallel replicas, gradients accumulated over several calls with one
reduce-scatter per step, AdamW and an LR scheduler stepping the shards.

    pip install -e '.[examples,saving]'   # in fpipe's clone: tqdm, and numpy for DCP
    torchrun --standalone --nproc-per-node=4 examples/train_fsdp.py --steps 4 --save ckpt
    torchrun --standalone --nproc-per-node=2 examples/scale_out.py --dp 1 --resume ckpt

The model, its cut and its data are ``scale_out.py``'s (a GPT whose LM head is tied to the
token embedding, four stages, interleaved 1F1B on two workers), on a ``("dp", "pp")`` mesh of
2 x 2 ranks. With ``shard="fsdp"`` the pipeline keeps only each rank's shard of its stages'
parameters (``pipe.params``, ``DTensor`` leaves), so AdamW's state is sharded too; each step
gathers them, and returns the gradients reduce-scattered into the same shards. The checkpoint
is keyed by the model's names, like any of fpipe's: ``scale_out.py`` resumes it on two ranks
without FSDP. Rank 0 prints the losses and the bytes of parameters, gradients and optimiser
state each rank holds, against what a replica holding its stages whole would hold.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import optree
import torch
import torch.distributed as dist
from gpt_pipeline import GPT, cut
from scale_out import CONTEXT, LENGTH, VOCAB, check_checkpoints, initialise, shard
from tokens import next_token_loss, synthetic_batch
from torch.distributed.device_mesh import init_device_mesh

import fpipe.distributed as fdist
from fpipe import saving
from fpipe.optim import bind_grads
from fpipe.schedules import interleaved_one_f_one_b
from fpipe.stages import from_modules


def held_bytes(params: dict, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes this rank holds, bytes it would hold with its stages whole) of parameters,
    gradients and optimiser state."""
    def sizes(t: torch.Tensor) -> tuple[int, int]:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * t.element_size(), t.numel() * t.element_size()

    held = whole = 0
    for p in optree.tree_leaves(params):
        tensors = [p, p.grad, *(v for v in optimizer.state[p].values() if v.dim())]
        for t in (t for t in tensors if t is not None):
            mine, full = sizes(t)
            held, whole = held + mine, whole + full
    return held, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=2, help="calls per optimiser step")
    parser.add_argument("--batch", type=int, default=16, help="the global batch of a call")
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint there at the end")
    args = parser.parse_args()
    check_checkpoints(argparse.Namespace(save=args.save, resume=None))
    if "RANK" not in os.environ:
        command = shlex.join(["torchrun", "--standalone", "--nproc-per-node=4", *sys.argv])
        sys.exit(f"{sys.argv[0]} runs on 4 ranks; launch it with torchrun:\n    {command}")

    device = fdist.init("cpu")  # gloo on CPU; init("cuda") for NCCL
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "pp"))
    replica, _ = mesh.get_coordinate()
    schedule = interleaved_one_f_one_b(chunks=4)
    with torch.device("meta"):
        gpt = GPT(VOCAB, CONTEXT, width=64, depth=4, heads=4, tied=True)
    held = fdist.my_stages(schedule, 4, mesh=mesh)
    torch.manual_seed(0)  # alike on every rank: replicas and a tie's copies start equal
    s = from_modules(cut(gpt), [device] * 4, root=gpt, stateful=False, held=held,
                     init=initialise)
    data = torch.Generator().manual_seed(1)
    names, params = s.names, {i: s.params[i] for i in held}
    with fdist.pipeline(s.stages, params, schedule=schedule, loss_fn=next_token_loss,
                        mesh=mesh, ties=s.ties, shard="fsdp") as pipe:
        del s, params  # the whole stages are not needed any more: the pipeline has shards
        optimizer = torch.optim.AdamW(optree.tree_leaves(pipe.params), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(  # a linear warm-up over 4 steps
            optimizer, lambda step: min(1.0, (step + 1) / 4))
        losses = []
        for _ in range(args.steps):
            for call in range(args.accumulate):  # one reduce-scatter, on the last call
                torch.manual_seed(int(torch.randint(2**31, (), generator=data)))
                batch = shard(synthetic_batch(args.batch, LENGTH, VOCAB), replica, 2)
                loss, grads = pipe.value_and_grad(*batch,
                                                  accumulate=call < args.accumulate - 1)
            losses.append(loss.item())
            bind_grads(pipe.params, grads)  # DTensor shards, placed as the parameters
            optimizer.step()
            scheduler.step()
        mine, whole = held_bytes(pipe.params, optimizer)
        print(f"rank {dist.get_rank()}: {mine} bytes of parameters, gradients and AdamW state "
              f"({whole} with its stages whole)", flush=True)
    if dist.get_rank() == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if args.save:  # collective: each rank writes its shards, keyed by the model's names
        saving.save(args.save, pipe.params, optimizer=optimizer, names=names,
                    extra={"scheduler": scheduler})  # the LR scheduler too
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
