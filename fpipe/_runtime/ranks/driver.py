"""The :class:`RankDriver`: one rank's part of every step of a distributed pipeline, as the
:class:`~fpipe._runtime.driver.LocalDriver` is the local face's. It owns fpipe's process groups
(:mod:`fpipe._runtime.ranks.p2p`), the failure state (:mod:`fpipe._runtime.ranks.faults`)
and the compiled programs, and runs a step in lockstep with the other ranks: a header
all-reduced by every rank (see :meth:`RankDriver.header`), this rank's actions, the loss
broadcast from the rank of the last stage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fpipe._runtime import microbatch
from fpipe._runtime.autodiff import flatten
from fpipe._runtime.engine import output_cotangents
from fpipe._runtime.instructions import compiled
from fpipe._runtime.interpreter import Interpreter
from fpipe._runtime.ranks.agreement import Fingerprint
from fpipe._runtime.ranks.data_parallel import DataParallel, GradReduce
from fpipe._runtime.ranks.faults import RankFaults, at_rank
from fpipe._runtime.ranks.inputs import to
from fpipe._runtime.ranks.links import make_groups
from fpipe._runtime.ranks.p2p import RankChannel, Routes, send_orders
from fpipe._runtime.rng import StepSeed
from fpipe._runtime.step import Step, Vjp
from fpipe.errors import BatchError
from fpipe.schedules.actions import Program
from fpipe.timeline import Recorder

__all__ = ["RankDriver", "backend_for", "CALLS"]

#: What a step was called for, by the code in its header.
CALLS = ("inference", "value_and_grad", "vjp")
#: Loss dtypes, by the code broadcast with the loss.
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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

    def header(self, x: Any, target: Any, seed: int,
               call: int) -> tuple[int, int, BatchError | None]:
        """The batch size and the step's seed, agreed by every rank before any action: one
        sum over the ranks (:func:`_summing`) of a few integers, each filled by the rank that
        knows it. The rank of stage 0 gives the batch size, the seed and what it was called
        for (``CALLS[call]``, and how many calls it made), or says its input is missing or has no
        batch size; the rank of the last stage gives its target's batch size, or says it has
        none. So a bad input or target is known to every rank before any value is exchanged:
        returned as the third item, for every rank to raise alike (the rank that holds it with
        the details), the pipeline usable after it. Ranks called differently raise here (out
        of step, they stop)."""
        first, last = self.program.placement[0], self.program.placement[-1]
        mine = (call, self.calls)
        header = [0] * 7  # a tensor once filled: one tensor op, not one per word
        errors: dict[str, BatchError] = {}
        if self.rank == first:
            n = _size(x, "input", errors) if x is not None else 0
            header[:5] = [n, seed, *mine, _status(x, "input", errors)]
        if self.rank == last and call == 1 and target is not None:
            header[5] = _size(target, "target", errors) + 1
            header[6] = _status(target, "target", errors)
        first_rank, last_rank = self.ranks[first], self.ranks[last]
        work, rows = _summing(header, self.group, len(self.ranks), self.backend, self.wire)
        # Recorded once the header is on its way: the store's round trip overlaps it.
        self.faults.arrive(self.calls)
        self.faults.wait(work, lambda: f"every rank of the pipeline to start call "
                                       f"{self.calls} (its header)",
                         first_rank, late=lambda: self.faults.late(self.ranks, self.calls))
        n, seed, call_first, calls_first, input_status, target_size, target_status = (
            rows.sum(0).tolist())
        if input_status:
            return n, seed, errors.get("input") or _batch_error(input_status, "input",
                                                                 first_rank)
        if (call_first, calls_first) != mine:
            raise RuntimeError(f"rank {self.ranks[self.rank]} was called for "
                               f"{_call_name(*mine)} but rank {first_rank} for "
                               f"{_call_name(call_first, calls_first)}: every rank must make "
                               f"the same calls in the same order")
        if target_status:
            return n, seed, errors.get("target") or _batch_error(target_status, "target",
                                                                  last_rank)
        if target_size and target_size - 1 != n:
            return n, seed, BatchError(f"the input has {n} samples but the target has "
                                       f"{target_size - 1}")
        return n, seed, None

    def agreed(self, x: Any, target: Any, call: int) -> tuple[int, int]:
        """``(n, seed)``: the :meth:`header` of a call, its seed drawn from this rank's
        generators (left as they were), under the failure guard; a bad input or target, which
        the header tells every rank, is raised by every rank by itself."""
        seed = StepSeed([self.device])
        try:
            n, seed_value, error = self.faults.guarded(
                lambda: self.header(x, target, seed.seed, call))
        finally:
            seed.restore()
        if error is not None:  # every rank knows it, so every rank raises it by itself
            raise error
        return n, seed_value

    def new_step(self, program: Program, training: bool, open_ended: bool, params: list,
                 states: list, x: Any, target: Any, n: int, seed: int, record: Recorder | None,
                 stateful: bool) -> tuple[Step, RankChannel]:
        """A step of ``n`` samples agreed by the header: this rank's micro-batches of ``x``
        (stage 0's rank) and ``target`` (the last stage's, in a loss step), and its channel.
        ``open_ended``: a vjp step, whose cotangents come later."""
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
        return step, self.channel(program, training, self.plan(program, training, stateful))

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

    def channel(self, program: Program, training: bool, plan: tuple) -> RankChannel:
        """A step's channel: its receives are posted at once."""
        routes = self._routes.get((program, training))
        if routes is None:
            routes = self._routes[program, training] = Routes.of(self.rank, send_orders(
                plan, program.placement, self.interpreter.stashes, self.interpreter.pops,
                self.interpreter.routes))
        return RankChannel(self.rank, program.placement, routes, self.links, self.faults,
                           self.wire, self._known, self.ranks)

    def run(self, step: Step, actions: tuple, channel: RankChannel,
            reduce: GradReduce | None = None) -> None:
        """Run ``actions`` (this rank's, or a part of them); a failure here or on another rank
        raises (every rank is then stopped by the caller's :meth:`RankFaults.guarded`). With
        ``reduce``, each stage's gradients are handed to it right after the action that made
        them final, so their reduction overlaps the actions after it."""
        start = 0
        for end, stages in ([] if reduce is None else reduce.cuts(actions)):
            self._run(step, actions[start:end], channel)
            for stage in stages:
                reduce.launch(stage, step.grads)
            start = end
        self._run(step, actions[start:], channel)

    def _run(self, step: Step, actions: tuple, channel: RankChannel) -> None:
        self.interpreter.run(step, actions, channel)
        if self.faults.broken is not None:  # another rank failed while this one waited
            raise self.faults.broken
        if step.error is not None:
            raise at_rank(step.error, self.ranks[self.rank])

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
        """End the step in lockstep: this rank's sends completed, then the loss (its sum,
        dtype and each micro-batch's part) broadcast from the rank of the last stage. Returns
        ``(loss, parts)`` in training."""
        channel.flush()
        if step.clock is not None:
            step.clock.finish()
        last = self.program.placement[-1]
        chunks = self.program.n_microbatches
        message = torch.zeros(2 + chunks, dtype=torch.float64, device=self.wire)
        if self.rank == last and training:
            losses = torch.stack(step.outputs).detach()
            message[0], message[1] = losses.sum(), _FLOATS.index(losses.dtype)
            message[2:] = losses
        self.faults.wait(dist.broadcast(message, self.ranks[last], group=self.group,
                                        async_op=True),
                         lambda: f"the loss from rank {self.ranks[last]}", self.ranks[last])
        if not training:
            return None
        return message[0].to(self.device, _FLOATS[int(message[1])]), message[2:]


