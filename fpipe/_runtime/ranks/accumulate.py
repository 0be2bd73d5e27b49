"""Gradient accumulation on a distributed pipeline: ``value_and_grad(..., accumulate=True)``
keeps this rank's gradients instead of returning them, and the next call without it returns
the sum over all those calls, reduced once.

A call with ``accumulate=True`` runs its step without any data-parallel reduction, tie sum or
reduce-scatter: its gradients (this replica's, of its shard's mean) are weighted by the
replica's share of that call's global batch, as the reduction would weight them, and added to
the sums carried here. The last call hands the carried sums to its reduction, which adds them
to its own weighted gradients in the same buckets (:class:`~fpipe._runtime.ranks.
data_parallel.GradReduce`, :class:`~fpipe._runtime.ranks.fsdp.ShardReduce`): one all-reduce
(or one reduce-scatter per stage) for all the calls, as FSDP2's
``set_requires_gradient_sync(False)`` defers its reduce-scatter to the last backward. Without
replicas, or with ``grad_reduce=None``, the sums are added to the last call's as they are.

The per-call loss, and with replicas the two integers of the batch sizes, still cross every
call: each call returns its own global batch's loss.
"""

from __future__ import annotations

from typing import Any

import torch

from fpipe._runtime.step import plus

__all__ = ["Accumulated", "plus"]


class Accumulated:
    """The gradients carried from ``accumulate=True`` calls: per stage of the pipeline, flat
    leaves (``None`` for a stage not held here, and for a leaf no call differentiated)."""

    def __init__(self, n_stages: int) -> None:
        self.n_stages = n_stages
        self.sums: list | None = None

    @property
    def pending(self) -> bool:
        """Whether gradients wait for the last call."""
        return self.sums is not None

    def add(self, sums: Any, held: tuple[int, ...], weight: float) -> None:
        """One call's gradient sums (its :class:`~fpipe._runtime.step.GradSums`), times
        ``weight`` (the replica's share of the call's global batch, or 1), added."""
        if self.sums is None:
            self.sums = [None] * self.n_stages
        with torch.no_grad():
            for stage in held:
                grads = sums.stage(stage)
                if grads is None:
                    continue
                if weight != 1.0:
                    grads = [None if g is None else g * weight for g in grads]
                self.sums[stage] = plus(self.sums[stage], grads)

    def check_call(self, vjp: bool) -> None:
        """Refuse a ``vjp`` while gradients wait for the last ``value_and_grad``."""
        if vjp and self.pending:
            raise RuntimeError("gradients of value_and_grad(..., accumulate=True) wait for a "
                               "last value_and_grad call; vjp cannot add to them")

    def called(self, accumulate: bool, sums: Any, held: tuple[int, ...], replica: Any) -> None:
        """After a ``value_and_grad`` call: its sums kept (``accumulate``), weighted by the
        replica's share when the replicas' gradients are reduced (``grad_reduce="mean"``), or
        the carried ones dropped (the call returned them)."""
        if not accumulate:
            self.clear()
            return
        self.add(sums, held, replica.share if replica is not None and replica.weighted else 1.0)

    def carry(self) -> list | None:
        """The sums for the last call (read before its step; :meth:`clear` once it ended)."""
        return self.sums

    def clear(self) -> None:
        self.sums = None

