"""The same interpreter over ``torch.distributed``: one rank per worker of the program.

Rank ``w`` runs worker ``w``'s actions with :class:`fpipe._runtime.driver.Interpreter`, so a stage
computes exactly what it computes in the local driver. Only the channel differs: values cross
ranks as point-to-point messages, each a length, a pickled header (key, tree structure, shapes,
dtypes and non-tensor leaves) and the tensor leaves. Nothing about shapes is frozen, so they may
change from step to step.

Why no program deadlocks, on gloo and on NCCL alike (the code is the same): every ordered pair
of ranks that exchanges values, ``a -> b``, has a process group of its own that carries only
``a``'s messages to ``b``. Sends are posted with ``isend`` and completed only at the end of the
step, so a rank's host never waits for anyone to receive; a rank reads the messages from
another in the order they were sent (keeping those that came early), and so waits only for
values its own actions need, which the validator's global order guarantees will come. On NCCL
the kernels of one communicator run in order on one stream, and a send kernel larger than
NCCL's buffers blocks its stream until the peer's receive runs. With a single group, 1F1B's
``send(x); recv(g)`` on one rank and ``send(g); recv(x)`` on the other would put each receive
behind a send that waits for it. Here a group's stream holds only sends on one side and only
receives on the other, whether torch gives unbatched p2p a two-rank communicator per pair (its
default) or the group's own (eager initialisation), so no receive ever queues behind a send.

Not ``batch_isend_irecv``: pairing a send with the peer's receive in one batch needs the
receiver to know the shapes before posting, which changing shapes forbid (they travel in the
header), and holding a send back until the next receive can deadlock whenever that receive
waits for a value the peer can only produce from the held-back one (an interleaved or
zero-bubble program, a skip between non-neighbours). NCCL creates a communicator the first time
a pair uses it, blocking both hosts until both arrive; every group is therefore connected when
the pipeline is built, one pair after another in the same order on every rank.

Failure: every wait is bounded by ``timeout``. A rank whose stage raises re-raises the stage's
own exception (fpipe's own detections are :class:`~fpipe.StageError`), its rank recorded in
:func:`fpipe.errors.where`. It writes what happened (rank, stage, micro-batch, op, the
exception's type and message) to the process group's store and aborts fpipe's process groups,
which wakes every rank blocked on it; they read the store, raise a :class:`~fpipe.StageError`
naming all that, and abort in turn, so the whole pipeline stops. A dead or silent rank surfaces
as :class:`~fpipe.errors.PeerError`. After a failure the pipeline cannot run again.

A pipeline runs one step at a time: a call made while another thread's call is running is
refused, since two threads' calls could not be ordered alike on every rank. Each step's header
carries what the rank of stage 0 was called for, so ranks called differently raise, not mix.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import optree
import torch
import torch.distributed as dist

from fpipe._runtime import microbatch
from fpipe._runtime.autodiff import Value, flatten
from fpipe._runtime.engine import check_options, nonfinite_error
from fpipe._runtime.instructions import compiled
from fpipe._runtime.interpreter import Interpreter
from fpipe._runtime.placement import check_params, check_state, stage_devices
from fpipe._runtime.rng import StepSeed
from fpipe._runtime.step import Step
from fpipe._runtime.stream import Transport
from fpipe._runtime.workers import Aborted
from fpipe.errors import BatchError, PeerError, PlacementError, StageError, Where, where
from fpipe.schedules.actions import Program, program_of
from fpipe.schedules.validate import validate
from fpipe.timeline import Recorder

__all__ = ["init", "backend_for", "my_stages", "pipeline", "DistributedPipeline"]

#: Loss dtypes, by the code broadcast with the loss.
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_created = itertools.count()


def backend_for(device: torch.device | str) -> str:
    """The backend that carries tensors of ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init(device: torch.device | str | None = None) -> torch.device:
    """Join the process group ``torchrun`` describes (its environment variables) with the
    backend that fits ``device``, and return this rank's device.

    ``device`` defaults to CUDA when there is one; ``"cuda"`` means the GPU of ``LOCAL_RANK``.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
    return device


def my_stages(schedule: Any, n_stages: int, rank: int | None = None) -> tuple[int, ...]:
    """The stages that ``rank`` (this rank by default) holds: worker ``w`` is rank ``w``.

    Build or load only these stages' parameters and pass them to :func:`pipeline`.
    """
    program = validate(program_of(schedule, n_stages))
    rank = dist.get_rank() if rank is None else rank
    return tuple(s for s, worker in enumerate(program.placement) if worker == rank)


def pipeline(stages: Sequence[Callable], params: Mapping[int, Any], *, schedule: Any,
             loss_fn: Callable | None = None, device: torch.device | str | None = None,
             timeout: float = 60.0, state: Mapping[int, Any] | None = None,
             nonfinite: str = "raise", grad_dtype: torch.dtype | None = None,
             autodiff: str = "func") -> DistributedPipeline:
    """Build this rank's part of a pipeline; every rank calls it with the same ``stages``,
    ``schedule`` and ``loss_fn``.

    Args:
        stages: all the stage functions (functions are cheap; parameters are not).
        params: ``{stage: pytree}`` for exactly the stages of :func:`my_stages`.
        schedule: as for :func:`fpipe.pipeline`; its program must have one worker per rank.
        loss_fn: ``loss_fn(y, target) -> scalar``, the mean loss over a micro-batch.
        device: this rank's device when its stages have no parameters (else theirs).
        timeout: the most seconds a rank waits for another; then every rank raises.
        state: ``{stage: pytree}`` of this rank's stages' state, as ``state=`` of
            :func:`fpipe.pipeline`: every stage is then ``stage(params, state, x) ->
            (y, new_state)``, and calls also return this rank's new ``{stage: state}``.
        nonfinite: as for :func:`fpipe.pipeline` (a non-finite loss raises
            :class:`fpipe.NonFiniteLossError` on every rank).
        grad_dtype: as for :func:`fpipe.pipeline`.
        autodiff: as for :func:`fpipe.pipeline`.
    """
    return DistributedPipeline(stages, params, schedule=schedule, loss_fn=loss_fn,
                               device=device, timeout=timeout, state=state, nonfinite=nonfinite,
                               grad_dtype=grad_dtype, autodiff=autodiff)


class DistributedPipeline:
    """This rank's stages of a pipeline whose workers are the ranks of the process group.

    ``value_and_grad(x, target)`` returns the mean loss over the batch on every rank and this
    rank's gradients as ``{stage: pytree}``. ``pipe(x)`` returns the last stage's output on the
    rank that holds it and ``None`` elsewhere. Only the rank of stage 0 needs ``x`` and only the
    rank of the last stage needs ``target``; the others pass ``None`` and learn the batch size
    (and the step's random seed) from the rank of stage 0.

    Calls are collective: every rank makes the same ones in the same order, from one thread (a
    call while another is running raises ``RuntimeError``).
    """

    def __init__(self, stages: Sequence[Callable], params: Mapping[int, Any], *, schedule: Any,
                 loss_fn: Callable | None = None, device: torch.device | str | None = None,
                 timeout: float = 60.0, state: Mapping[int, Any] | None = None,
                 nonfinite: str = "raise", grad_dtype: torch.dtype | None = None,
                 autodiff: str = "func") -> None:
        check_options(nonfinite, grad_dtype)
        self.nonfinite = nonfinite
        if not dist.is_initialized():
            raise RuntimeError("fpipe.distributed needs a process group: call "
                               "fpipe.distributed.init() (or torch.distributed.init_process_group)")
        stages = list(stages)
        program = program_of(schedule, len(stages))
        # Validated and compiled once, before anything reads the placement.
        self._compiled: dict = {}
        self.program, self.inference_program = program, program.forward_only()
        compiled(self._compiled, self.program, True, state is not None)
        compiled(self._compiled, self.inference_program, False, state is not None)
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if program.n_workers != world:
            raise PlacementError(f"the program has {program.n_workers} workers but the process "
                                 f"group has {world} ranks: run one rank per worker")
        self.stages_held = tuple(s for s, w in enumerate(program.placement) if w == self.rank)
        if set(params) != set(self.stages_held):
            raise PlacementError(f"rank {self.rank} holds stages {list(self.stages_held)} but "
                                 f"got parameters for stages {sorted(params)}")
        self.params = {s: params[s] for s in self.stages_held}
        self.device = self._device(device)
        check_params(self.params, {s: self.device for s in self.stages_held})
        self.param_specs = {s: optree.tree_structure(p) for s, p in self.params.items()}
        self.loss_fn = loss_fn
        self.timeout = timeout
        self.state = None
        if state is not None:
            if set(state) != set(self.stages_held):
                raise PlacementError(f"rank {self.rank} holds stages {list(self.stages_held)} "
                                     f"but got state for stages {sorted(state)}")
            self.state = {s: state[s] for s in self.stages_held}
            check_state(self.state, {s: self.device for s in self.stages_held})
        self.interpreter = Interpreter(
            stages, [self.param_specs.get(s) for s in range(len(stages))],
            [self.device] * len(stages), loss_fn, Transport([]), stateful=self.stateful,
            grad_dtype=grad_dtype, autodiff=autodiff,
            concurrent=False)  # one thread a rank: every draw seeded
        backend = backend_for(self.device)
        # NCCL carries tensors of this rank's stage device; gloo carries CPU tensors.
        self.wire = self.device if backend == "nccl" else torch.device("cpu")
        # fpipe's own groups: aborting them on failure leaves the caller's group to the caller.
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
        self.links = self._links(backend)
        self.store = dist.distributed_c10d._get_default_store()
        self.failure_key = f"fpipe/pipeline{next(_created)}/failure"
        self.broken: BaseException | None = None
        self._running = threading.Lock()
        self._calls = 0

    @property
    def chunks(self) -> int:
        return self.program.n_microbatches

    @property
    def stateful(self) -> bool:
        """Whether the stages carry state (the pipeline was built with ``state=``)."""
        return self.state is not None

    def __call__(self, x: Any = None, *, params: Mapping[int, Any] | None = None,
                 state: Mapping[int, Any] | None = None, record: Recorder | None = None) -> Any:
        """The output on the last stage's rank (``None`` elsewhere); with state, also this
        rank's new ``{stage: state}``. ``record`` receives this rank's timeline."""
        step, _ = self._step(self.inference_program, False, x, None, params, state, record)
        y = microbatch.join(step.outputs) if self.rank == self.program.placement[-1] else None
        return (y, self._held_state(step)) if self.stateful else y

    def value_and_grad(self, x: Any = None, target: Any = None, *,
                       params: Mapping[int, Any] | None = None,
                       state: Mapping[int, Any] | None = None,
                       record: Recorder | None = None) -> tuple:
        """The mean loss over the batch (on every rank) and ``{stage: grads}`` for this rank's
        stages, each shaped like its parameters; with state, also the new ``{stage: state}``.
        ``record`` receives this rank's timeline."""
        if self.loss_fn is None:
            raise ValueError("value_and_grad needs a loss: build the pipeline with loss_fn=...")
        step, (loss, parts) = self._step(self.program, True, x, target, params, state, record)
        # Every rank has each micro-batch's loss, so every rank refuses a non-finite one; the
        # step itself ended in lockstep, so the pipeline stays usable.
        error = nonfinite_error(parts) if self.nonfinite == "raise" else None
        if error is not None:
            raise error
        grads = step.grads.out()
        grads = {s: optree.tree_unflatten(self.param_specs[s], grads[s])
                 for s in self.stages_held}
        return (loss, grads, self._held_state(step)) if self.stateful else (loss, grads)

    def _held_state(self, step: Step) -> dict:
        return {s: step.state[s] for s in self.stages_held}

    def _states(self, state: Mapping[int, Any] | None) -> list:
        """Per stage of the whole pipeline, the state this rank passes (``None`` for others)."""
        if not self.stateful:
            if state is not None:
                raise ValueError("this pipeline has no state: build it with state=... to pass "
                                 "state to its stages")
            return [None] * self.program.n_stages
        if state is None:
            state = self.state
        elif set(state) != set(self.stages_held):
            raise ValueError(f"rank {self.rank} holds stages {list(self.stages_held)} but got "
                             f"state for stages {sorted(state)}")
        else:
            check_state(state, {s: self.device for s in self.stages_held})
        return [state.get(s) for s in range(self.program.n_stages)]

    def __repr__(self) -> str:
        return (f"DistributedPipeline(rank {self.rank} of {self.program.n_workers}, stages "
                f"{list(self.stages_held)} on {self.device}, schedule={self.program!r})")

    # -- links between ranks ------------------------------------------------------------------

    def _links(self, backend: str) -> dict[tuple[int, int], Any]:
        """``{(src, dst): group}`` for the ordered pairs of ranks this rank sends or receives
        on: a group per direction of every pair the program's values cross (see the module's
        docstring for why), made by every rank in the same order, as ``new_group`` needs."""
        owners = self.program.placement
        pairs = {(owners[s - 1], owners[s]) for s in range(1, self.program.n_stages)}
        pairs |= {(owners[a], owners[b]) for a, b in self.interpreter.routes.values()}
        ordered = sorted({p for a, b in pairs if a != b for p in ((a, b), (b, a))})
        links = {}
        for src, dst in ordered:
            group = dist.new_group([src, dst], backend=backend,
                                   timeout=timedelta(seconds=self.timeout))
            if self.rank in (src, dst):
                links[src, dst] = group
        self._connect(links)
        return links

    def _connect(self, links: dict[tuple[int, int], Any]) -> None:
        """One small message over each link, in the same order on every rank: a communicator
        NCCL creates lazily blocks both hosts until both join, which mid-step could wait on a
        value the other rank has yet to compute. In this order, the first unconnected pair
        always has both its ranks there, so every pair connects."""
        token = torch.zeros(1, device=self.wire)
        for src, dst in sorted(links):
            peer = dst if src == self.rank else src
            post = dist.isend if src == self.rank else dist.irecv
            try:
                post(token, peer, group=links[src, dst]).wait(timedelta(seconds=self.timeout))
            except Exception as exc:
                raise PeerError(f"rank {self.rank} could not reach rank {peer} while building "
                                f"the pipeline: {exc}", peer) from exc

    # -- one step ------------------------------------------------------------------------------

    def _step(self, program: Program, training: bool, x: Any, target: Any,
              params: Mapping[int, Any] | None, state: Mapping[int, Any] | None,
              record: Recorder | None) -> tuple[Step, tuple | None]:
        """One step, alone: a second thread's call while one runs is refused rather than
        queued, since nothing could make two threads' calls reach every rank in one order."""
        if not self._running.acquire(blocking=False):
            raise RuntimeError("this distributed pipeline is already running a step on another "
                               "thread; its calls are collective, so make them from one thread, "
                               "in the same order on every rank")
        try:
            self._calls += 1
            return self._step_alone(program, training, x, target, params, state, record)
        finally:
            self._running.release()

    def _step_alone(self, program: Program, training: bool, x: Any, target: Any,
                    params: Mapping[int, Any] | None, state: Mapping[int, Any] | None,
                    record: Recorder | None) -> tuple[Step, tuple | None]:
        if self.broken is not None:
            raise RuntimeError("this distributed pipeline stopped after a failure and cannot "
                               "run again; restart the job") from self.broken
        leaves = self._param_leaves(params)
        states = self._states(state)
        owners = program.placement
        seed = StepSeed([self.device])
        try:
            n, seed_value = self._guarded(
                lambda: self._batch_header(x, owners[0], seed.seed, training))
            if n < self.chunks:  # every rank knows n, so every rank raises this by itself
                raise BatchError(f"the input batch has {n} samples, fewer than chunks="
                                 f"{self.chunks}: every micro-batch needs at least one sample")
            return self._guarded(lambda: self._run(program, training, leaves, states, x, target,
                                                   n, seed_value, record))
        finally:
            seed.restore()

    def _run(self, program: Program, training: bool, params: list, states: list, x: Any,
             target: Any, n: int, seed: int,
             record: Recorder | None) -> tuple[Step, tuple | None]:
        owners, last = program.placement, len(params) - 1
        sizes = microbatch.sizes(n, self.chunks)
        inputs = targets = None
        if self.rank == owners[0]:
            inputs = [flatten(mb) for mb in microbatch.split(_to(x, self.device), self.chunks)]
        if self.rank == owners[last] and training and target is not None:
            m = microbatch.batch_size(target, "target")
            if m != n:
                raise BatchError(f"the input has {n} samples but the target has {m}")
            targets = microbatch.split(_to(target, self.device), self.chunks, "target")
        clock = None if record is None else record.clock(
            owners, program.n_workers, [self.device] * program.n_stages)
        step = Step(params, states, inputs, targets, [size / n for size in sizes], sizes, seed,
                    training, lambda: None, clock=clock)
        channel = _RankChannel(self, owners)
        plan = compiled(self._compiled, program, training, self.stateful)
        self.interpreter.run(step, plan[self.rank], channel)
        if self.broken is not None:  # another rank failed while this one waited
            raise self.broken
        if step.error is not None:
            raise _at_rank(step.error, self.rank)
        channel.flush()
        if clock is not None:
            clock.finish()
        return step, self._finish(step, owners[last], training)

    def _batch_header(self, x: Any, first: int, seed: int, training: bool) -> tuple[int, int]:
        """The batch size and the step's seed, from the rank of stage 0 to all, with what that
        rank was called for: ranks whose calls differ stop rather than exchange wrong values."""
        call = (int(training), self._calls)
        header = torch.zeros(4, dtype=torch.int64, device=self.wire)
        if self.rank == first:
            if x is None:
                raise BatchError(f"rank {self.rank} holds stage 0, so it needs the input x")
            header[:] = torch.tensor([microbatch.batch_size(x, "input"), seed, *call])
        self._wait(dist.broadcast(header, first, group=self.group, async_op=True),
                   f"the batch size from rank {first}", first)
        n, seed, *theirs = header.tolist()
        if tuple(theirs) != call:
            raise RuntimeError(f"rank {self.rank} was called for {_call_name(*call)} but rank "
                               f"{first} for {_call_name(*theirs)}: every rank must make the "
                               f"same calls in the same order")
        return n, seed

    def _finish(self, step: Step, last: int, training: bool) -> tuple | None:
        """Broadcast the loss (its sum, dtype and each micro-batch's part) from the rank of the
        last stage; every step ends in lockstep. Returns ``(loss, parts)`` in training."""
        message = torch.zeros(2 + self.chunks, dtype=torch.float64, device=self.wire)
        if self.rank == last and training:
            losses = torch.stack(step.outputs).detach()
            message[0], message[1] = losses.sum(), _FLOATS.index(losses.dtype)
            message[2:] = losses
        self._wait(dist.broadcast(message, last, group=self.group, async_op=True),
                   f"the loss from rank {last}", last)
        if not training:
            return None
        return message[0].to(self.device, _FLOATS[int(message[1])]), message[2:]

    # -- failure -------------------------------------------------------------------------------

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BaseException as exc:
            if self.broken is None:
                self._stop_everyone(exc)
            raise

    def _wait(self, work: Any, what: str, peer: int, stage: int | None = None,
              microbatch_: int | None = None) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:
            raise self._failure_from(peer, what, stage, microbatch_, exc) from exc

    def _failure_from(self, peer: int, what: str, stage: int | None, mb: int | None,
                      exc: Exception) -> Exception:
        """The error to raise after a wait failed: the first rank's published failure if there
        is one, else what this rank saw."""
        record = self._published()
        if record is not None:
            kind, rank, f_stage, f_mb, op, type_name, message = record
            said = f"rank {rank} failed, so rank {self.rank} stopped while waiting for {what}: "
            if kind == "stage":
                error: Exception = StageError(
                    said + _stage_failure(type_name, message, Where(f_stage, f_mb, op)),
                    f_stage, f_mb, op, rank)
            else:
                error = PeerError(f"{said}{type_name}: {message}", rank, f_stage, f_mb)
        elif "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            error = PeerError(f"rank {self.rank} waited {self.timeout:g} s for {what} and got "
                              f"nothing: rank {peer} is stuck or gone", peer, stage, mb)
        else:
            error = PeerError(f"rank {self.rank} lost rank {peer} while waiting for {what}: "
                              f"{exc}", peer, stage, mb)
        self._stop_everyone(error)
        return error

    def _published(self) -> tuple | None:
        try:
            if self.store.check([self.failure_key]):
                return pickle.loads(self.store.get(self.failure_key))
        except Exception:  # noqa: BLE001 - the store's host may be gone too; say what we saw
            return None
        return None

    def _stop_everyone(self, error: BaseException) -> None:
        """Publish ``error`` unless a failure is already known, then abort fpipe's groups,
        which wakes every rank blocked on this one.

        A failure located in a stage (:func:`~fpipe.errors.where`: the stage's own exception
        or a :class:`StageError`) is published as a stage failure of the rank where it was
        raised; anything else as this rank's failure. Either keeps the type and message."""
        self.broken = error
        at = where(error)
        if at is not None:
            record = ("stage", self.rank if at.rank is None else at.rank, at.stage,
                      at.microbatch, at.op)
        else:
            record = ("peer", self.rank, getattr(error, "stage", None),
                      getattr(error, "microbatch", None), None)
        record += (type(error).__name__, str(error))
        try:
            self.store.compare_set(self.failure_key, "", pickle.dumps(record))
        except Exception:  # noqa: BLE001, S110 - best effort: the abort below still wakes peers
            pass
        for group in (self.group, *self.links.values()):
            dist.distributed_c10d._abort_process_group(group)

    # -- parameters ----------------------------------------------------------------------------

    def _device(self, device: torch.device | str | None) -> torch.device:
        found = set(stage_devices(self.params, None)) if self.params else set()
        if device is not None:
            found.add(torch.device(device))
        if len(found) > 1:
            raise PlacementError(f"rank {self.rank} runs on one device, but its stages' "
                                 f"parameters and device= name {sorted(map(str, found))}")
        return found.pop() if found else torch.device("cpu")

    def _param_leaves(self, params: Mapping[int, Any] | None) -> list:
        if params is None:
            params = self.params
        else:
            if set(params) != set(self.stages_held):
                raise ValueError(f"rank {self.rank} holds stages {list(self.stages_held)} but "
                                 f"got parameters for stages {sorted(params)}")
            for s in self.stages_held:
                if optree.tree_structure(params[s]) != self.param_specs[s]:
                    raise ValueError(f"params[{s}] has structure "
                                     f"{optree.tree_structure(params[s])}, but the pipeline was "
                                     f"built with {self.param_specs[s]}")
            check_params(params, {s: self.device for s in self.stages_held})
        return [[leaf.detach() for leaf in optree.tree_leaves(params[s])] if s in params
                else None for s in range(self.program.n_stages)]


