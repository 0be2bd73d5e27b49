"""fpipe's own process groups for a distributed pipeline: the pipeline's, two per direction
of each pair of ranks that exchange values (the *links*), and the data-parallel one; made
collectively, in one order on every rank, and connected before the first step.

**Why two groups per direction.** Every ordered pair of ranks that exchanges values,
``a -> b``, has process groups of its own carrying only ``a``'s messages to ``b``: a group's
stream holds only sends on one side and only receives on the other, so no receive ever queues
behind a send (on NCCL, a send larger than its buffers blocks its stream until the peer's
receive runs; with one group for both directions, 1F1B's ``send(x); recv(g)`` against
``send(g); recv(x)`` would stall). The second group of a direction carries only the values
larger than announced (see :mod:`fpipe._runtime.ranks.p2p`). NCCL creates a communicator the
first time a pair uses it, blocking both hosts until both arrive; every group is therefore
connected when the pipeline is built, one pair after another in the same order on every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fpipe._runtime.ranks import agreement
from fpipe._runtime.ranks.agreement import Fingerprint
from fpipe._runtime.ranks.gather import all_gather_objects
from fpipe.errors import PeerError

__all__ = ["Groups", "make_groups", "pair_rank"]


class Groups(NamedTuple):
    """fpipe's own process groups on this rank: the pipeline's, the links to its peers
    (``{(src worker, dst worker): (values, grown)}``) and the data-parallel one (or ``None``)."""

    pipeline: Any
    links: dict
    data_parallel: Any


def make_groups(ranks: Sequence[int], pairs: set[tuple[int, int]], replicas: Sequence[int] | None,
                backend: str, timeout: float, wire: torch.device, built: Fingerprint) -> Groups:
    """This rank's groups: over its pipeline's ``ranks`` (worker ``w`` is ``ranks[w]``), two per
    direction of each pair of workers in ``pairs`` (``values`` carries one message per value,
    ``grown`` only the values larger than announced), and over its data-parallel ``replicas``.

    ``new_group`` must be called by every rank of the world in the same order, so every rank
    first learns what every other needs (one gather of objects over the world), then all
    make every pipeline's groups in one sorted order: replicas building their pipelines at once
    can neither wait on each other's groups nor pair with the wrong ones. Then this rank
    connects its links. ``built``, what this rank built, travels in that gather and is
    compared with every other rank's there (:func:`fpipe._runtime.ranks.agreement.check`), before
    any group is made."""
    me = dist.get_rank()
    needs = tuple(sorted({(ranks[a], ranks[b]) for x, y in pairs if x != y
                          for a, b in ((x, y), (y, x))}))
    mine = (tuple(ranks), needs, None if replicas is None else tuple(sorted(replicas)), built)
    everyone = all_gather_objects(
        mine, timeout=timeout,
        waiting_for="every rank of the job to build its pipeline: building is collective over "
                    "the whole world (every rank builds its own, every replica's at once)")
    pipelines = sorted({theirs[0] for theirs in everyone})
    for a, b in itertools.combinations(pipelines, 2):
        if set(a) & set(b):
            raise ValueError(f"two pipelines share ranks {sorted(set(a) & set(b))}: their "
                             f"groups are {list(a)} and {list(b)}; a rank runs one worker of "
                             f"one pipeline")
    agreement.check([theirs[3] for theirs in everyone])
    options = {"backend": backend, "timeout": timedelta(seconds=timeout)}
    own = dp = None
    for group_ranks in pipelines:
        group = dist.new_group(list(group_ranks), **options)
        if group_ranks == mine[0]:
            own = group
    links = {}
    for a, b in sorted({pair for theirs in everyone for pair in theirs[1]}):
        groups = tuple(dist.new_group([a, b], **options) for _ in range(2))
        if me in (a, b):
            links[ranks.index(a), ranks.index(b)] = groups
    for group_ranks in sorted({theirs[2] for theirs in everyone if theirs[2] is not None}):
        group = dist.new_group(list(group_ranks), **options)
        if group_ranks == mine[2]:
            dp = group
    _connect(ranks.index(me), links, ranks, timeout, wire)
    return Groups(own, links, dp)


def _connect(rank: int, links: dict, ranks: Sequence[int], timeout: float,
             wire: torch.device) -> None:
    """One small message over each group, in the same order on every rank: a communicator
    NCCL creates lazily blocks both hosts until both join, which mid-step could wait on a
    value the other rank has yet to compute. In this order, the first unconnected pair
    always has both its ranks there, so every pair connects."""
    token = torch.zeros(1, device=wire)
    for src, dst in sorted(links):
        peer = dst if src == rank else src
        for group in links[src, dst]:
            if dist.get_group_rank(group, ranks[peer]) != pair_rank(ranks[rank], ranks[peer]):
                raise RuntimeError(f"torch numbers the group of ranks {ranks[rank]} and "
                                   f"{ranks[peer]} otherwise than fpipe expects")
            try:
                post = group.send if src == rank else group.recv
                post([token], pair_rank(ranks[rank], ranks[peer]), 0).wait(
                    timedelta(seconds=timeout))
            except Exception as exc:
                raise PeerError(f"rank {ranks[rank]} could not reach rank {ranks[peer]} while "
                                f"building the pipeline: {exc}", ranks[peer]) from exc


def pair_rank(me: int, peer: int) -> int:
    """``peer``'s rank in the two-rank group of ``me`` and ``peer`` (global ranks):
    ``new_group`` numbers its members in order. Messages are posted on the group itself with
    it (``group.send``, what ``dist.isend`` ends in after its checks and the translation of
    the peer's rank, a third of the host's time of a small message)."""
    return int(peer > me)
