"""What each spawned rank runs in tests/test_clipping.py: the global norm and clipping of a
pipeline's gradients held by two ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed_ranks import data
from models import block, mlp_params, mse

import fpipe.distributed as fdist
from fpipe.optim import clip_grad_norm, global_norm
from fpipe.schedules import one_f_one_b

#: Each rank's gradients: stage ``r`` on rank ``r``, a leaf ``w`` tied between the two.
GRADS = ({"w": torch.tensor([3.0, 4.0], dtype=torch.float64),
          "b": torch.tensor([1.0], dtype=torch.float64)},
         {"w": torch.tensor([3.0, 4.0], dtype=torch.float64),
          "b": torch.tensor([2.0, 2.0], dtype=torch.float64)})
MAX_NORM = 1.0


def clipping(rank: int, world: int) -> dict:
    """``clip_grad_norm`` with ``group=``, with ties written as lists, and the pipeline's own
    ``clip_grad_norm``, on this rank's gradients."""
    out = {}
    mine = {rank: {k: v.clone() for k, v in GRADS[rank].items()}}
    out["group"] = clip_grad_norm(mine, MAX_NORM, group=dist.group.WORLD)
    mine = {rank: {k: v.clone() for k, v in GRADS[rank].items()}}
    out["tied lists"] = clip_grad_norm(mine, MAX_NORM, ties=[[[0, "w"], [1, "w"]]],
                                       group=dist.group.WORLD)
    out["alone"] = global_norm({rank: GRADS[rank]})
    x, target = data(4, 8, seed=50)
    with fdist.pipeline([block, block], {rank: mlp_params(2)[rank]}, schedule=one_f_one_b(2),
                        loss_fn=mse) as pipe:
        _, grads = pipe.value_and_grad(x if rank == 0 else None, target if rank == 1 else None)
        out["pipeline"] = pipe.clip_grad_norm(grads, 0.1)
    return out


def stages_value(rank: int, world: int) -> dict:
    """A tied model cut by ``from_modules``, its ``Stages`` given to the pipeline as they are
    (no ``ties=``): one step's gradients of the tied copies."""
    from test_saving import Body, TiedLM, lm_loss

    from fpipe.stages import from_modules

    lm = TiedLM(3)
    s = from_modules([Body(lm), lm.head], root=lm, stateful=False)
    ids = torch.randint(0, 13, (4, 5), generator=torch.Generator().manual_seed(5))
    with fdist.pipeline(s, {rank: s.params[rank]}, schedule=one_f_one_b(2),
                        loss_fn=lm_loss) as pipe:
        _, grads = pipe.value_and_grad(ids if rank == 0 else None, ids if rank == 1 else None)
        return {"ties": pipe.ties, "found": s.ties, "grads": grads}
