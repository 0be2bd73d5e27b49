"""Scale out as large-model jobs do: pipeline x data parallel, tied weights, a model built on
the meta device, and checkpoints through torch.distributed.checkpoint.

    pip install -e '.[examples,saving]'   # in fpipe's clone: tqdm, and numpy for DCP
    torchrun --standalone --nproc-per-node=4 examples/scale_out.py --dp 2 --save ckpt
    torchrun --standalone --nproc-per-node=2 examples/scale_out.py --dp 1 --resume ckpt

The model is the GPT of ``gpt_pipeline.py`` with its LM head tied to the token embedding, as
GPT-2's is, built on the ``meta`` device: no process ever holds it whole. It is cut into four
stages (embeddings, two runs of blocks, head) and run with interleaved 1F1B, two stages per
worker, so the embedding (stage 0, worker 0) and the head (stage 3, worker 1) hold the tied
weight on different ranks. The ranks form a ``("dp", "pp")`` mesh: ``--dp`` replicas of a
two-worker pipeline, each given its own shard of every global batch; fpipe averages their
gradients over the ``dp`` group and sums the tie's over the ``pp`` ranks.

Each rank materialises only the stages it holds (``held=``), initialised by ``initialise``
(the modules' own initialisers, GPT-2's for embeddings), or left empty for ``--resume`` to fill
from a checkpoint. With ``--save``, at the end every rank writes its stages and its AdamW state
into one DCP checkpoint, keyed by the model's own names (``tok.weight``,
``blocks.3.attn.qkv.weight``), so a job of another shape (here 2 ranks, no data parallelism)
resumes it. Rank 0 prints the loss on a fixed evaluation batch at the start and at the end: a
resumed job starts where the saved one ended.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

import optree
import torch
import torch.distributed as dist
from gpt_pipeline import GPT, cut
from tokens import next_token_loss, synthetic_batch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import fpipe.distributed as fdist
from fpipe import saving
from fpipe.optim import bind_grads, clip_grad_norm
from fpipe.schedules import interleaved_one_f_one_b
from fpipe.stages import from_modules

VOCAB, CONTEXT, LENGTH = 64, 32, 16


def initialise(module: nn.Module) -> None:
    """Each submodule's own initialiser, but embeddings as GPT-2 draws them (std 0.02): the
    token embedding is also the LM head, whose logits N(0, 1) rows would make huge."""
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def shard(batch: tuple, replica: int, replicas: int) -> tuple:
    """This replica's rows of a global batch (every rank draws the same batches)."""
    return tuple(t.chunk(replicas)[replica] for t in batch)


def check_checkpoints(args: argparse.Namespace) -> None:
    """``--save`` and ``--resume`` go through torch.distributed.checkpoint, which on several
    ranks needs numpy: say so before training, not after it."""
    if (args.save or args.resume) and importlib.util.find_spec("numpy") is None:
        sys.exit("--save and --resume need numpy (torch.distributed.checkpoint exchanges its "
                 "plans through it on several ranks): pip install numpy, or in fpipe's clone "
                 "pip install -e '.[saving]'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="the global batch")
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint there at the end")
    parser.add_argument("--resume", metavar="DIR", help="start from the checkpoint there")
    args = parser.parse_args()
    check_checkpoints(args)
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE and the rendezvous address
        command = shlex.join(["torchrun", "--standalone", f"--nproc-per-node={2 * args.dp}",
                              *sys.argv])
        sys.exit(f"{sys.argv[0]} runs one process per pipeline worker and replica; launch it "
                 f"with torchrun:\n    {command}")

    device = fdist.init("cpu")  # gloo on CPU; init("cuda") would pick NCCL
    if dist.get_world_size() != 2 * args.dp:
        sys.exit(f"--dp {args.dp} replicas of a 2-worker pipeline need {2 * args.dp} ranks")
    mesh = init_device_mesh(device.type, (args.dp, 2), mesh_dim_names=("dp", "pp"))
    replica, _ = mesh.get_coordinate()
    schedule = interleaved_one_f_one_b(chunks=args.chunks)

    with torch.device("meta"):  # shapes only: nothing allocated yet
        gpt = GPT(VOCAB, CONTEXT, width=64, depth=4, heads=4, tied=True)
    held = fdist.my_stages(schedule, 4, mesh=mesh)
    torch.manual_seed(0)  # alike on every rank: the seed alone decides the initial weights
    s = from_modules(cut(gpt), [device] * 4, root=gpt, stateful=False, held=held,
                     init=None if args.resume else initialise)
    params = {i: s.params[i] for i in held}
    optimizer = torch.optim.AdamW(optree.tree_leaves(params), lr=3e-3)
    if args.resume:  # every rank reads its own stages' tensors, by the model's names
        saving.load(args.resume, params, optimizer=optimizer, names=s.names)

    torch.manual_seed(2)
    evaluation = synthetic_batch(args.batch, LENGTH, VOCAB)  # the same on every rank, each run
    data = torch.Generator().manual_seed(1)
    with fdist.pipeline(s.stages, params, schedule=schedule, loss_fn=next_token_loss,
                        mesh=mesh, ties=s.ties) as pipe:
        def evaluate() -> float:
            loss, _ = pipe.value_and_grad(*shard(evaluation, replica, args.dp))
            return loss.item()  # the global batch's mean, on every rank

        start = evaluate()
        steps = range(args.steps)
        for _ in tqdm(steps, disable=dist.get_rank() != 0, desc="training"):
            torch.manual_seed(int(torch.randint(2**31, (), generator=data)))
            loss, grads = pipe.value_and_grad(*shard(synthetic_batch(args.batch, LENGTH,
                                                                     VOCAB), replica, args.dp))
            # One norm over the whole model: the tie counted once, every stage's rank summed.
            clip_grad_norm(grads, max_norm=1.0, ties=s.ties, group=mesh.get_group("pp"))
            bind_grads(params, grads)
            optimizer.step()
        end = evaluate()
    if dist.get_rank() == 0:
        print(f"evaluation loss {start:.6f} -> {end:.6f}", flush=True)
    if args.save:  # collective: each rank writes its stages, replicas' copies once
        saving.save(args.save, params, optimizer=optimizer, names=s.names)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
