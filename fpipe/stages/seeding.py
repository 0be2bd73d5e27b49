"""What a seed determines for a model built on ``meta``: each submodule's initial values.

Processes of one job hold different stages, and jobs of one model cut it differently (1F1B on
4 workers, interleaved on 2, one process in a test). Drawing the initialisers from the global
random stream in turn would make a tensor's value depend on what was drawn before it, so on
the cut and on the stages held. Instead:

- every process draws **one** base seed, ``torch.randint(0, 2**62, ())``, from the global
  generator, whatever it holds: the caller's random state advances alike on every rank;
- each submodule is initialised with the CPU generator and its device's generator seeded by
  :func:`submodule_seed` of the base and the submodule's name (its qualified name in the
  model, ``"blocks.3.attn"``), inside ``torch.random.fork_rng``, so nothing else is drawn from
  the caller's stream.

So a submodule's values depend on the seed, its name and its device type only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["draw_base", "submodule_seed", "seeded"]


def draw_base() -> int:
    """The one draw from the caller's generator (the same on every process)."""
    return int(torch.randint(0, 2**62, ()))


def submodule_seed(base: int, name: str) -> int:
    """A stable 64-bit seed for the submodule called ``name``: the first 8 bytes of
    ``blake2b(f"{base}/{name}")``, little-endian. Python's ``hash`` is salted per process,
    so it would give each rank another value."""
    digest = hashlib.blake2b(f"{base}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The CPU generator and ``device``'s seeded with ``seed``; both restored on the way out."""
    if device.type in ("cpu", "meta"):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.default_generator.manual_seed(seed)
        with module.device(index):
            module.manual_seed(seed)  # this device's generator only (not manual_seed_all)
        yield
