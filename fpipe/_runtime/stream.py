"""Streams and transfers: compute and copies overlap on CUDA, ordered by events alone.

Each CUDA device gets a compute stream and a copy stream. A value crossing from one device to
another is copied on the copy streams once the producer's compute stream reaches it, and the
consumer's compute stream waits on the copy's event: no host synchronisation in the hot path.
At a step's boundaries the streams join the caller's current stream, so parameters the caller
just updated are seen, and gradients returned are complete before the caller's next kernel.
On the CPU all of this is the identity.

The discipline that makes this sound: every kernel a worker launches is launched inside
:meth:`Transport.compute` (the device's compute stream), or inside :meth:`Transport.send` /
:meth:`Transport.receive` (the copy streams). A kernel launched anywhere else goes to the
worker thread's default stream, which no event orders against these streams.
``tests/test_stream_discipline.py`` checks the rule on the CPU, op by op.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["Transport"]

_NO_STREAM = contextlib.nullcontext()


class Transport:
    """The streams of one pipeline's CUDA devices and the moves between devices."""

    def __init__(self, devices: list[torch.device]) -> None:
        cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.compute_streams = {d: torch.cuda.Stream(d) for d in cuda}
        self.copy_streams = {d: torch.cuda.Stream(d) for d in cuda}

    def compute(self, device: torch.device) -> AbstractContextManager:
        """Make ``device``'s compute stream current (a no-op on the CPU)."""
        stream = self.compute_streams.get(device)
        return _NO_STREAM if stream is None else torch.cuda.stream(stream)

    def begin_step(self) -> None:
        """Order every stream after the caller's current stream (what the caller enqueued
        before the step, such as an optimizer's update, is seen by the step's kernels)."""
        for device, stream in self.compute_streams.items():
            current = torch.cuda.current_stream(device)
            stream.wait_stream(current)
            self.copy_streams[device].wait_stream(current)

    def end_step(self) -> None:
        """Order the caller's current stream after every stream (the step's results are
        complete before the caller's next kernel, and memory the caller frees is safe)."""
        for device, stream in self.compute_streams.items():
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            current.wait_stream(self.copy_streams[device])

    def send(self, leaves: list, src: torch.device, dst: torch.device) -> tuple[list, Any]:
        """Start moving ``leaves`` from ``src`` to ``dst``; returns the moved leaves and the event
        the consumer must wait for (``None`` when nothing is left to wait for).

        The rule, by direction (torchgpipe's, and what ``Tensor.to`` needs):

        - CUDA to CUDA: a cross-device copy is ordered on the current streams of *both*
          devices (the memcpy runs on the source's, and the destination's waits for it), so
          both copy streams are made current; else the memcpy would run on the source's
          default stream. The source's copy stream first waits for its compute stream (the
          producer), the source tensor is ``record_stream``-ed on the copy stream that reads
          it, and the event is recorded on the destination's copy stream, after the copy.
        - CPU to CUDA: non-blocking, on the destination's copy stream (the CPU producer is
          done; a pinned source is kept alive by the pinned-memory allocator's own event).
        - CUDA to CPU: blocking. A non-blocking copy would return before the data lands and the
          CPU consumer, which waits for no event, would read it early. No event is returned.
        """
        if src == dst:
            return leaves, None
        src_copy, dst_copy = self.copy_streams.get(src), self.copy_streams.get(dst)
        if src_copy is None and dst_copy is None:  # no CUDA stream involved: a plain copy.
            return [_move(leaf, dst) for leaf in leaves], None
        if src_copy is not None:
            src_copy.wait_stream(self.compute_streams[src])
        blocking = dst.type != "cuda"
        with _current(src_copy), _current(dst_copy):
            moved = [_copy(leaf, dst, src_copy, blocking) for leaf in leaves]
            if blocking:
                return moved, None
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dst))
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


def _current(stream: torch.cuda.Stream | None) -> AbstractContextManager:
    """``stream`` made current on its device (and nothing when there is none)."""
    return _NO_STREAM if stream is None else torch.cuda.stream(stream)


def _copy(leaf: Any, dst: torch.device, reader: torch.cuda.Stream | None,
          blocking: bool) -> Any:
    """One leaf moved to ``dst`` on the current streams. A CUDA source read by a non-blocking
    copy is ``record_stream``-ed on ``reader``: the allocator must not hand its memory to its
    own stream's next kernel before the copy has read it. A blocking copy is done on return."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if leaf.is_cuda and reader is not None and not blocking:
        leaf.record_stream(reader)
    return leaf.to(dst, non_blocking=not blocking)
