"""Tied weights in ``fpipe.distributed``: the sum of a tie's gradients across the ranks that
hold its members, by ``all_reduce(SUM)`` over a process group of just those ranks.

Built collectively with the pipeline. Every rank reads the tie map and checks what it holds
(:mod:`fpipe._runtime.ties`), then every rank learns every other rank's findings in one
gather of objects (:mod:`fpipe._runtime.ranks.gather`): a bad tie map, a map that differs between
ranks, or members on two ranks whose shape or dtype differ raise the same error on every
rank, before any group exists (never one rank raising while the others wait). Copies on one
rank are compared there; copies on several are compared once, at build, by a MAX and a MIN
all-reduce over their group.

Worker ``w`` of the program runs on global rank ``ranks[w]``. Each set of workers holding some
tie's members gets one group (ties over the same set share it, and are reduced in one flattened
call per dtype); a tie whose members are all on one rank is summed there with no group. Every
process of the job calls ``new_group`` for every pipeline's groups (pipelines of several
data-parallel replicas each have their own ranks), in one order, as ``new_group`` requires.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import optree
import torch
import torch.distributed as dist

from fpipe._runtime.ranks.driver import backend_for
from fpipe._runtime.ranks.faults import RankFaults
from fpipe._runtime.ranks.gather import all_gather_objects
from fpipe._runtime.ties import assign, check_local, describe, parse, slots, targets, total
from fpipe._runtime.values import frozen
from fpipe.errors import PlacementError

__all__ = ["TieGroups"]


class _Bucket:
    """The ties one group reduces in one call: their gradients of one dtype, flattened."""

    __slots__ = ("group", "ranks", "ties", "dtype")

    def __init__(self, group: Any, ranks: tuple[int, ...], ties: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.group, self.ranks, self.ties, self.dtype = group, ranks, ties, dtype


class TieGroups:
    """This rank's part of the ties: :meth:`__call__` gives a step's flat per-stage gradients
    with every held tied leaf's replaced by its tie's sum over all members (collective: every
    rank of the pipeline calls it after every step that returns gradients)."""

    def __init__(self, ties: Iterable | None, params: Mapping[int, Any],
                 placement: tuple[int, ...], ranks: tuple[int, ...], rank: int,
                 device: torch.device, wire: torch.device, grad_dtype: torch.dtype | None,
                 timeout: float, faults: RankFaults) -> None:
        self.rank, self.wire, self.faults = rank, wire, faults
        self.ties, mine = _read(ties, params, len(placement), grad_dtype)
        records = all_gather_objects((tuple(ranks), rank, mine), timeout=timeout,
                                     waiting_for="every rank's tie map")
        _check_all(records, tuple(ranks))
        self.places = slots(self.ties, params)
        self.targets = targets(self.places, params, grad_dtype)
        leaves = {s: optree.tree_leaves(tree) for s, tree in params.items()}
        self.shapes = tuple(leaves[held[0][0]][held[0][1]].shape if held else None
                            for held in self.places)
        worker = ranks.index(rank)
        spans = [tuple(sorted({placement[m.stage] for m in tie})) for tie in self.ties]
        self.local = tuple(t for t, span in enumerate(spans) if span == (worker,))
        self.groups: list = []  # this rank's tie groups, aborted with fpipe's on failure
        self.buckets: list[_Bucket] = []
        pipelines = sorted({record[0] for record in records})
        for span in sorted({span for span in spans if len(span) > 1}):
            for pipeline in pipelines:
                members = tuple(pipeline[w] for w in span)
                group = dist.new_group(list(members), backend=backend_for(device),
                                       timeout=timedelta(seconds=timeout))
                if pipeline == tuple(ranks) and worker in span:
                    self.groups.append(group)
                    self._bucket(group, members, [t for t, s in enumerate(spans) if s == span])
        faults.groups.extend(self.groups)
        self._check_values(params)

    def _check_values(self, params: Mapping[int, Any]) -> None:
        """Copies of a tie on several ranks must start equal (they stay equal only if they
        do): each bucket's values are reduced by MAX and by MIN over its group and compared,
        element by element; then every rank of the job learns of every mismatch (one
        gather of objects (:mod:`fpipe._runtime.ranks.gather`)), so all raise alike. Once, at
        build."""
        leaves = {s: optree.tree_leaves(tree) for s, tree in params.items()}
        differ = []
        for bucket in self.buckets:
            values = [leaves[s][i].detach().reshape(-1).to(self.wire, torch.float64)
                      for s, i in (self.places[t][0] for t in bucket.ties)]
            high, low = torch.cat(values), torch.cat(values)
            peer = next(r for r in bucket.ranks if r != self.rank)
            for flat, op in ((high, dist.ReduceOp.MAX), (low, dist.ReduceOp.MIN)):
                self.faults.wait(dist.all_reduce(flat, op=op, group=bucket.group,
                                                 async_op=True),
                                 f"the values of ties {list(bucket.ties)}", peer)
            offset = 0
            for t, value in zip(bucket.ties, values):
                end = offset + value.numel()
                if not torch.equal(high[offset:end], low[offset:end]):
                    differ.append((describe(self.ties[t], t), bucket.ranks))
                offset = end
        for found in all_gather_objects(differ, timeout=self.faults.timeout,
                                        waiting_for="every rank's tied values"):
            for tie, ranks in found:
                raise ValueError(f"{tie}: its copies on ranks {list(ranks)} hold different "
                                 f"values; a tie's copies must start equal: seed every rank "
                                 f"alike before building them (torch.manual_seed), or load "
                                 f"them from one checkpoint")

    def _bucket(self, group: Any, members: tuple[int, ...], ties: list[int]) -> None:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for t in ties:
            dtype = next((target[1] for target in self.targets[t] if target is not None),
                         torch.float64)  # (a frozen tie's members get nothing: any dtype)
            by_dtype.setdefault(dtype, []).append(t)
        for dtype, found in by_dtype.items():
            self.buckets.append(_Bucket(group, members, tuple(found), dtype))

    def __bool__(self) -> bool:
        return bool(self.ties)

    def __call__(self, grads: list) -> list:
        if not self.ties:
            return grads
        grads = [None if g is None else list(g) for g in grads]
        for t in self.local:
            value = total(grads, self.places[t])
            if value is not None:
                assign(grads, self.places[t], value, self.targets[t])
        calls = []
        for bucket in self.buckets:
            flat = torch.cat([self._partial(grads, t, bucket.dtype) for t in bucket.ties])
            calls.append((bucket, flat, dist.all_reduce(flat, group=bucket.group,
                                                        async_op=True)))
        for bucket, flat, work in calls:
            peer = next(r for r in bucket.ranks if r != self.rank)
            self.faults.wait(work, f"the summed gradients of ties {list(bucket.ties)} from "
                                   f"ranks {list(bucket.ranks)}", peer)
            offset = 0
            for t in bucket.ties:
                size = self.shapes[t].numel()
                value = flat[offset:offset + size].view(self.shapes[t])
                assign(grads, self.places[t], value, self.targets[t])
                offset += size
        return grads

    def _partial(self, grads: list, t: int, dtype: torch.dtype) -> torch.Tensor:
        """The sum of tie ``t``'s members held here, flat, on the wire (zeros if none has a
        gradient)."""
        shape = self.shapes[t]
        device = next((target[0] for target in self.targets[t] if target is not None),
                      self.wire)
        value = total(grads, self.places[t], lambda: torch.zeros(shape, dtype=dtype,
                                                                 device=device))
        return value.reshape(-1).to(self.wire, dtype)


def _read(ties: Iterable | None, params: Mapping[int, Any], n_stages: int,
          grad_dtype: torch.dtype | None) -> tuple[tuple, tuple]:
    """The parsed tie map (empty if it is bad) and what this rank tells the others:
    ``(tie map, {(tie, stage, name): (shape, dtype, grad dtype, trained)} of its members,
    error)``, the error as ``(type name, message)`` or ``None``. Each is what decides the bytes
    the member's rank puts into its tie's all-reduce (a frozen member gets no gradient: its
    rank would send another dtype, or nothing, where the others send a sum)."""
    try:
        parsed = parse(ties, n_stages)
        places = slots(parsed, params)
        check_local(parsed, places, params)
    except (TypeError, ValueError) as exc:
        return (), (None, {}, (type(exc).__name__, str(exc)))
    leaves = {s: optree.tree_leaves(tree) for s, tree in params.items()}
    found = {}
    for t, (tie, held) in enumerate(zip(parsed, places)):
        for member, (s, i) in zip([m for m in tie if m.stage in params], held):
            leaf = leaves[s][i]
            found[(t, *member)] = (tuple(leaf.shape), str(leaf.dtype),
                                   str(grad_dtype or leaf.dtype),
                                   "frozen" if frozen(leaf) else "trained")
    return parsed, (parsed, found, None)


def _check_all(records: list, ranks: tuple[int, ...]) -> None:
    """Every rank's findings, checked alike on every rank: the first rank's error, tie maps
    that differ, members of one tie (on this pipeline's ranks) that disagree (a
    :class:`~fpipe.errors.PlacementError`: ranks built differently)."""
    for _, rank, (_, _, error) in records:
        if error is not None:
            kind = TypeError if error[0] == "TypeError" else ValueError
            raise kind(f"rank {rank}: {error[1]}")
    first_rank, (first_map, _, _) = records[0][1], records[0][2]
    for _, rank, (tie_map, _, _) in records[1:]:
        if tie_map != first_map:
            raise ValueError(f"rank {first_rank} and rank {rank} were given different tie "
                             f"maps: every rank passes the whole tie map, "
                             f"{list(first_map)} against {list(tie_map)}")
    found: dict = {}
    for pipeline, rank, (_, described, _) in records:
        if pipeline == ranks:
            found.update({key: (value, rank) for key, value in described.items()})
    for t, tie in enumerate(first_map):
        known = [(m, *found[(t, *m)]) for m in tie if (t, *m) in found]
        for member, value, rank in known[1:]:
            a, (seen, seen_rank) = known[0][0], known[0][1:]
            if value != seen:
                raise PlacementError(
                    f"{describe(tie, t)}: stage {a.stage}'s {a.name!r} (rank {seen_rank}) is "
                    f"{seen[3]}, {seen[0]} {seen[1]} with {seen[2]} gradients, stage "
                    f"{member.stage}'s {member.name!r} (rank {rank}) {value[3]}, {value[0]} "
                    f"{value[1]} with {value[2]}; tied leaves must have equal shape and "
                    f"dtype, and be trained or frozen alike (a tied weight is one tensor; "
                    f"no step was run)")
