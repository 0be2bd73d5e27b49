"""Random numbers in stages: a recompute draws what its forward drew, and every run draws alike.

Torch's generators are process-wide (one for the CPU, one per CUDA device) while the driver runs
stages on several threads, so draws of concurrent stages would interleave in an order no one
can reproduce. So a call of a stage that draws runs *seeded*: it holds its generators
exclusively, and each is seeded from (step seed, stage, micro-batch). The recompute of
(stage, micro-batch) reseeds identically and so draws identically. A stage on a CUDA device
is seeded on its device's generator and on the CPU's, since it may draw from either (as
torchgpipe saves and restores both). The step seed is one draw from the caller's CPU
generator, so ``torch.manual_seed`` before a step makes the whole step reproducible, and the
caller's generators are restored after the step.

Holding a generator exclusively serialises the stages that use it, so stages seen not to draw
run *watched* instead: they share the generator (a readers-writer lock keeps seeded calls out)
and its state is compared before and after. Nothing is trusted from earlier calls: a stage that
starts drawing later (dropout switched on, ``module.train()``, a data-dependent branch) is
caught by the comparison on the very call that draws, the step raises :class:`UnseededDraws`,
and the driver runs the step again with every call seeded, learning which stages draw. What a
stage was seen to do is only a hint for how to run it; a wrong hint costs one step, never a
mismatch between a forward and its recompute.

Where stages cannot run concurrently (one worker, a distributed rank) every call is seeded.
Other threads of the program that draw from torch's generators during a step are not
isolated from the step's draws.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["StepSeed", "RandomStages", "UnseededDraws"]

_MASK63 = (1 << 63) - 1
_CPU = torch.device("cpu")


def _mix(*values: int) -> int:
    """A 63-bit seed from integers: CPython's tuple hash (xxHash-style rounds) mixes nearby
    inputs into unrelated seeds, and for integers it is the same in every process and run
    (hash randomisation touches only str and bytes)."""
    return hash(values) & _MASK63


class UnseededDraws(Exception):
    """A stage drew random numbers in a call that ran unseeded, since it had not drawn before:
    the step must run again with every call seeded (the driver does so)."""

    def __init__(self, stage: int, microbatch: int) -> None:
        super().__init__(f"stage {stage} drew random numbers in micro-batch {microbatch}, "
                         f"which it had not done before")
        self.stage = stage
        self.microbatch = microbatch


class _SharedLock:
    """A readers-writer lock that prefers writers: watched calls share a generator, a seeded
    call holds it alone. Uncontended, it takes and frees one mutex per call."""

    __slots__ = ("_mutex", "_cond", "_readers", "_writer", "_waiting", "_sleeping")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writer = False
        self._waiting = 0  # writers waiting: readers let them go first
        self._sleeping = 0  # threads waiting on the condition, to be woken on release

    def acquire(self, exclusive: bool) -> None:
        with self._mutex:
            if exclusive:
                self._waiting += 1
                while self._writer or self._readers:
                    self._sleep()
                self._waiting -= 1
                self._writer = True
            else:
                while self._writer or self._waiting:
                    self._sleep()
                self._readers += 1

    def _sleep(self) -> None:
        self._sleeping += 1
        try:
            self._cond.wait()
        finally:
            self._sleeping -= 1

    def release(self, exclusive: bool) -> None:
        with self._mutex:
            if exclusive:
                self._writer = False
            else:
                self._readers -= 1
            if self._sleeping:
                self._cond.notify_all()


class _Generator:
    """One of torch's process-wide generators and the lock every fpipe step shares for it."""

    __slots__ = ("key", "torch", "lock")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.torch = torch.cuda.default_generators[key[1]] if key[0] == "cuda" \
            else torch.default_generator
        self.lock = _SharedLock()

    def state(self) -> torch.Tensor:
        return self.torch.get_state()

    def seed(self, seed: int, stage: int, microbatch: int, i: int) -> None:
        """Seed for the call of (stage, micro-batch) from the step's seed; ``i``: which of the
        stage's generators this is."""
        self.torch.manual_seed(_mix(seed, stage, microbatch, i))


_generators: dict[tuple, _Generator] = {}
_generators_guard = threading.Lock()


def _generator(device: torch.device) -> _Generator:
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        key = ("cuda", index)
    else:  # meta and other devices draw from nothing fpipe can seed; lock the CPU's
        key = ("cpu", -1)
    with _generators_guard:
        if key not in _generators:
            _generators[key] = _Generator(key)
        return _generators[key]


def _generators_of(device: torch.device) -> tuple[_Generator, ...]:
    """The generators a stage on ``device`` may draw from, in one global order (so that calls
    holding several never wait on each other in a cycle)."""
    found = {g.key: g for g in (_generator(device), _generator(_CPU))}
    return tuple(found[key] for key in sorted(found))