class _RankChannel:
    """This rank's messages for one step: sends posted at once and completed at the end;
    receives read in order from the sending rank, keeping values that came early. Each goes
    on the group of its direction, ``pipe.links[src, dst]``."""

    def __init__(self, pipe: DistributedPipeline, owners: tuple) -> None:
        self.pipe = pipe
        self.owners = owners
        self.arrived: dict[tuple, Any] = {}
        self.sending: list[tuple[Any, torch.Tensor, int, tuple]] = []

    def send(self, leaves: list, src: torch.device, stage: int, key: tuple,
             like: Value | None) -> None:
        dst = self.owners[stage]
        if dst == self.pipe.rank:
            self.arrived[key] = leaves if like is None else Value(leaves, like.spec,
                                                                  like.grad_index)
            return
        wire, group = self.pipe.wire, self.pipe.links[self.pipe.rank, dst]
        tensors = [leaf.detach().to(wire).contiguous() for leaf in leaves
                   if isinstance(leaf, torch.Tensor)]
        header = pickle.dumps((
            key, None if like is None else like.spec, None if like is None else like.grad_index,
            [(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else (None, leaf)
             for leaf in leaves],
        ))
        payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(wire)
        length = torch.tensor([len(header)], dtype=torch.int64, device=wire)
        for tensor in [length, payload, *tensors]:
            if tensor.numel():
                try:
                    work = dist.isend(tensor, dst, group=group)
                except Exception as exc:  # the connection to ``dst`` is gone
                    self.pipe._failure_from(dst, f"rank {dst} to take {_describe_key(key)}",
                                            _stage(key), key[2], exc)
                    raise Aborted from None
                self.sending.append((work, tensor, dst, key))

    def receive(self, key: tuple, device: torch.device) -> Any:
        src = self._source(key)
        while key not in self.arrived:
            self._read_next(src, key)
        value = self.arrived.pop(key)
        leaves = value.leaves if isinstance(value, Value) else value
        moved = [leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return moved if not isinstance(value, Value) else Value(moved, value.spec,
                                                                value.grad_index)

    def _source(self, key: tuple) -> int:
        """The rank that sends the value ``key`` names."""
        kind, where, _ = key
        if kind == "x":
            return self.owners[where - 1]
        if kind == "g":
            return self.owners[where + 1]
        stasher, popper = self.pipe.interpreter.routes[where]
        return self.owners[stasher if kind == "s" else popper]

    def _read_next(self, src: int, awaited: tuple) -> None:
        wire, group = self.pipe.wire, self.pipe.links[src, self.pipe.rank]
        what = _describe_key(awaited) + f" from rank {src}"

        def wait(work: Any) -> None:
            try:
                self.pipe._wait(work, what, src, _stage(awaited), awaited[2])
            except (StageError, PeerError):
                raise Aborted from None  # the pipeline has recorded it, and stops the step

        length = torch.empty(1, dtype=torch.int64, device=wire)
        wait(dist.irecv(length, src, group=group))
        payload = torch.empty(int(length), dtype=torch.uint8, device=wire)
        wait(dist.irecv(payload, src, group=group))
        key, spec, grad_index, metas = pickle.loads(bytes(payload.cpu().tolist()))
        leaves, works = [], []
        for shape, meta in metas:
            if shape is None:
                leaves.append(meta)
                continue
            tensor = torch.empty(shape, dtype=meta, device=wire)
            if tensor.numel():
                works.append(dist.irecv(tensor, src, group=group))
            leaves.append(tensor)
        for work in works:
            wait(work)
        self.arrived[key] = leaves if spec is None else Value(leaves, spec, grad_index)

    def flush(self) -> None:
        """Complete every send of the step (their receivers have them by now or soon)."""
        for work, _, dst, key in self.sending:
            self.pipe._wait(work, f"rank {dst} to take {_describe_key(key)}", dst,
                            _stage(key), key[2])
        self.sending.clear()


def _at_rank(error: BaseException, rank: int) -> BaseException:
    """``error``, a step's failure, with the rank it was raised on recorded in its
    :func:`~fpipe.errors.where` (a stage's own exception that takes no attributes keeps none)."""
    if isinstance(error, StageError):
        error.rank = rank
    elif (at := where(error)) is not None:
        try:
            error.fpipe_where = at._replace(rank=rank)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            pass
    return error


def _call_name(training: int, count: int) -> str:
    return f"{'value_and_grad' if training else 'inference'} (call {count})"


def _stage_failure(type_name: str, message: str, at: Where) -> str:
    """What failed where, for ranks that only learn of it: the place, the original exception's
    type and its message (a StageError of the interpreter's already says the place)."""
    place = f"stage {at.stage} failed in the {at.op} of micro-batch {at.microbatch}"
    if type_name == "StageError" and message.startswith(place):
        return message
    return f"{place}: {type_name}: {message}"


def _describe_key(key: tuple) -> str:
    kind, where, mb = key
    what = {"x": f"the input of stage {where}", "g": f"the output gradient of stage {where}",
            "s": f"skip {where!r}", "t": f"the gradient of skip {where!r}"}[kind]
    return f"{what}, micro-batch {mb}"


def _stage(key: tuple) -> int | None:
    """The stage a key names (skips are named by their skip name instead)."""
    return key[1] if key[0] in ("x", "g") else None


def _to(tree: Any, device: torch.device) -> Any:
    return optree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, tree)
