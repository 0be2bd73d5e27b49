"""Data parallelism around a distributed pipeline: several replicas of the same pipeline, each
given its own shard of the global batch, whose gradients and loss become those of the whole
batch.

Each rank's *data-parallel group* holds the ranks that run the same worker in the other
replicas. Per step, in this order on every rank of that group (so collectives pair up):

1. the shard sizes: one all-reduce of ``[n, short]``, so every replica knows the global batch
   ``N`` and refuses together when any shard has fewer samples than micro-batches;
2. the gradients: as soon as a stage's gradients are final on this rank (after its last
   backward or weight-gradient action in this rank's plan), they are scaled by the replica's
   share ``n / N``, flattened into buckets of at most ``bucket_bytes`` per dtype and
   all-reduced (sum) asynchronously, so the reduction overlaps the rest of the drain; the
   buckets are waited for when the step's gradients are returned;
3. the loss: one all-reduce of ``loss * n / N``;
4. with state (:meth:`DataParallel.agree_state`, after a training step or a stateful
   inference call), the state made alike on every replica as ``state_reduce=`` says: each
   floating-point tensor leaf the share-weighted mean (one all-reduce per dtype, bucketed as
   the gradients are), or every tensor leaf broadcast from the group's first replica.

The sum of share-weighted means is the mean over the global batch, whatever the shards' sizes,
so every replica returns the same loss and gradients, and an optimiser step applied alike keeps
the replicas equal. Everything goes over fpipe's own group on the same ranks as the caller's,
which a failure aborts (:mod:`fpipe._runtime.ranks.faults`) without touching the caller's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fpipe._runtime.microbatch import check_size
from fpipe._runtime.ranks.faults import RankFaults
from fpipe._runtime.trees import tree_flatten
from fpipe.errors import BatchError, PlacementError
from fpipe.schedules.actions import Op

__all__ = ["DataParallel", "GradReduce", "REDUCTIONS", "STATE_REDUCTIONS", "mesh_groups"]

#: What ``grad_reduce=`` may say: the global batch's mean, or gradients left to the caller.
REDUCTIONS = ("mean", None)
#: What ``state_reduce=`` may say: the share-weighted mean of the replicas' new state, the
#: first replica's, or each replica its own.
STATE_REDUCTIONS = ("mean", "broadcast", None)
_FINAL = (Op.BACKWARD, Op.BACKWARD_WEIGHT)


class DataParallel:
    """This rank's data-parallel group (fpipe's own, over the ranks of ``group``) and how a
    step's gradients are reduced over it."""

    def __init__(self, group: Any, ranks: Sequence[int], reduce: str | None,
                 bucket_bytes: int, wire: torch.device,
                 state_reduce: str | None = "mean") -> None:
        self.group, self.ranks = group, tuple(ranks)
        self.reduce, self.bucket_bytes, self.wire = reduce, bucket_bytes, wire
        self.state_reduce = state_reduce
        self.peer = next((r for r in self.ranks if r != dist.get_rank()), self.ranks[0])

    @staticmethod
    def check_options(reduce: str | None, bucket_mb: float,
                      state_reduce: str | None = "mean") -> None:
        """``grad_reduce=``, ``bucket_mb=`` and ``state_reduce=`` checked (with or without
        ``data_parallel``)."""
        if reduce not in REDUCTIONS:
            raise ValueError(f"grad_reduce must be 'mean' or None, got {reduce!r}")
        if state_reduce not in STATE_REDUCTIONS:
            raise ValueError(f"state_reduce must be 'mean', 'broadcast' or None, got "
                             f"{state_reduce!r}")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")

    @staticmethod
    def ranks_of(group: Any) -> tuple[int, ...]:
        """The global ranks of the caller's data-parallel ``group``, before any group of
        fpipe's is made."""
        ranks = tuple(dist.get_process_group_ranks(group))
        if dist.get_rank() not in ranks:
            raise PlacementError(f"rank {dist.get_rank()} is not in its data_parallel group "
                                 f"{list(ranks)}")
        return ranks

    def total(self, n: int, chunks: int, faults: RankFaults) -> int:
        """The global batch size; a BatchError on every replica if any shard is too small."""
        sizes = torch.tensor([n, int(n < chunks)], dtype=torch.int64, device=self.wire)
        faults.wait(dist.all_reduce(sizes, group=self.group, async_op=True),
                    "the batch sizes of its data-parallel replicas", self.peer)
        total, short = sizes.tolist()
        check_size(n, chunks)
        if short:
            raise BatchError(f"{short} data-parallel replica(s) of rank {dist.get_rank()} got "
                             f"fewer samples than chunks={chunks}, so no replica runs the step")
        return total

    def step(self, share: float, faults: RankFaults, held: Sequence[int],
             carry: list | None = None) -> GradReduce | None:
        """The reduction of one step's gradients (``None`` when they are left alone), with
        the share-weighted sums ``carry`` of earlier ``accumulate=True`` calls added."""
        if self.reduce is None:
            return None
        return GradReduce(self, share, faults, held, carry)

    def loss(self, loss: torch.Tensor, share: float, faults: RankFaults) -> torch.Tensor:
        """The global batch's mean loss, from this replica's mean over its shard."""
        message = (loss.detach().to(self.wire, torch.float64) * share).reshape(1)
        faults.wait(dist.all_reduce(message, group=self.group, async_op=True),
                    "the loss of its data-parallel replicas", self.peer)
        return message[0].to(loss.device, loss.dtype)

    def agree_state(self, states: dict[int, Any], share: float, faults: RankFaults) -> dict:
        """``{stage: new state}`` of this rank's stages, made alike on every replica as
        ``state_reduce`` says. ``"mean"``: each floating-point tensor leaf becomes the mean of
        the replicas' weighted by their ``share`` of the global batch (the gradients' weights;
        BatchNorm's running mean, linear in the batch mean, is then the one a replica given
        the whole batch's mean would keep); other leaves stay this replica's. ``"broadcast"``:
        every tensor leaf becomes the first replica's (DDP's ``broadcast_buffers``); leaves that
        are not tensors stay. Leaves are reduced in buckets per dtype, each wait bounded by the
        pipeline's timeout; the tensors returned are new (the step's are not written)."""
        how = self.state_reduce
        if how is None:
            return states
        flat = {s: tree_flatten(tree) for s, tree in sorted(states.items())}
        picked = [(s, i) for s, (leaves, _) in flat.items() for i, leaf in enumerate(leaves)
                  if torch.is_tensor(leaf) and (how == "broadcast" or leaf.is_floating_point())]
        tensors = [flat[s][0][i].detach() for s, i in picked]
        source = self.ranks[0]
        launched = []
        with torch.no_grad():
            for indices in _buckets(tensors, self.bucket_bytes):
                bucket = _pack(tensors, indices, self.wire)
                if how == "mean":
                    bucket.mul_(share)
                    work = dist.all_reduce(bucket, group=self.group, async_op=True)
                else:
                    work = dist.broadcast(bucket, source, group=self.group, async_op=True)
                launched.append((indices, bucket, work))
        out = {s: list(leaves) for s, (leaves, _) in flat.items()}
        peer = self.peer if how == "mean" or source == dist.get_rank() else source
        for indices, bucket, work in launched:
            stages = sorted({picked[k][0] for k in indices})
            faults.wait(work, f"the state of stage(s) {stages} from its data-parallel "
                        f"replicas", peer, stages[0])
            for k, piece in _unpack(bucket, tensors, indices):
                stage, i = picked[k]
                out[stage][i] = piece
        return {s: optree.tree_unflatten(spec, out[s]) for s, (_, spec) in flat.items()}