class StepSeed:
    """Draws a step's seed from the caller's CPU generator (unless the step already has one, as
    in the second half of a step run in two calls), and restores the generators after the
    step. Both hold the generators alone, so concurrent steps never see a half-set state."""

    def __init__(self, devices: list[torch.device], seed: int | None = None) -> None:
        self.generators = sorted({g.key: g for d in devices for g in _generators_of(d)}.values(),
                                 key=lambda g: g.key)
        with _holding(self.generators):
            if seed is None:
                seed = int(torch.empty((), dtype=torch.int64).random_())
            self.states = [g.torch.get_state() for g in self.generators]
        self.seed = seed

    def restore(self) -> None:
        with _holding(self.generators):
            for g, state in zip(self.generators, self.states):
                g.torch.set_state(state)


class _holding:
    """Hold ``generators`` exclusively (in their global order)."""

    def __init__(self, generators: list[_Generator]) -> None:
        self.generators = generators

    def __enter__(self) -> None:
        for g in self.generators:
            g.lock.acquire(True)

    def __exit__(self, *exc: Any) -> None:
        for g in reversed(self.generators):
            g.lock.release(True)


class RandomStages:
    """How each stage's calls run: seeded, or watched while it is seen not to draw.

    ``draws[(stage, training, generator)]`` is what the stage's seeded calls showed: ``True``
    once it drew (and for good), ``False`` while it never did, absent before its first call.
    A stage is judged separately for inference and training (dropout draws only in training).
    With ``concurrent=False`` every call is seeded and nothing needs learning.
    """

    def __init__(self, devices: list[torch.device], concurrent: bool = True) -> None:
        self.generators = [_generators_of(d) for d in devices]
        self.concurrent = concurrent
        self.draws: dict[tuple, bool] = {}

    def scope(self, seed: int, stage: int, microbatch: int, training: bool,
              seeded: bool = False, check: bool = False) -> _Call:
        """Where (stage, micro-batch) runs; ``seeded`` forces every generator to be seeded
        (a step run again after :class:`UnseededDraws`). With ``check`` the call always finds
        out whether it drew (``call.drew``): a forward and its recompute must agree."""
        if not self.concurrent and not check:  # seeded, with nothing to learn or check
            return _Seeded(self.generators[stage], seed, stage, microbatch)
        return _Call(self, seed, stage, microbatch, training,
                     seeded or not self.concurrent, check)


class _Seeded:
    """A call where stages cannot run concurrently and nothing is checked: its generators held
    alone and seeded, as :class:`_Call` holds them then, without the bookkeeping."""

    __slots__ = ("generators", "seed", "stage", "microbatch")
    drew = False  # not found out (no check asked for it)

    def __init__(self, generators: tuple[_Generator, ...], seed: int, stage: int,
                 microbatch: int) -> None:
        self.generators, self.seed, self.stage, self.microbatch = \
            generators, seed, stage, microbatch

    def __enter__(self) -> _Seeded:
        for i, g in enumerate(self.generators):
            g.lock.acquire(True)
            g.seed(self.seed, self.stage, self.microbatch, i)
        return self

    def __exit__(self, *exc: Any) -> None:
        for g in reversed(self.generators):
            g.lock.release(True)


class _Call:
    """One call of a stage: holds, seeds or watches its generators, and learns from them."""

    __slots__ = ("random", "seed", "stage", "microbatch", "training", "seeded", "check", "held",
                 "drew")

    def __init__(self, random: RandomStages, seed: int, stage: int, microbatch: int,
                 training: bool, seeded: bool, check: bool) -> None:
        self.random, self.seed, self.stage = random, seed, stage
        self.microbatch, self.training, self.seeded = microbatch, training, seeded
        self.check = check
        self.held: list[tuple[_Generator, bool, torch.Tensor | None]] = []
        self.drew = False

    def __enter__(self) -> _Call:
        random, stage, training = self.random, self.stage, self.training
        draws, held = random.draws, self.held
        for i, g in enumerate(random.generators[stage]):
            seen = draws.get((stage, training, g.key))
            exclusive = self.seeded or seen is not False
            g.lock.acquire(exclusive)
            if exclusive:
                g.seed(self.seed, stage, self.microbatch, i)
            # A seeded call compares only to learn or check; when neither is needed, it skips.
            learn = self.check or not exclusive or (random.concurrent and seen is not True)
            held.append((g, exclusive, g.state() if learn else None))
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        unseeded = False
        held = self.held
        while held:
            g, exclusive, before = held.pop()
            if before is not None:
                drew = not torch.equal(g.state(), before)
                self.drew = self.drew or drew
                key = (self.stage, self.training, g.key)
                draws = self.random.draws
                if exclusive:
                    draws[key] = drew or draws.get(key, False)
                elif drew:
                    unseeded = True
            g.lock.release(exclusive)
        if unseeded and exc_type is None:
            raise UnseededDraws(self.stage, self.microbatch)
