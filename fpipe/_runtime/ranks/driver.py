"""The :class:`RankDriver`: one rank's part of every step of a distributed pipeline, as the
:class:`~fpipe._runtime.driver.LocalDriver` is the local face's. It owns fpipe's process groups
(:mod:`fpipe._runtime.ranks.p2p`), the failure state (:mod:`fpipe._runtime.ranks.faults`)
and the compiled programs, and runs a step in lockstep with the other ranks: a header summed
over every rank (:mod:`fpipe._runtime.ranks.header`), this rank's actions, the loss broadcast
from the rank of the last stage (:mod:`fpipe._runtime.ranks.loss`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from fpipe._runtime import microbatch
from fpipe._runtime.autodiff import flatten
from fpipe._runtime.engine import output_cotangents
from fpipe._runtime.instructions import compiled
from fpipe._runtime.interpreter import Interpreter
from fpipe._runtime.ranks import header
from fpipe._runtime.ranks.agreement import Fingerprint
from fpipe._runtime.ranks.data_parallel import DataParallel, GradReduce
from fpipe._runtime.ranks.faults import RankFaults, at_rank
from fpipe._runtime.ranks.header import Header
from fpipe._runtime.ranks.inputs import to
from fpipe._runtime.ranks.links import make_groups
from fpipe._runtime.ranks.loss import LossBroadcast
from fpipe._runtime.ranks.p2p import RankChannel, Routes, send_orders
from fpipe._runtime.rng import StepSeed
from fpipe._runtime.step import Step, Vjp
from fpipe.schedules.actions import Program
from fpipe.timeline import Recorder

__all__ = ["RankDriver", "backend_for"]


def backend_for(device: torch.device | str) -> str:
    """The backend that carries tensors of ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class RankDriver:
    """This rank's worker of ``program``: its groups, links and failure state, built by the
    pipeline's ranks alike (collectively) when the pipeline is.

    ``rank`` is this rank's worker (its index in ``ranks``, the global rank of each worker);
    everything a step does is in workers, and only messages and ``torch.distributed`` calls
    name global ranks. ``built``: what this rank built, compared with every rank's before any
    group is made (:mod:`fpipe._runtime.ranks.agreement`)."""

    def __init__(self, ranks: tuple[int, ...], program: Program, interpreter: Interpreter,
                 device: torch.device, timeout: float, plans: dict,
                 replicas: tuple[int, ...] | None, built: Fingerprint) -> None:
        self.ranks = ranks
        self.rank = ranks.index(dist.get_rank())
        self.program, self.interpreter = program, interpreter
        self.device = device
        self.backend = backend = backend_for(device)
        # NCCL carries tensors of this rank's stage device; gloo carries CPU tensors.
        self.wire = device if backend == "nccl" else torch.device("cpu")
        self.faults = RankFaults(ranks[self.rank], timeout)
        owners = program.placement
        pairs = {(owners[s - 1], owners[s]) for s in range(1, program.n_stages)}
        pairs |= {(owners[a], owners[b]) for a, b in interpreter.routes.values()}
        # fpipe's own groups: aborting them on failure leaves the caller's group to the caller.
        self.group, self.links, self.dp_group = make_groups(ranks, pairs, replicas, backend,
                                                            timeout, self.wire, built)
        self.faults.groups = [self.group, *(g for pair in self.links.values() for g in pair)]
        if self.dp_group is not None:
            self.faults.groups.append(self.dp_group)
        self.calls = 0
        self._compiled = plans  # (program, training) -> compiled plan
        self._routes: dict = {}  # per program run: its messages' routes (p2p.Routes)
        self._known: dict = {}  # per key: its value's shapes at the last step (p2p)

    def plan(self, program: Program, training: bool, stateful: bool) -> tuple:
        """``program`` validated and compiled (once)."""
        return compiled(self._compiled, program, training, stateful)

    def agreed(self, x: Any, target: Any, call: int,
               defer: bool = False) -> tuple[int, int, Header | None]:
        """``(n, seed, header)``: the batch size and seed of a call (:mod:`.header`), its seed
        drawn from this rank's generators (left as they were), under the failure guard. With
        ``defer`` (nothing waits on ``n`` before the step's first message) the rank of stage
        0 does not wait: it returns its posted ``header``, whose outcome the step's channel
        reads at its first message. Elsewhere ``header`` is ``None``, and a bad input or
        target, which the header tells every rank, is raised by every rank by itself."""
        seed = StepSeed([self.device])
        try:
            posted = self.faults.guarded(lambda: header.post(
                x, target, seed.seed, call, self.calls, self.rank,
                (self.program.placement[0], self.program.placement[-1]), self.ranks,
                self.group, self.backend, self.wire, self.faults))
        finally:
            seed.restore()
        if defer and posted.deferrable:
            return posted.n, posted.seed, posted
        n, seed_value, error = self.faults.guarded(posted.outcome)
        if error is not None:  # every rank knows it, so every rank raises it by itself
            raise error
        return n, seed_value, None

    def new_step(self, program: Program, training: bool, open_ended: bool, params: list,
                 states: list, x: Any, target: Any, n: int, seed: int, record: Recorder | None,
                 stateful: bool, posted: Header | None = None) -> tuple[Step, RankChannel]:
        """A step of ``n`` samples agreed by the header (or to be, ``posted``, on stage 0's
        rank): this rank's micro-batches of ``x`` (stage 0's rank) and ``target`` (the last
        stage's, in a loss step), and its channel. ``open_ended``: a vjp step, whose
        cotangents come later."""
        owners, chunks = program.placement, program.n_microbatches
        sizes = microbatch.sizes(n, chunks)
        inputs = targets = None
        if self.rank == owners[0]:
            inputs = [flatten(mb) for mb in microbatch.split(to(x, self.device), chunks)]
        if self.rank == owners[-1] and training and not open_ended and target is not None:
            # its size was checked against n by every rank, in the header
            targets = microbatch.split(to(target, self.device), chunks, "target")
        clock = None if record is None else record.clock(
            owners, program.n_workers, [self.device] * program.n_stages)
        weights = [1.0] * len(sizes) if open_ended else [size / n for size in sizes]
        step = Step(params, states, inputs, targets, weights, sizes, seed, training,
                    lambda: None, ends=Vjp(len(sizes)) if open_ended else None, clock=clock)
        loss = LossBroadcast(self.group, self.ranks[owners[-1]], self.rank == owners[-1], chunks,
                             self.wire, self.faults, early=not open_ended)
        return step, self.channel(program, training, self.plan(program, training, stateful),
                                  posted, loss)

    @contextlib.contextmanager
    def seeded(self, step: Step) -> Iterator[None]:
        """Run with the step's seed; the caller's generators as they were after."""
        seed = StepSeed([self.device], step.seed)
        try:
            yield
        finally:
            seed.restore()

    def backward(self, step: Step, channel: RankChannel, actions: tuple, cotangent: Any,
                 reduce: GradReduce | None) -> None:
        """The second call of a vjp step: this rank's ``actions`` after the forwards, from
        the output's ``cotangent`` (on the last stage's rank), then the step's end."""
        program = self.program
        if self.rank == program.placement[-1]:
            if cotangent is None:
                raise ValueError(f"rank {self.ranks[self.rank]} holds the last stage, so "
                                 f"vjp_fn needs the output's cotangent")
            step.ends.cotangents = output_cotangents(step.outputs, to(cotangent, self.device),
                                                     program.n_microbatches)
        with self.seeded(step):
            self.run(step, actions, channel, reduce)
        self.finish(step, channel, False)

    def channel(self, program: Program, training: bool, plan: tuple, posted: Header | None,
                loss: LossBroadcast) -> RankChannel:
        """A step's channel: its receives are posted at its first message."""
        routes = self._routes.get((program, training))
        if routes is None:
            routes = self._routes[program, training] = Routes.of(self.rank, send_orders(
                plan, program.placement, self.interpreter.stashes, self.interpreter.pops,
                self.interpreter.routes))
        return RankChannel(self.rank, program.placement, routes, self.links, self.faults,
                           self.wire, self._known, self.ranks, posted, loss)

    def run(self, step: Step, actions: tuple, channel: RankChannel,
            reduce: GradReduce | None = None) -> None:
        """Run ``actions`` (this rank's, or a part of them); a failure here or on another rank
        raises (every rank is then stopped by the caller's :meth:`RankFaults.guarded`). With
        ``reduce``, each stage's gradients are handed to it right after the action that made
        them final, so their reduction overlaps the actions after it; the last stage's rank
        posts the loss after its last loss (:meth:`LossBroadcast.cut`). A run that sent and
        received nothing still agrees its header before it returns."""
        then: dict[int, list[Callable[[], None]]] = {}
        for end, stages in ([] if reduce is None else reduce.cuts(actions)):
            then.setdefault(end, []).append(partial(_launch, reduce, stages, step.grads))
        end = channel.loss.cut(actions, self.program.n_stages - 1)
        if end is not None:
            then.setdefault(end, []).append(
                partial(channel.loss.post, step.outputs if step.training else None))
        start = 0
        for end in sorted(then):
            self._run(step, actions[start:end], channel)
            for call in then[end]:
                call()
            start = end
        self._run(step, actions[start:], channel)
        self._refuse(channel.opened())

    def _run(self, step: Step, actions: tuple, channel: RankChannel) -> None:
        self.interpreter.run(step, actions, channel)
        if self.faults.broken is not None:  # another rank failed while this one waited
            raise self.faults.broken
        self._refuse(channel.refused)
        if step.error is not None:
            raise at_rank(step.error, self.ranks[self.rank])

    @staticmethod
    def _refuse(refused: BaseException | None) -> None:
        """Raise what the step's header refused (see :meth:`RankChannel.opened`)."""
        if refused is not None:
            raise refused

    def run_all(self, step: Step, actions: tuple, channel: RankChannel, training: bool,
                reduce: GradReduce | None = None) -> tuple | None:
        """:meth:`run` then :meth:`finish`: a whole step."""
        self.run(step, actions, channel, reduce)
        return self.finish(step, channel, training)

    def close(self, replicas: DataParallel | None = None) -> None:
        """Wait until every rank of the pipeline, and of its ``replicas``' group, is here (so
        none tears its groups down while another still reads from them), then release
        fpipe's groups."""
        if replicas is not None:
            self.faults.wait(dist.barrier(group=replicas.group, async_op=True),
                             "its data-parallel replicas to close the pipeline", replicas.peer)
        self.faults.wait(dist.barrier(group=self.group, async_op=True),
                         "every rank of the pipeline to close it", self.ranks[0])
        for group in self.faults.groups:
            dist.destroy_process_group(group)
        self.forget()

    def forget(self) -> None:
        """Drop this driver's references to its process groups, so that each is destroyed now,
        while the interpreter runs, and not at its teardown (where gloo's work threads may
        still hold tensors whose release needs the interpreter)."""
        self.group = self.dp_group = None
        self.links = {}
        self.faults.groups = []

    def finish(self, step: Step, channel: RankChannel, training: bool) -> tuple | None:
        """End the step in lockstep: this rank's sends completed, then the loss from the rank
        of the last stage (:class:`LossBroadcast`). Returns ``(loss, parts)`` in training."""
        channel.flush()
        if step.clock is not None:
            step.clock.finish()
        return channel.loss.result(step.outputs, training, self.device)


def _launch(reduce: GradReduce, stages: list, grads: Any) -> None:
    for stage in stages:
        reduce.launch(stage, grads)