class GradReduce:
    """One step's gradient reduction on this rank: buckets launched per stage as its
    gradients become final (:meth:`cuts`, :meth:`launch`), waited in :meth:`apply`.
    ``carry``: per stage, the gradients earlier ``accumulate=True`` calls summed, already
    weighted by their shares (:mod:`fpipe._runtime.ranks.accumulate`), added to this step's
    weighted ones in the same buckets: one reduction for all the calls."""

    def __init__(self, dp: DataParallel, share: float, faults: RankFaults,
                 held: Sequence[int], carry: list | None = None) -> None:
        self.dp, self.share, self.faults, self.held = dp, share, faults, tuple(held)
        self.carry = carry
        self.buckets: list[tuple[int, list[int], torch.Tensor, Any]] = []
        self.launched: set[int] = set()

    def cuts(self, actions: Sequence[tuple]) -> list[tuple[int, list[int]]]:
        """``[(end, stages)]``: after ``actions[:end]`` the gradients of ``stages`` are final
        (their last backward or weight-gradient action on this rank), in action order."""
        last: dict[int, int] = {}
        for i, (kind, stage, _) in enumerate(actions):
            if kind.op in _FINAL:
                last[stage] = i + 1
        ends: dict[int, list[int]] = {}
        for stage, end in last.items():
            ends.setdefault(end, []).append(stage)
        return sorted(ends.items())

    #: What is waited for, in a timeout's message (after "the gradients of stage s from its
    #: data-parallel replicas").
    COLLECTIVE = ""

    def launch(self, stage: int, sums: Any) -> None:
        """Scale ``stage``'s final gradients by the replica's share, add what is carried, and
        start their buckets' reduction (:meth:`groups`, :meth:`pack`, :meth:`reduce`)."""
        if stage in self.launched:
            return
        self.launched.add(stage)
        found = self.with_carry(stage, sums.reduced(stage))
        if found is not None:
            grads, carried = found
            with torch.no_grad():
                for indices in self.groups(grads):
                    flat = self.pack(grads, indices).mul_(self.share)
                    if carried is not None:
                        flat.add_(self.pack(carried, indices))
                    out, work = self.reduce(flat)
                    self.buckets.append((stage, indices, out, work, grads))
        self.launched_stage(stage)

    def groups(self, grads: list) -> list[list[int]]:
        """The leaf indices reduced together: buckets of at most ``bucket_mb`` per dtype."""
        return _buckets(grads, self.dp.bucket_bytes)

    def pack(self, grads: Sequence[torch.Tensor], indices: list[int]) -> torch.Tensor:
        """One bucket's leaves end to end on the wire device (a new tensor)."""
        return _pack(grads, indices, self.dp.wire)

    def reduce(self, flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``(result, work)``: the bucket summed over the replicas, in place."""
        return flat, dist.all_reduce(flat, group=self.dp.group, async_op=True)

    def unpack(self, stage: int, out: torch.Tensor, like: list, indices: list[int],
               into: list) -> None:
        """A reduced bucket's pieces written into ``into`` (``stage``'s gradients), each with
        the shape, device and dtype of the leaf it reduces (``like``)."""
        for i, piece in _unpack(out, like, indices):
            into[i] = piece

    def launched_stage(self, stage: int) -> None:
        """After ``stage``'s reduction started (nothing here; FSDP2 frees its parameters)."""

    def with_carry(self, stage: int, grads: list | None) -> tuple[list, list | None] | None:
        """``(grads, carried)``: this step's gradients of ``stage`` and what ``carry`` holds
        for each of them (zeros for a leaf earlier calls did not use; ``None`` when nothing
        is carried); ``None`` for a stage without gradients."""
        if grads is None:
            return None
        carried = None if self.carry is None else self.carry[stage]
        if carried is not None:
            carried = [c if c is not None or g is None else torch.zeros_like(g)
                       for c, g in zip(carried, grads)]
        return grads, carried

    def apply(self, grads: list, sums: Any) -> list:
        """``grads`` (per stage, flat leaves) with every held stage's reduced: the stages not
        launched during the run are launched now, then every bucket is waited for."""
        for stage in self.held:
            self.launch(stage, sums)
        grads = [None if g is None else list(g) for g in grads]
        for stage, indices, out, work, like in self.buckets:
            self.faults.wait(work, f"the gradients of stage {stage} from its data-parallel "
                             f"replicas{self.COLLECTIVE}", self.dp.peer, stage)
            self.unpack(stage, out, like, indices, grads[stage])
        self.buckets.clear()
        return grads


