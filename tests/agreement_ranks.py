"""What each spawned rank runs in tests/test_agreement.py: pipelines built differently on some
rank, each of which must be refused at build, alike on every rank, and then a pipeline built
alike, which must run (the refusals left every collective in step)."""

from __future__ import annotations

import torch
from distributed_ranks import data, fdist_schedule
from models import block, mlp_params, mse
from torch.distributed.device_mesh import init_device_mesh

import fpipe.distributed as fdist

#: The mesh cases: (name, the rank built differently, how). Each rank builds 2 stages of
#: width 8 in float64 under 1F1B with 2 micro-batches, but for the rank named.
MESH_CASES = (
    ("width", 3, {"width": 6}),  # the other replica of stage 1 has 8x8
    ("dtype", 2, {"dtype": torch.float32}),
    ("order", 1, {"schedule": "gpipe"}),  # the same placement, another order
    ("chunks", 2, {"chunks": 4}),
    ("autodiff", 3, {"autodiff": "func"}),
    ("grad_dtype", 0, {"grad_dtype": torch.float32}),
    ("frozen", 3, {"frozen": "b"}),  # alike but for which leaves are trained
)


def _build(held: tuple, how: dict, **where) -> fdist.DistributedPipeline:
    full = mlp_params(2, how.get("width", 8), how.get("dtype", torch.float64))
    if "frozen" in how:
        full = [{name: torch.nn.Parameter(leaf, requires_grad=False)
                 if name == how["frozen"] else leaf for name, leaf in stage.items()}
                for stage in full]
    schedule = fdist_schedule(how.get("schedule", "1f1b"), how.get("chunks", 2))
    return fdist.pipeline([block, block], {s: full[s] for s in held}, schedule=schedule,
                          loss_fn=mse, autodiff=how.get("autodiff", "autograd"),
                          grad_dtype=how.get("grad_dtype"), **where)


def _refusals(cases: tuple, rank: int, held: tuple, **where) -> dict:
    out = {}
    for name, odd, how in cases:
        try:
            _build(held, how if rank == odd else {}, **where).close()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out[name] = (type(exc).__name__, str(exc))
    return out


def _step(held: tuple, first: bool, last: bool, **where) -> torch.Tensor:
    x, target = data(4, 8, seed=40)
    with _build(held, {}, **where) as pipe:
        return pipe.value_and_grad(x if first else None, target if last else None)[0]


def mesh(rank: int, world: int) -> dict:
    """Every case of :data:`MESH_CASES` on a ("dp", "pp") = (2, 2) mesh, then a step."""
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    _, worker = device_mesh.get_coordinate()
    out = _refusals(MESH_CASES, rank, (worker,), mesh=device_mesh)
    out["loss"] = _step((worker,), worker == 0, worker == 1, mesh=device_mesh)
    return out


#: The cases on two ranks, one pipeline of two workers: (name, the odd rank, how).
PIPELINE_CASES = (("order", 1, {"schedule": "gpipe"}), ("chunks", 0, {"chunks": 3}),
                  ("autodiff", 1, {"autodiff": "func"}))


def two(rank: int, world: int) -> dict:
    """Each case of :data:`PIPELINE_CASES` on one pipeline of two ranks, then a step."""
    out = _refusals(PIPELINE_CASES, rank, (rank,))
    out["loss"] = _step((rank,), rank == 0, rank == 1)
    return out
