"""Streams and transfers: compute and copies overlap on CUDA, ordered by events alone.

Each CUDA device gets a compute stream and a copy stream. A value crossing from one device to
another is copied on the destination's copy stream once the producer's compute stream reaches
it (an event), and the consumer's compute stream waits on the copy's event: no host
synchronisation in the hot path. At a step's boundaries the streams join the caller's current
stream, so parameters the caller just updated are seen, and gradients returned are complete
before the caller's next kernel. On the CPU all of this is the identity.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["Transport"]

_NO_STREAM = contextlib.nullcontext()


class Transport:
    def __init__(self, devices: list[torch.device]) -> None:
        cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.compute_streams = {d: torch.cuda.Stream(d) for d in cuda}
        self.copy_streams = {d: torch.cuda.Stream(d) for d in cuda}

    def compute(self, device: torch.device) -> AbstractContextManager:
        """Make ``device``'s compute stream current (a no-op on the CPU)."""
        stream = self.compute_streams.get(device)
        return _NO_STREAM if stream is None else torch.cuda.stream(stream)

    def begin_step(self) -> None:
        for device, stream in self.compute_streams.items():
            current = torch.cuda.current_stream(device)
            stream.wait_stream(current)
            self.copy_streams[device].wait_stream(current)

    def end_step(self) -> None:
        for device, stream in self.compute_streams.items():
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            current.wait_stream(self.copy_streams[device])

    def send(self, leaves: list, src: torch.device, dst: torch.device) -> tuple[list, Any]:
        """Start moving ``leaves`` from ``src`` to ``dst``; returns the moved leaves and the event
        the consumer must wait for (``None`` when nothing moved)."""
        if src == dst:
            return leaves, None
        copy_stream = self.copy_streams.get(dst) or self.copy_streams.get(src)
        if copy_stream is None:  # two different non-CUDA devices: a plain copy.
            return [_move(leaf, dst) for leaf in leaves], None
        produced = self.compute_streams.get(src)
        with torch.cuda.stream(copy_stream):
            if produced is not None:
                copy_stream.wait_stream(produced)
            moved = []
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    if leaf.is_cuda:
                        leaf.record_stream(copy_stream)
                    leaf = leaf.to(dst, non_blocking=dst.type == "cuda")
                moved.append(leaf)
            event = torch.cuda.Event()
            event.record(copy_stream)
        return moved, event

    def receive(self, leaves: list, event: Any, device: torch.device) -> list:
        """Order ``device``'s compute stream after the copy that produced ``leaves``."""
        if event is not None:
            stream = self.compute_streams.get(device)
            if stream is None:
                event.synchronize()
            else:
                stream.wait_event(event)
                for leaf in leaves:
                    if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                        leaf.record_stream(stream)
        return leaves


def _move(leaf: Any, device: torch.device) -> Any:
    return leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf
