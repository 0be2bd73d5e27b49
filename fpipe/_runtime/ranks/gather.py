"""Python objects from every rank, without numpy.

fpipe's ranks agree on a few small things when a pipeline is built (who holds what, which
groups to make, which ties' copies differ). torch's ``all_gather_object`` would do, but it
decodes through ``Tensor.numpy()``, and fpipe runs without numpy: here the pickled bytes
travel as ``uint8`` tensors (sizes first, then the padded bytes) and come back through
``bytes``.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fpipe.errors import PeerError

__all__ = ["all_gather_objects", "collective_device"]


def collective_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this process's current GPU on NCCL,
    the CPU on gloo (or a group with both backends)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_objects(obj: Any, group: Any = None, timeout: float | None = None,
                       waiting_for: str = "every rank") -> list:
    """Every rank's ``obj`` of ``group`` (default: the world), in rank order. Collective.

    With ``timeout`` (seconds), a rank that does not come within it (it never calls, or
    calls later) raises :class:`fpipe.errors.PeerError` here, saying it was ``waiting_for``,
    rather than waiting for the group's own timeout (tens of minutes)."""
    device = collective_device(group)
    data = pickle.dumps(obj)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    work = dist.all_gather(sizes, size, group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise PeerError(f"rank {dist.get_rank()} waited {timeout:g} s for {waiting_for}: "
                            f"{exc}", None) from exc
    lengths = [int(n) for n in sizes]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(gathered, buffer, group=group)
    return [pickle.loads(bytes(t[:n].tolist())) for t, n in zip(gathered, lengths)]
