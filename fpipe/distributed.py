"""The same interpreter over ``torch.distributed``: one rank per worker of the program.

Rank ``w`` runs worker ``w``'s actions with :class:`fpipe._runtime.interpreter.Interpreter`, so
a stage computes exactly what it computes in the local driver; only the channel differs: values
cross ranks as point-to-point messages (:mod:`fpipe._runtime.ranks.p2p`). This module is the
public face: checks, micro-batching and results, as ``fpipe.pipeline``'s.
:class:`fpipe._runtime.ranks.driver.RankDriver` runs each step in lockstep: a header
summed over the pipeline's ranks (the batch size, the step's random seed and what it was
called for, the target's size: ranks called differently raise, not mix), this rank's actions,
the loss broadcast from the rank of the last stage.

Failure (:mod:`fpipe._runtime.ranks.faults`): every wait is bounded by ``timeout``. A rank
whose stage raises re-raises the stage's own exception (fpipe's own detections are
:class:`~fpipe.StageError`), its rank recorded in :func:`fpipe.errors.where`; it publishes what
happened and aborts fpipe's process groups, which wakes every other rank, and they raise a
:class:`~fpipe.StageError` naming all that. A dead or silent rank surfaces as
:class:`~fpipe.errors.PeerError`. After a failure the pipeline cannot run again. A pipeline
runs one step at a time: a call made while another thread's runs is refused.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fpipe._runtime import microbatch
from fpipe._runtime.engine import (
    check_options,
    check_stages,
    check_training,
    check_untransformed,
    returned_loss,
)
from fpipe._runtime.instructions import compiled
from fpipe._runtime.interpreter import Interpreter
from fpipe._runtime.log import StepTimes, logger
from fpipe._runtime.ranks.accumulate import Accumulated
from fpipe._runtime.ranks.calls import Calls
from fpipe._runtime.ranks.data_parallel import DataParallel, mesh_groups
from fpipe._runtime.ranks.driver import backend_for
from fpipe._runtime.ranks.fsdp import check_call, check_shard, released
from fpipe._runtime.ranks.inputs import held_by
from fpipe._runtime.ranks.joined import join
from fpipe._runtime.ranks.launch import LAUNCH_VARIABLES as LAUNCH_VARIABLES
from fpipe._runtime.ranks.launch import check_joined, init, my_stages
from fpipe._runtime.ranks.results import Replica
from fpipe._runtime.ranks.two_calls import two_calls
from fpipe._runtime.skips import Skips
from fpipe._runtime.sources import hooked_by_stage, sources_of
from fpipe._runtime.step import Step
from fpipe._runtime.stream import Transport
from fpipe.optim import clip_grad_norm, global_norm
from fpipe.schedules.actions import Program, program_of
from fpipe.stages.sequential import check_state_given, check_ties_given, unpacked
from fpipe.stages.skip import declared
from fpipe.timeline import Recorder, StepFigures, StepLog

__all__ = ["init", "backend_for", "my_stages", "pipeline", "DistributedPipeline"]


def pipeline(stages: Sequence[Callable], params: Mapping[int, Any], *, schedule: Any,
             loss_fn: Callable | None = None, device: torch.device | str | None = None,
             timeout: float = 60.0, state: Mapping[int, Any] | None = None,
             nonfinite: str = "raise", grad_dtype: torch.dtype | None = None,
             autodiff: str = "autograd", group: Any = None, mesh: Any = None,
             data_parallel: Any = None, grad_reduce: str | None = "mean",
             bucket_mb: float = 25.0, ties: Iterable | None = None,
             state_reduce: str | None = "mean", shard: str | None = None) -> DistributedPipeline:
    """Build this rank's part of a pipeline; every rank of the pipeline calls it with the same
    ``stages``, ``schedule`` and ``loss_fn`` (and, with data parallelism, every replica at
    once).

    Args:
        stages: all the stage functions (functions are cheap; parameters are not), or the
            :class:`fpipe.stages.Stages` that ``from_sequential`` / ``from_modules`` made,
            whose ties are then the pipeline's (unless ``ties`` is given).
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
        group: the process group whose ranks are the pipeline's workers: worker ``w`` is its
            ``w``-th rank (:attr:`DistributedPipeline.ranks`). By default the world.
        mesh: instead of ``group`` and ``data_parallel``, a 2-D ``DeviceMesh`` with dimensions
            named ``"dp"`` and ``"pp"`` (``init_device_mesh(device, (replicas, workers),
            mesh_dim_names=("dp", "pp"))``): the pipeline runs on ``mesh["pp"]``, its
            replicas are ``mesh["dp"]``.
        data_parallel: the process group of this rank's replicas: the ranks that run the same
            worker of the same pipeline on other shards of the global batch; calls then return
            the global batch's loss and gradients (see :class:`DistributedPipeline`).
        grad_reduce: with ``data_parallel``: ``"mean"`` (the default) makes the gradients the
            global batch's, all-reduced in buckets that overlap the rest of the step; ``None``
            returns each replica's own of its shard's mean, untouched, for a reduction of the
            caller's own (``fully_shard``, gradient compression).
        bucket_mb: the largest bucket of gradients (or state) reduced at once, in MiB (per
            dtype).
        ties: tied weights, as for :func:`fpipe.pipeline`: ties of ``(stage, name)`` pairs.
            Every rank passes the whole tie map (it holds some members); each member's
            gradient is the sum of all members', by ``all_reduce`` over a group of the ranks
            holding them (made at build; none for a tie held by one rank).
        state_reduce: with ``data_parallel`` and ``state``, what each replica's new state
            becomes after every call that returns it: ``"mean"`` (the default),
            ``"broadcast"`` or ``None`` (see :class:`DistributedPipeline`). Without
            ``data_parallel`` it does nothing.
        shard: ``"fsdp"`` (with ``mesh=``) shards this rank's stages with FSDP2 over
            ``mesh["dp"]`` (see :class:`DistributedPipeline`).
    """
    return DistributedPipeline(
        stages, params, schedule=schedule, loss_fn=loss_fn, device=device, timeout=timeout,
        state=state, nonfinite=nonfinite, grad_dtype=grad_dtype, autodiff=autodiff, group=group,
        mesh=mesh, data_parallel=data_parallel, grad_reduce=grad_reduce, bucket_mb=bucket_mb,
        ties=ties, state_reduce=state_reduce, shard=shard)


def _checked(stages: Any, ties: Any, state: Any, loss_fn: Any) -> tuple[list, Any]:
    """The stages (of a ``Stages`` value, which brings its ties) and ties, checked as every
    rank can alone, before anything collective: a process group, the loss, the stages, the
    ties and state the cut requires."""
    check_joined()
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    stages, ties = unpacked(stages, ties)
    stages = list(stages)
    check_stages(stages)
    check_ties_given(stages, ties)
    check_state_given(stages, state is not None)
    return stages, ties


class DistributedPipeline:
    """This rank's stages of a pipeline whose workers are the ranks of the process group.

    ``value_and_grad(x, target)`` returns the mean loss over the batch on every rank and this
    rank's gradients as ``{stage: pytree}``. ``pipe(x)`` returns the last stage's output on the
    rank that holds it and ``None`` elsewhere. Only the rank of stage 0 needs ``x`` and only the
    rank of the last stage needs ``target``; the others pass ``None`` and learn the batch size
    (and the step's random seed) from the rank of stage 0.

    Calls are collective: every rank makes the same ones in the same order, from one thread (a
    call while another is running raises ``RuntimeError``).

    With data parallelism (:func:`pipeline`'s ``data_parallel``, or ``mesh``), each replica
    passes its own shard of the global batch (shards may differ in size); every call returns
    the global batch's mean loss, and ``value_and_grad`` (and ``vjp_fn``, given the cotangent
    of its shard's mean) its gradients: with ``grad_reduce="mean"``, each replica's weighted by
    its share and all-reduced (summed) in buckets, each launched as soon as its stages'
    gradients are final on this rank. Every call that returns state (training, ``vjp``, a
    stateful inference call) makes the replicas' new state agree, so a checkpoint of one is
    every replica's: ``state_reduce="mean"`` makes each floating-point tensor leaf the mean
    over the replicas weighted by their shares, as the gradients are (exact for BatchNorm's
    running mean when the replicas started alike); ``"broadcast"`` gives every replica the
    tensor leaves of the first rank of its data-parallel group (DDP's ``broadcast_buffers``);
    ``None`` leaves each replica its own. Other leaves stay each replica's own: integer
    tensors (``num_batches_tracked``) under ``"mean"``, Python values under both. Replicas'
    state must have the same leaves, shapes and dtypes.

    With ``shard="fsdp"``, :attr:`DistributedPipeline.params` are the sharded parameters
    (``DTensor`` leaves) for the optimiser, gathered for each step, and the gradients come back
    reduce-scattered as ``DTensor`` shards placed alike; the ``params`` given (full, alike on
    every replica) are copied into the shards and can be dropped.

    Worker ``w`` of the program runs on the global rank ``ranks[w]``; this rank is
    ``ranks[worker]``. ``close()`` (or the end of a ``with`` block) waits for every rank of the
    pipeline and releases fpipe's process groups; calls after it raise ``RuntimeError``.
    """

    def __init__(self, stages: Sequence[Callable], params: Mapping[int, Any], *, schedule: Any,
                 loss_fn: Callable | None = None, device: torch.device | str | None = None,
                 timeout: float = 60.0, state: Mapping[int, Any] | None = None,
                 nonfinite: str = "raise", grad_dtype: torch.dtype | None = None,
                 autodiff: str = "autograd", group: Any = None, mesh: Any = None,
                 data_parallel: Any = None, grad_reduce: str | None = "mean",
                 bucket_mb: float = 25.0, ties: Iterable | None = None,
                 state_reduce: str | None = "mean", shard: str | None = None) -> None:
        check_options(nonfinite, grad_dtype)
        check_shard(shard, mesh, grad_reduce)
        DataParallel.check_options(grad_reduce, bucket_mb, state_reduce)
        stages, ties = _checked(stages, ties, state, loss_fn)
        self.nonfinite, self.loss_fn, self.timeout = nonfinite, loss_fn, timeout
        group, data_parallel = mesh_groups(group, mesh, data_parallel)
        #: The global rank of each worker: worker ``w`` runs on rank ``ranks[w]``.
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(group))
        self.stages = stages
        self._seat(program_of(schedule, len(stages)), params, device, state)
        self.interpreter = Interpreter(
            stages, [self.param_specs.get(s) for s in range(len(stages))],
            [self.device] * len(stages), loss_fn, Transport([]), stateful=self.stateful,
            grad_dtype=grad_dtype, autodiff=autodiff,
            concurrent=False,  # one thread a rank: every draw seeded
            skips=Skips(*declared(stages)))
        options = {"autodiff": autodiff, "grad_dtype": grad_dtype, "grad_reduce": grad_reduce,
                   "state_reduce": state_reduce, "bucket_mb": bucket_mb, "shard": shard}
        self._join(data_parallel, options, mesh, ties)
        # The model parameters the held leaves were cut from (fpipe._runtime.sources).
        self._sources = sources_of(stages, [self.params.get(s) for s in range(len(stages))])
        self._accumulated = Accumulated(len(stages))
        self._times = StepTimes()
        self.step_log = StepLog()  #: as :attr:`fpipe.Pipeline.step_log`, for this rank

    def _seat(self, program: Program, params: Mapping[int, Any], device: Any,
              state: Mapping[int, Any] | None) -> None:
        """The program (validated and compiled once, before anything reads the placement),
        this rank's worker and stages, their parameters, device and state, checked."""
        self._compiled: dict = {}
        self.program, self.inference_program = program, program.forward_only()
        compiled(self._compiled, self.program, True, state is not None)
        compiled(self._compiled, self.inference_program, False, state is not None)
        self.rank = dist.get_rank()
        #: This rank's worker of the program (its index in :attr:`ranks`), and its stages.
        self.worker, self.params, self.held = held_by(self.ranks, self.rank, program, params,
                                                      device, len(self.stages))
        self.stages_held, self.device = self.held.stages, self.held.device
        self.param_specs = self.held.specs
        self.state = self.held.built_state(state)

    def _join(self, data_parallel: Any, options: dict, mesh: Any, ties: Any) -> None:
        """Collective: what every rank makes alike (:func:`fpipe._runtime.ranks.joined.join`)."""
        joined = join(self.ranks, self.worker, self.program, self.interpreter, self.device,
                      self.timeout, self._compiled, self.params, self.param_specs, self.state,
                      data_parallel, options, mesh, ties)
        self.driver, self.data_parallel = joined.driver, joined.data_parallel
        self._sharded, self._results, self.params = joined.sharded, joined.results, joined.params
        #: The tie map, checked alike on every rank, as ``(stage, name)`` pairs.
        self.ties = joined.ties
        self.group, self.wire = self.driver.group, self.driver.wire
        self._calls = Calls(self.driver.faults, self._forget)
        logger.info("%r: ranks %s%s", self, list(self.ranks), "" if self.data_parallel is None
                    else f", replicas on ranks {list(self.data_parallel.ranks)}")

    @property
    def chunks(self) -> int:
        return self.program.n_microbatches

    @property
    def last_step(self) -> StepFigures | None:
        """This rank's figures of the last step (:attr:`fpipe.Pipeline.last_step`)."""
        return self._times.last

    @property
    def stateful(self) -> bool:
        """Whether the stages carry state (the pipeline was built with ``state=``)."""
        return self.state is not None

    def __call__(self, x: Any = None, *, params: Mapping[int, Any] | None = None,
                 state: Mapping[int, Any] | None = None, record: Recorder | None = None,
                 tokens: int | None = None) -> Any:
        """The output on the last stage's rank (``None`` elsewhere); with state, also this
        rank's new ``{stage: state}``. ``record`` receives this rank's timeline; ``tokens``
        (on any rank), the batch's token count, for :attr:`last_step`."""
        step, _, replica = self._step(self.inference_program, False, x, None, params, state,
                                      record, tokens)
        y = microbatch.join(step.outputs) if self.worker == self.program.placement[-1] else None
        return (y, self._results.state(step, replica)) if self.stateful else y

    def value_and_grad(self, x: Any = None, target: Any = None, *,
                       params: Mapping[int, Any] | None = None,
                       state: Mapping[int, Any] | None = None,
                       record: Recorder | None = None, tokens: int | None = None,
                       accumulate: bool = False) -> tuple:
        """The mean loss over the batch (on every rank) and ``{stage: grads}`` for this rank's
        stages, each shaped like its parameters; with state, also the new ``{stage: state}``.
        ``record`` receives this rank's timeline; ``tokens`` as for ``pipe(x)``.

        ``accumulate=True``: keep this call's gradients (``None`` is returned for them) and
        add them into the next call's; the first call without it returns the sum over the
        calls since the last one that returned gradients, each call's weighted as its own
        would be, with one data-parallel reduction (one reduce-scatter per stage with
        ``shard="fsdp"``) for all of them and none on the calls that accumulate."""
        if self.loss_fn is None:
            raise ValueError("value_and_grad needs a loss: build the pipeline with loss_fn=...")
        carry = None if accumulate else self._accumulated.carry()
        step, (loss, parts), replica = self._step(self.program, True, x, target, params, state,
                                                  record, tokens, accumulate, carry)
        grads = None if accumulate else hooked_by_stage(
            self._results.grads(step, replica, carry), self.params if params is None else params,
            self._sources)
        loss = self._results.loss(loss, replica)
        if self.nonfinite == "raise":
            self._results.refuse_nonfinite(parts, loss, replica)
        self._accumulated.called(accumulate, step.grads, self.stages_held, replica)
        loss = returned_loss(loss)
        if self.stateful:
            return loss, grads, self._results.state(step, replica)
        return loss, grads

    def global_norm(self, grads: Mapping[int, Any]) -> torch.Tensor:
        """The 2-norm of the whole model's gradients, on every rank of the pipeline, from this
        rank's ``{stage: grads}``: :func:`fpipe.optim.global_norm` with the pipeline's ties
        and its group (a norm of this rank's gradients alone would clip each rank by
        another factor). Collective over the pipeline's ranks."""
        return global_norm(grads, ties=self.ties, group=self.group)

    def clip_grad_norm(self, grads: Mapping[int, Any], max_norm: float,
                       eps: float = 1e-6) -> tuple[Any, torch.Tensor]:
        """:func:`fpipe.optim.clip_grad_norm` of this rank's ``{stage: grads}`` by the whole
        model's norm (:meth:`global_norm`): ``(grads, norm)``, scaled in place. Collective."""
        return clip_grad_norm(grads, max_norm, eps, ties=self.ties, group=self.group)

    def close(self) -> None:
        """Collective: wait until every rank of the pipeline (and of its data-parallel group)
        has come here, so none tears down a connection another still reads from, then release
        fpipe's process groups. Later calls raise; ``dist.destroy_process_group()`` is safe
        right after. A ``with`` block closes the pipeline at its end; closing twice does
        nothing more. After a failure, the groups are released without waiting."""
        self._calls.close(lambda: self.driver.close(self.data_parallel))

    def _forget(self) -> None:
        self.group = self.data_parallel = self._results = None
        self.driver.forget()

    def __enter__(self) -> DistributedPipeline:
        return self

    def __exit__(self, error_type: Any, error: BaseException | None, trace: Any) -> None:
        if error is None:
            self.close()
        else:  # this rank leaves on an error: the others learn it now, not at their timeout
            self._calls.abandon(error)

    def __repr__(self) -> str:
        return (f"DistributedPipeline(rank {self.rank}, worker {self.worker} of "
                f"{self.program.n_workers}, stages "
                f"{list(self.stages_held)} on {self.device}, schedule={self.program!r})")

    # -- one step ------------------------------------------------------------------------------

    def vjp(self, x: Any = None, *, params: Mapping[int, Any] | None = None,
            state: Mapping[int, Any] | None = None) -> tuple:
        """The output for the whole batch and its vjp function, as :meth:`fpipe.Pipeline.vjp`
        gives them: ``y, vjp_fn = pipe.vjp(x)``, then ``grads, x_grad = vjp_fn(cotangent)``.
        Both calls are collective.

        ``y`` is the output on the last stage's rank (``None`` elsewhere), where ``vjp_fn``
        needs its cotangent (other ranks pass ``None``); ``grads`` is ``{stage: grads}`` for
        this rank's stages and ``x_grad`` the input's gradient on the rank of stage 0
        (``None`` elsewhere). The schedule must run every worker's forwards first (``gpipe``):
        the forwards run now, the rest in ``vjp_fn``, and until then the pipeline runs nothing
        else. A stateful pipeline returns ``(y, vjp_fn, new_state)``.

        With data parallelism, each replica passes the cotangent of its own shard's mean loss;
        ``grads`` are then the global batch's (weighted by the replicas' shares and summed, as
        in :meth:`value_and_grad`), and ``x_grad`` is this shard's input gradient for the
        cotangent as given."""
        return two_calls(self, x, params, state)

    def _step(self, program: Program, training: bool, x: Any, target: Any,
              params: Mapping[int, Any] | None, state: Mapping[int, Any] | None,
              record: Recorder | None, tokens: int | None = None, accumulate: bool = False,
              carry: list | None = None) -> tuple[Step, tuple | None, Replica | None]:
        """One whole step: the header, every action of this rank, the loss to every rank."""
        what = f"{'training' if training else 'forward'} step on rank {self.rank}"
        measured = self._times.step(what, [self.device], self.step_log, record, (self.worker,))
        with self._calls.alone(), measured as measure, released(self._sharded):
            step, channel, replica = self._begin(program, int(training), x, target, params,
                                                 state, measure.record, accumulate, carry)
            measure.count(sum(mb.size for mb in step.batch), x, tokens)
            plan = self.driver.plan(program, training, self.stateful)
            reduce = None if replica is None else replica.reduce
            with self.driver.seeded(step):
                return step, self.driver.faults.guarded(
                    lambda: self.driver.run_all(step, plan[self.worker], channel, training,
                                                reduce)), replica

    def _begin(self, program: Program, call: int, x: Any, target: Any,
               params: Mapping[int, Any] | None, state: Mapping[int, Any] | None,
               record: Recorder | None, accumulate: bool = False,
               carry: list | None = None) -> tuple[Step, Any, Replica | None]:
        """A new step, agreed with every rank (the header), its channel, and with data
        parallelism in training (or with state), this replica's share of the global batch and
        its gradients' reduction (none when ``accumulate``; ``carry`` added to it)."""
        check_untransformed("a distributed pipeline's call", x, target=target, params=params,
                            state=state)
        check_call(self._sharded, params, call == 2)
        self._accumulated.check_call(call == 2)
        training = call > 0
        leaves = None if self._sharded else self.held.param_leaves(params, self.params,
                                                                   self._sources, training)
        states = self.held.states(state, self.state)
        if training:
            check_training()
        self.driver.calls += 1
        # Without replicas, stage 0's rank begins before its header is agreed (see header.py).
        n, seed_value, posted = self.driver.agreed(
            x, target, call, defer=self._results.data_parallel is None and self._sharded is None)
        replica = self._results.replica(n, self.chunks, training, self.stateful, carry,
                                        not accumulate)
        if self._sharded is not None:  # FSDP2's all-gather, once the step is agreed
            leaves = self.held.param_leaves(None, self._sharded.gather(), None, training)
        step, channel = self.driver.faults.guarded(lambda: self.driver.new_step(
            program, training, call == 2, leaves, states, x, target, n, seed_value, record,
            self.stateful, posted))
        return step, channel, replica