def _buckets(grads: list, cap: int) -> list[list[int]]:
    """Leaf indices grouped by dtype, in order, each group at most ``cap`` bytes (a leaf
    larger than ``cap`` is a bucket of its own); ``None`` leaves (frozen) are left out."""
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        size = grad.numel() * grad.element_size()
        indices, used = open_.get(grad.dtype, ([], 0))
        if indices and used + size > cap:
            done.append(indices)
            indices, used = [], 0
        open_[grad.dtype] = (indices + [i], used + size)
    return done + [indices for indices, _ in open_.values() if indices]


def _pack(tensors: Sequence[torch.Tensor], indices: list[int],
          wire: torch.device) -> torch.Tensor:
    """One bucket: the tensors at ``indices`` flattened end to end on ``wire``, in a type
    every backend carries (booleans as bytes)."""
    return torch.cat([(t.view(torch.uint8) if t.dtype == torch.bool else t).reshape(-1).to(wire)
                      for t in (tensors[i] for i in indices)])


def _unpack(bucket: torch.Tensor, tensors: Sequence[torch.Tensor],
            indices: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
    """``(i, piece)`` for each index of a :func:`_pack`ed bucket: its part of ``bucket`` with
    the shape, device and dtype of ``tensors[i]``."""
    offset = 0
    for i in indices:
        like = tensors[i]
        yield i, bucket[offset:offset + like.numel()].view(like.shape).to(like.device,
                                                                          like.dtype)
        offset += like.numel()


def mesh_groups(group: Any, mesh: Any, data_parallel: Any) -> tuple[Any, Any]:
    """The pipeline's process group and the data-parallel one (or ``None``), from
    ``group=``/``data_parallel=`` or from a ``("dp", "pp")`` mesh."""
    if mesh is None:
        return (dist.group.WORLD if group is None else group), data_parallel
    if group is not None or data_parallel is not None:
        raise ValueError("give either mesh= or group=/data_parallel=, not both: the mesh's "
                         "'pp' and 'dp' dimensions are those groups")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names or "dp" not in names:
        raise ValueError(f"mesh= needs a DeviceMesh with dimensions named 'pp' (the "
                         f"pipeline's ranks) and 'dp' (the data-parallel replicas), e.g. "
                         f"init_device_mesh(device, (2, 4), mesh_dim_names=('dp', 'pp')); "
                         f"got dimension names {names}")
    if mesh.ndim != 2:
        raise ValueError(f"mesh= must have exactly the dimensions 'dp' and 'pp'; got {names}")
    return mesh.get_group("pp"), mesh.get_group("dp")
