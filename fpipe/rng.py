"""Random numbers in stages: the same draws in a recompute, the same draws in every run.

Torch's generators are process-wide (one for the CPU, one per CUDA device), while the driver
runs stages on several threads at once, so draws of concurrent stages would interleave in an
order no one can reproduce. Instead each call of a stage that draws random numbers gets its own
generator state: the generator of the stage's device is seeded from (step seed, stage,
micro-batch) under a lock held for the call. The recompute of (stage, micro-batch) reseeds
identically and so draws identically. The step seed is one draw from the caller's CPU generator,
so ``torch.manual_seed`` before a step makes the whole step reproducible, and the caller's
generators are restored after the step.

Whether a stage draws at all is learnt on its first calls (with the generator's state compared
before and after, under the lock): stages that do not draw then run without the lock, fully in
parallel. A stage is judged separately for inference and for training, since modules such as
dropout draw only in training.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

__all__ = ["StepSeed", "RandomStages"]

_MASK64 = (1 << 64) - 1
_UNSEEDED = nullcontext()


def _mix(*values: int) -> int:
    """A 63-bit hash of integers (splitmix64 rounds): nearby inputs give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h >> 1


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
    return torch.default_generator


_locks: dict[tuple, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(device: torch.device) -> threading.Lock:
    key = (device.type, device.index)
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


class StepSeed:
    """Draws a step's seed from the caller's generators (unless the step already has one, as
    in the second half of a step run in two calls), and restores them after the step."""

    def __init__(self, devices: list[torch.device], seed: int | None = None) -> None:
        self.generators = list({id(g): g for g in map(_generator, devices)}.values())
        self.seed = int(torch.empty((), dtype=torch.int64).random_()) if seed is None else seed
        self.states = [g.get_state() for g in self.generators]

    def restore(self) -> None:
        for g, state in zip(self.generators, self.states):
            g.set_state(state)


class RandomStages:
    """Per stage and mode, whether it draws random numbers (``None`` until known)."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.locks = [_lock(d) for d in devices]
        self.draws: dict[tuple[int, bool], bool] = {}

    def scope(self, seed: int, stage: int, microbatch: int,
              training: bool) -> AbstractContextManager:
        """Where (stage, micro-batch) runs: seeded under the lock, unless it never draws."""
        draws = self.draws.get((stage, training))
        if draws is False:
            return _UNSEEDED
        return self._seeded(seed, stage, microbatch, training, draws)

    @contextmanager
    def _seeded(self, seed: int, stage: int, microbatch: int, training: bool,
                draws: bool | None) -> Iterator[None]:
        generator = _generator(self.devices[stage])
        with self.locks[stage]:
            generator.manual_seed(_mix(seed, stage, microbatch))
            if draws is None:
                before = generator.get_state()
            yield
            if draws is None:
                self.draws[(stage, training)] = not torch.equal(before, generator.get_state())
