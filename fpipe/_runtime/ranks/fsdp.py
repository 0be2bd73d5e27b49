"""A rank's stages sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) over the
data-parallel dimension of a ``("dp", "pp")`` mesh: ``fpipe.distributed.pipeline(...,
mesh=mesh, shard="fsdp")``.

Each held stage's parameter leaves go into a holder module (an ``nn.ParameterList``) that
``fully_shard`` shards over ``mesh["dp"]``: between steps a rank keeps only its row-wise shard
of every parameter (a ``DTensor``, ``Shard(0)``), and so only a shard of every gradient and of
the optimiser's state, which ``torch.optim`` keeps like the parameters it steps.

Per step, FSDP2's own ``unshard()`` all-gathers a holder's parameters and its ``reshard()``
frees them again. The stage functions are given the gathered parameters as the plain tensors
they are (the local, full values): a stage is a pure function of tensors, run under
``torch.func``-style vjps on detached leaves, and a ``DTensor`` there would make every op a
collective-aware dispatch, mix with the plain activations ("mixed torch.Tensor and DTensor")
and leave the gradients' reduction to autograd hooks fpipe's vjps never fire. So the engine
runs unchanged on full tensors, and the sharding lives around it: gathered before the step's
first action, each stage's full gradients reduce-scattered (:class:`ShardReduce`) and its
parameters resharded as soon as its last backward on the rank has run.

The reduce-scatter is the data-parallel mean of the replicated path with a scatter at its
end: each replica's gradients are weighted by its share of the global batch, laid out as
FSDP2 lays out a group's parameters (every leaf padded on dim 0 to a multiple of the replicas,
rank ``r``'s rows of every leaf side by side), and summed over fpipe's own data-parallel
group, one ``reduce_scatter_tensor`` per stage (and dtype), waited for within the pipeline's
timeout like every collective of fpipe's. Rank ``r`` receives exactly the rows of its shard,
returned as ``DTensor`` gradients placed as the parameters are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn

from fpipe._runtime.ranks.data_parallel import DataParallel, GradReduce
from fpipe._runtime.ranks.faults import RankFaults
from fpipe._runtime.trees import leaf_names
from fpipe._runtime.values import frozen, param_leaves

__all__ = ["SHARDINGS", "Sharded", "ShardReduce", "check_call", "check_shard", "released"]

#: What ``shard=`` may say: FSDP2 over ``mesh["dp"]``, or replicas that hold everything.
SHARDINGS = ("fsdp", None)


def check_shard(shard: str | None, mesh: Any, grad_reduce: str | None) -> None:
    """``shard=`` checked against the options it needs."""
    if shard not in SHARDINGS:
        raise ValueError(f"shard must be 'fsdp' or None, got {shard!r}")
    if shard is None:
        return
    if mesh is None:
        raise ValueError("shard='fsdp' shards each stage over the data-parallel dimension of a "
                         "DeviceMesh: give mesh=init_device_mesh(device, (replicas, workers), "
                         "mesh_dim_names=('dp', 'pp'))")
    if grad_reduce != "mean":
        raise ValueError(f"shard='fsdp' reduce-scatters the gradients into each replica's "
                         f"shard, so grad_reduce must be 'mean', not {grad_reduce!r}")


class Sharded:
    """This rank's stages held by FSDP2: ``params`` is ``{stage: pytree}`` of the sharded
    parameters (``DTensor`` leaves, what the optimiser steps), :meth:`gather` the full ones
    for a step, :meth:`release` frees them again."""

    def __init__(self, params: Mapping[int, Any], mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        self.mesh = mesh
        self.size, self.index = mesh.size(), mesh.get_local_rank()
        self.holders: dict[int, nn.Module] = {}
        self.params: dict[int, Any] = {}
        for stage, tree in params.items():
            leaves = param_leaves(tree)
            for name, leaf in zip(leaf_names(tree), leaves):
                if leaf.dim() == 0:
                    raise ValueError(f"params[{stage}][{name!r}] is a 0-dim tensor, which "
                                     f"FSDP2 cannot shard (it splits dim 0): make it shape (1,)")
            holder = nn.ParameterList(nn.Parameter(leaf.detach(), requires_grad=not frozen(leaf))
                                      for leaf in leaves)
            self.holders[stage] = fully_shard(holder, mesh=mesh)
            self.params[stage] = optree.tree_unflatten(optree.tree_structure(tree),
                                                       list(holder.parameters()))
        self.gathered: set[int] = set()

    def gather(self) -> dict[int, Any]:
        """``{stage: pytree}`` of the full parameters, all-gathered by FSDP2's ``unshard``
        (plain tensors: see the module's docstring)."""
        out = {}
        for stage, holder in self.holders.items():
            holder.unshard()
            self.gathered.add(stage)
            out[stage] = optree.tree_unflatten(optree.tree_structure(self.params[stage]),
                                               list(holder.parameters()))
        return out

    def release(self, stages: Sequence[int] | None = None) -> None:
        """Free the full parameters of ``stages`` (every gathered one by default)."""
        for stage in sorted(self.gathered if stages is None else set(stages) & self.gathered):
            self.holders[stage].reshard()
            self.gathered.discard(stage)

    def local(self) -> dict[int, Any]:
        """``{stage: pytree}`` of this rank's shards as plain tensors (what a tie's copies on
        the pipeline's ranks of one replica hold alike, row for row)."""
        return {s: optree.tree_map(lambda p: p.to_local(), tree)
                for s, tree in self.params.items()}

    def wrap(self, grads: list) -> list:
        """Per stage, flat local gradient shards as ``DTensor`` gradients placed as the
        parameters are (``None`` stays ``None``)."""
        from torch.distributed.tensor import DTensor

        out = list(grads)
        for stage, tree in self.params.items():
            if out[stage] is None:
                continue
            out[stage] = [None if g is None else DTensor.from_local(
                g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                run_check=False) for g, p in zip(out[stage], optree.tree_leaves(tree))]
        return out

    def pack(self, grads: Sequence[torch.Tensor | None], indices: list[int],
             wire: torch.device) -> torch.Tensor:
        """The reduce-scatter's input for the full gradients at ``indices``: each padded on
        dim 0 to a multiple of the replicas, then rank ``r``'s rows of every leaf side by side,
        rank after rank (FSDP2's layout)."""
        rows = []
        for i in indices:
            grad = grads[i]
            chunk = -(-grad.shape[0] // self.size)
            padded = grad.new_zeros((chunk * self.size, *grad.shape[1:]))
            padded[:grad.shape[0]] = grad
            rows.append(padded.reshape(self.size, -1))
        return torch.cat(rows, dim=1).reshape(-1).to(wire)

    def unpack(self, stage: int, flat: torch.Tensor, indices: list[int],
               into: list) -> None:
        """This rank's rows of a reduce-scattered stage, as its shards (in place in ``into``)."""
        leaves = optree.tree_leaves(self.params[stage])
        offset = 0
        for i in indices:
            shape = leaves[i].shape
            chunk = -(-shape[0] // self.size)
            size = chunk * shape[1:].numel()
            local = leaves[i].to_local()
            piece = flat[offset:offset + size].view(chunk, *shape[1:])[:local.shape[0]]
            into[i] = piece.to(local.device, local.dtype)
            offset += size


@contextlib.contextmanager
def released(sharded: Sharded | None) -> Iterator[None]:
    """A call's scope: with FSDP2, the full parameters it gathered are freed when it ends,
    however it ends (a stage's are freed as soon as its gradients are final)."""
    try:
        yield
    finally:
        if sharded is not None:
            sharded.release()


def check_call(sharded: Sharded | None, params: Any, vjp: bool) -> None:
    """What a call of a sharded pipeline cannot be given or do, refused before it starts."""
    if sharded is None:
        return
    if params is not None:
        raise ValueError("a pipeline built with shard='fsdp' holds its parameters "
                         "(pipe.params, sharded): call it without params=")
    if vjp:
        raise NotImplementedError("vjp is not supported with shard='fsdp' yet: its two calls "
                                  "would hold the gathered parameters in between")


class ShardReduce(GradReduce):
    """One step's gradients reduce-scattered into the replicas' shards: as a stage's become
    final, weighted by the replica's share (plus what earlier ``accumulate=True`` calls carry,
    weighted alike), one ``reduce_scatter_tensor`` per stage and dtype launched, and the
    stage's full parameters freed. :meth:`apply` returns each stage's local shards."""

    def __init__(self, dp: DataParallel, share: float, faults: RankFaults, held: Sequence[int],
                 sharded: Sharded, carry: list | None = None) -> None:
        super().__init__(dp, share, faults, held, carry)
        self.sharded = sharded

    COLLECTIVE = " (reduce-scatter)"

    def groups(self, grads: list) -> list[list[int]]:
        """One reduce-scatter per dtype: all of the stage's leaves of that dtype."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, grad in enumerate(grads):
            if grad is not None:
                by_dtype.setdefault(grad.dtype, []).append(i)
        return list(by_dtype.values())

    def pack(self, grads: Sequence[torch.Tensor], indices: list[int]) -> torch.Tensor:
        return self.sharded.pack(grads, indices, self.dp.wire)

    def reduce(self, flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = flat.new_empty(flat.numel() // self.sharded.size)
        return out, _reduce_scatter()(out, flat, group=self.dp.group, async_op=True)

    def unpack(self, stage: int, out: torch.Tensor, like: list, indices: list[int],
               into: list) -> None:
        self.sharded.unpack(stage, out, indices, into)

    def launched_stage(self, stage: int) -> None:
        self.sharded.release([stage])  # its last backward here has run


def _reduce_scatter():
    """torch's reduce-scatter of one tensor: ``reduce_scatter_single`` (torch 2.13 renamed it),
    ``reduce_scatter_tensor`` before."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
