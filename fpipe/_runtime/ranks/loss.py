"""A step's loss, from the rank of the last stage to every rank of the pipeline: one broadcast
of its sum, its dtype and each micro-batch's part, which also ends the step in lockstep.

In a step run in one call it is posted *early*: by the last stage's rank as soon as its last
micro-batch's loss is computed (:meth:`LossBroadcast.cut`), by every other rank at its step's
first message (the header agreed). The loss then crosses while the backwards run, and no rank
waits for it at the end of the step. A ``vjp`` step, whose loss-free second call comes later,
posts it at its end, as the ranks leave the step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fpipe._runtime.ranks.faults import RankFaults

__all__ = ["LossBroadcast"]

#: Loss dtypes, by the code broadcast with the loss.
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class LossBroadcast:
    """One step's loss message (see the module's docstring): ``root`` is the global rank of
    the last stage, ``held`` whether it is this rank, ``early`` whether it is posted during
    the step."""

    def __init__(self, group: Any, root: int, held: bool, chunks: int, wire: torch.device,
                 faults: RankFaults, early: bool) -> None:
        self.group, self.root, self.held, self.chunks = group, root, held, chunks
        self.wire, self.faults, self.early = wire, faults, early
        self.message: torch.Tensor | None = None
        self.work: Any = None

    def cut(self, actions: tuple, last: int) -> int | None:
        """Where in this rank's ``actions`` it posts the loss during the step: after the last
        forward of stage ``last`` (the last stage's last loss), on its rank, when early."""
        if not (self.early and self.held):
            return None
        ends = [i + 1 for i, (kind, stage, _) in enumerate(actions)
                if kind.forward and stage == last]
        return ends[-1] if ends else None

    def post(self, losses: list | None) -> None:
        """Post the broadcast, once: on the root with ``losses`` (each micro-batch's; ``None``
        out of training, which sends zeros), elsewhere to receive."""
        if self.work is not None:
            return
        message = torch.zeros(2 + self.chunks, dtype=torch.float64, device=self.wire)
        if self.held and losses is not None:
            parts = torch.stack(losses).detach()
            message[0], message[1] = parts.sum(), _FLOATS.index(parts.dtype)
            message[2:] = parts
        self.message = message
        self.work = dist.broadcast(message, self.root, group=self.group, async_op=True)

    def result(self, losses: list | None, training: bool,
               device: torch.device) -> tuple | None:
        """In training, ``(loss, parts)`` once the broadcast is done (posted now with
        ``losses`` if not yet), on every rank: the loss in the stage's dtype on ``device``,
        the parts as float64; ``None`` out of training."""
        self.post(losses if training else None)
        self.faults.wait(self.work, lambda: f"the loss from rank {self.root}", self.root)
        if not training:
            return None
        message = self.message
        return message[0].to(device, _FLOATS[int(message[1])]), message[2:]