def _summing(words: list[int], group: Any, size: int, backend: str,
             wire: torch.device) -> tuple[Any, torch.Tensor]:
    """Start summing ``words`` over the ``size`` ranks of ``group``: ``(work, rows)``, whose
    ``rows.sum(0)`` is the sum once ``work`` is done. On gloo each rank sends its words to
    every rank (``all_to_all_single``), one exchange where an all-reduce makes a ring's two
    passes: 0.2 ms against 0.5 on 2 ranks of a 2-core machine, before every step's first
    action. NCCL keeps the all-reduce."""
    if backend != "gloo":
        rows = torch.tensor([words], dtype=torch.int64, device=wire)
        return dist.all_reduce(rows, group=group, async_op=True), rows
    sent = torch.tensor(words * size, dtype=torch.int64)
    rows = torch.empty_like(sent)
    work = dist.all_to_all_single(rows, sent, group=group, async_op=True)
    return work, rows.view(size, len(words))


def _call_name(call: int, count: int) -> str:
    return f"{CALLS[call]} (call {count})"


def _size(tree: Any, what: str, errors: dict) -> int:
    """``tree``'s batch size, or 0 with its :class:`BatchError` kept in ``errors[what]``."""
    try:
        return microbatch.batch_size(tree, what)
    except BatchError as error:
        errors[what] = error
        return 0


def _status(tree: Any, what: str, errors: dict) -> int:
    """What the header says of an input or target: 0 fine, 1 missing, 2 without one batch
    size (the rank that holds it keeps the details in ``errors``)."""
    return 1 if tree is None else 2 if what in errors else 0


def _batch_error(status: int, what: str, rank: int) -> BatchError:
    """The error every other rank raises for a bad input or target on ``rank``."""
    if status == 1:
        return BatchError(f"rank {rank} holds stage 0, so it needs the input x")
    return BatchError(f"the {what} on rank {rank} has no single batch size (dim 0) to split "
                      f"into micro-batches; rank {rank} raised the details")
