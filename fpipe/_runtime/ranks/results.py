"""What turns one rank's step into the job's: with data parallelism, the replica's share of
the global batch, its gradients' reduction, its loss and its state made alike on every replica;
then the tied leaves' gradients summed across stages and ranks. All of it happens here, in one
order, after the rank's actions (the gradient buckets are launched during them, by
:meth:`fpipe._runtime.ranks.driver.RankDriver.run`, and waited for here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch

from fpipe._runtime import microbatch
from fpipe._runtime.engine import nonfinite_error
from fpipe._runtime.ranks.accumulate import plus
from fpipe._runtime.ranks.data_parallel import DataParallel, GradReduce
from fpipe._runtime.ranks.faults import RankFaults
from fpipe._runtime.ranks.fsdp import Sharded, ShardReduce
from fpipe._runtime.ranks.tie_groups import TieGroups
from fpipe._runtime.step import Step
from fpipe.errors import NonFiniteLossError

__all__ = ["Replica", "Results"]


class Replica(NamedTuple):
    """A data-parallel step's part: this replica's share of the global batch and the
    reduction of its gradients (``None`` with ``grad_reduce=None`` or in inference)."""

    share: float
    reduce: GradReduce | None
    #: Whether the replicas' gradients are reduced, weighted by ``share`` (``grad_reduce``).
    weighted: bool = True


class Results:
    """One rank's reductions: ``data_parallel`` (``None`` without replicas) and ``ties`` over
    this rank's ``stages`` (their parameter structures, ``{stage: treespec}``); with
    ``sharded`` (FSDP2), the gradients reduce-scattered and returned as ``DTensor`` shards."""

    def __init__(self, data_parallel: DataParallel | None, ties: TieGroups | None,
                 faults: RankFaults, specs: Mapping[int, Any],
                 sharded: Sharded | None = None) -> None:
        self.data_parallel, self.ties, self.faults, self.specs = data_parallel, ties, faults, specs
        self.sharded = sharded

    def replica(self, n: int, chunks: int, training: bool, stateful: bool,
                carry: list | None = None, reduce: bool = True) -> Replica | None:
        """This replica's part of a step of ``n`` samples, when the replicas have one (training,
        or state to agree on): every replica learns the global batch, so a shard too small for
        ``chunks`` stops them all alike. Without replicas every rank knows ``n`` and refuses a
        batch too small by itself. ``carry``: what earlier ``accumulate=True`` calls summed,
        for the reduction; ``reduce=False`` (such a call itself): no reduction."""
        dp = self.data_parallel
        if dp is None or not (training or stateful):
            microbatch.check_size(n, chunks)
            return None
        share = n / dp.total(n, chunks, self.faults)
        if not (training and reduce):
            return Replica(share, None, dp.reduce is not None)
        if self.sharded is not None:
            return Replica(share, ShardReduce(dp, share, self.faults, tuple(self.specs),
                                              self.sharded, carry))
        return Replica(share, dp.step(share, self.faults, tuple(self.specs), carry))

    def grads(self, step: Step, replica: Replica | None, carry: list | None = None) -> dict:
        """``{stage: grads}`` of this rank's stages: the step's sums, then the replicas'
        reduction (waited for here; it adds ``carry``, the sums of earlier ``accumulate=True``
        calls, which are otherwise added here), then tied leaves summed across stages and
        ranks (a collective; on shards with FSDP2, alike on a replica's ranks). All are sums,
        so the order does not change the result."""
        grads = step.grads.out()
        if replica is not None and replica.reduce is not None:
            grads = self.faults.guarded(lambda: replica.reduce.apply(grads, step.grads))
        elif carry is not None:
            grads = [plus(g, c) for g, c in zip(grads, carry)]
        grads = self.faults.guarded(lambda: self.ties(grads))
        if self.sharded is not None:
            grads = self.sharded.wrap(grads)
        return {s: optree.tree_unflatten(spec, grads[s]) for s, spec in self.specs.items()}

    @staticmethod
    def refuse_nonfinite(parts: torch.Tensor, loss: torch.Tensor,
                         replica: Replica | None) -> None:
        """Raise for a non-finite loss. Every rank has each micro-batch's loss (and the global
        loss), so every rank refuses it; the step itself ended in lockstep, so the pipeline
        stays usable."""
        error = nonfinite_error(parts)
        if error is None and replica is not None and not bool(torch.isfinite(loss)):
            error = NonFiniteLossError(
                "the loss is not finite on another data-parallel replica; no gradient was "
                "returned. Build the pipeline with nonfinite='ignore' to handle this "
                "yourself", [])
        if error is not None:
            raise error

    def loss(self, loss: torch.Tensor, replica: Replica | None) -> torch.Tensor:
        """The global batch's loss on every replica (this replica's own without replicas)."""
        if replica is None:
            return loss
        return self.faults.guarded(
            lambda: self.data_parallel.loss(loss, replica.share, self.faults))

    def state(self, step: Step, replica: Replica | None) -> dict:
        """This rank's new ``{stage: state}``, made alike on every replica (``state_reduce``)."""
        state = {s: step.state[s] for s in self.specs}
        if replica is None:
            return state
        return self.faults.guarded(
            lambda: self.data_parallel.agree_state(state, replica.share, self.faults))
