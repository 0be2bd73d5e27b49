"""``fpipe.pipeline``: bind stages, parameters, devices, a schedule and a loss into a Pipeline.

Everything is checked here, before any work runs: stage and parameter counts, where every
parameter lives, and the schedule's program (validated once for training and once for
inference). A step then splits the batch, hands the micro-batches to the driver and folds the
results back into the caller's pytrees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optree
import torch

from fpipe._runtime import microbatch
from fpipe._runtime.autodiff import flatten
from fpipe._runtime.driver import LocalDriver, one_worker_per_gpu
from fpipe._runtime.engine import (
    check_options,
    check_stages,
    check_training,
    check_untransformed,
    nonfinite_error,
    returned_loss,
)
from fpipe._runtime.log import StepTimes, logger
from fpipe._runtime.placement import check_params, check_state, stage_devices
from fpipe._runtime.skips import Skips
from fpipe._runtime.sources import follow, hooked, sources_of
from fpipe._runtime.step import plus
from fpipe._runtime.ties import TieSums
from fpipe._runtime.trees import tree_map
from fpipe._runtime.two_calls import two_calls
from fpipe._runtime.values import param_leaves
from fpipe.errors import BatchError
from fpipe.schedules.actions import Program, program_of
from fpipe.stages.sequential import Stages, check_state_given, check_ties_given, unpacked
from fpipe.stages.skip import declared
from fpipe.timeline import Recorder, StepFigures, StepLog

__all__ = ["pipeline", "Pipeline"]

Stage = Callable[[Any, Any], Any]


def pipeline(stages: Sequence[Stage] | Stages, params: Sequence[Any] | None = None, *,
             schedule: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             devices: Sequence[torch.device | str] | None = None,
             state: Sequence[Any] | None = None, nonfinite: str = "raise",
             grad_dtype: torch.dtype | None = None, autodiff: str = "autograd",
             ties: Iterable | None = None) -> Pipeline:
    """Build a :class:`Pipeline`.

    Args:
        stages: pure functions ``stage(params_i, x) -> y``, one per stage; or the
            :class:`fpipe.stages.Stages` that ``from_sequential`` / ``from_modules`` made,
            which brings its params, state and ties (``fpipe.pipeline(s, schedule=...)``).
            Stages cut with ties refuse to run without them.
        params: one pytree of tensors per stage (not with a ``Stages``). Each stage runs on
            the device of its parameters; they are never copied or moved. Every
            floating-point leaf is differentiated (as ``torch.func`` does, whatever its
            ``requires_grad``) except an ``nn.Parameter`` with ``requires_grad=False``,
            which is frozen: its gradient is ``None`` (``from_modules`` passes a model's
            frozen parameters so, and its copies follow the model's parameters from step
            to step). A leaf no stage's output depends on also gets ``None``.
        schedule: a schedule value such as ``gpipe(chunks=8)`` or ``one_f_one_b(chunks=8)``,
            anything with a ``program(n_stages) -> Program`` method (a ``Program`` itself), or
            a function ``n_stages -> Program``.
        loss_fn: ``loss_fn(y, target) -> scalar``, the mean loss over a micro-batch's samples;
            needed for :meth:`Pipeline.value_and_grad`.
        devices: the device of each stage. Without it, a stage's device is that of its
            parameters (a stage without parameters takes its neighbour's, or the CPU).
        state: for stages with state (buffers such as BatchNorm's running statistics), one
            pytree per stage. Every stage is then ``stage(params, state, x) -> (y, new_state)``
            and must not change ``state`` in place. Each stage's state flows through its
            forwards in micro-batch order (a recompute sees what its forward saw), and calls
            return the state after the last micro-batch.
        nonfinite: what a NaN or infinite loss does: ``"raise"`` (the default) raises
            :class:`fpipe.NonFiniteLossError` naming the micro-batches whose loss is not
            finite, which costs one host synchronisation per step on CUDA; ``"ignore"``
            returns the loss as it is, for callers that check it themselves (loss scaling).
        grad_dtype: the dtype gradients are accumulated and returned in, e.g. ``torch.float32``
            for ``bfloat16`` parameters (see :mod:`fpipe.amp`); by default the parameters'.
        autodiff: how each stage's vjp is taken: ``"autograd"`` (the default), through
            ``torch.autograd`` on detached inputs, which works with everything a stage may use
            (``torch.utils.checkpoint``, Hugging Face gradient checkpointing, functions made
            by ``torch.compile``, which it runs compiled) and, without ``grad_dtype``, sums
            each stage's gradients over micro-batches inside autograd, as ``loss.backward()``
            accumulates into ``.grad``; or ``"func"`` (an option, not the default), with
            ``torch.func``'s vjp: the same gradients (``tests/test_pipeline.py`` compares them), a
            few microseconds less of driver time per action on tiny stages
            (``benchmarks/dispatch_overhead.py``), but saved-tensor hooks
            (``torch.utils.checkpoint``) fail under it and a compiled function it meets runs
            uncompiled.
        ties: weights shared by several stages (an embedding and the output head that reuses
            it), each stage holding its own copy: an iterable of ties, each an iterable of at
            least two ``(stage, name)`` pairs, ``name`` the leaf's dotted path in that stage's
            parameter pytree as :func:`fpipe.saving.names` spells it (for the dicts
            ``from_modules`` makes, the dict key, e.g. ``"wte.weight"``; its ``.ties`` lists
            the ties it found). A leaf belongs to at most one tie; tied leaves must have equal
            shape, dtype and values. After a step every member's gradient is the SUM of all
            members' gradients (each on its own stage's device, in its own gradient dtype),
            the gradient of the one shared weight, so an optimiser step applied alike keeps
            the copies equal. Also for :meth:`Pipeline.vjp`'s gradients.

    Threads: each worker of the schedule's program is a thread (the caller's thread is one of
    them), and workers wait for each other at every value they hand on. Stages that share a
    CUDA device share a worker (one thread launches a GPU's kernels, as in torchgpipe: more
    would add no parallelism, only memory held at once) unless ``schedule`` is a ``Program``,
    which runs on the workers it names; ``pipe.program`` is the program that runs. A program
    with more workers than the process has CPU cores makes them take turns, which costs a
    thread wake-up per hand-off; building such a pipeline warns
    (:class:`fpipe.OversubscriptionWarning`). ``fpipe.schedules.colocate(schedule, workers)``
    runs several stages on one worker, and each worker's ops use torch's intra-op threads too
    (``torch.set_num_threads``).
    """
    return Pipeline(stages, params, schedule=schedule, loss_fn=loss_fn, devices=devices,
                    state=state, nonfinite=nonfinite, grad_dtype=grad_dtype, autodiff=autodiff,
                    ties=ties)


class Pipeline:
    """Stages, parameters and a schedule, ready to run.

    ``pipe(x)`` runs the forward only (inference, no graph kept) and returns the last stage's
    output for the whole batch. ``pipe.value_and_grad(x, target)`` returns the mean loss over the
    batch and gradients shaped like ``params``. Both take ``params=`` to run the same pipeline
    with other parameters of the same structure, e.g. after an optimiser step.

    A pipeline built with ``state=`` is :attr:`stateful`: its calls take ``state=`` (by
    default the state it was built with) and also return the new state: ``y, state = pipe(x)``
    and ``loss, grads, state = pipe.value_and_grad(x, target)``.

    Worker threads are started on the first multi-worker step and kept; ``close()`` (or a
    ``with`` block) stops them, as does garbage collection of the pipeline.
    """

    def __init__(self, stages: Sequence[Stage] | Stages, params: Sequence[Any] | None = None,
                 *, schedule: Any,
                 loss_fn: Callable | None = None,
                 devices: Sequence[torch.device | str] | None = None,
                 state: Sequence[Any] | None = None, nonfinite: str = "raise",
                 grad_dtype: torch.dtype | None = None, autodiff: str = "autograd",
                 ties: Iterable | None = None) -> None:
        if isinstance(stages, Stages):
            stages, params, state, ties = _unpacked(stages, params, state, ties)
        if params is None:
            raise TypeError("fpipe.pipeline needs params= (one pytree per stage), or the "
                            "Stages value from fpipe.stages as its first argument")
        if isinstance(params, Mapping):
            raise TypeError(
                f"params is a {type(params).__name__}: fpipe.pipeline takes a list with one "
                f"parameter pytree per stage, e.g. [{{'w': w0}}, {{'w': w1}}] for two stages "
                f"(a dict {{stage: pytree}}, fpipe.distributed's form, becomes "
                f"[params[s] for s in sorted(params)])")
        stages, params = list(stages), list(params)
        if not stages:
            raise ValueError("a pipeline needs at least one stage; got an empty list of stages")
        if len(params) != len(stages):
            raise ValueError(f"got {len(stages)} stages but {len(params)} parameter pytrees: "
                             f"give one pytree per stage (an empty dict for a stage without "
                             f"parameters)")
        check_stages(stages)
        check_state_given(stages, state is not None)
        if devices is not None and len(devices) != len(stages):
            raise ValueError(f"got {len(stages)} stages but {len(devices)} devices")
        if state is not None and len(state) != len(stages):
            raise ValueError(f"got {len(stages)} stages but {len(state)} state pytrees: give "
                             f"one per stage (an empty dict for a stage without state)")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        check_options(nonfinite, grad_dtype)
        self.nonfinite = nonfinite

        self.stages = tuple(stages)
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.devices = stage_devices(dict(enumerate(params)), devices)
        self.params = params
        self.param_specs = tuple(optree.tree_structure(p) for p in params)
        check_params(dict(enumerate(params)), self.devices)
        self._ties = TieSums(ties, params, grad_dtype)
        check_ties_given(stages, ties)
        self._sources = sources_of(stages, params)
        self.state = None
        if state is not None:
            check_state(dict(enumerate(state)), self.devices)
            self.state = list(state)

        program = program_of(schedule, len(stages))
        if not isinstance(schedule, Program):  # a program given as such runs as it is
            program = one_worker_per_gpu(program, self.devices)
        self.program = program
        self.inference_program = program.forward_only()
        self._driver = LocalDriver(self.stages, self.param_specs, self.devices,
                                   program.n_workers, loss_fn, stateful=self.stateful,
                                   grad_dtype=grad_dtype, autodiff=autodiff,
                                   skips=Skips(*declared(self.stages)))
        self._driver.prepare(self.program, training=True)
        self._driver.prepare(self.inference_program, training=False)
        self._accumulated: list | None = None  # value_and_grad(accumulate=True)'s sums
        self._times = StepTimes()
        #: How each step is reported: its log level, and whether its bubble is measured.
        self.step_log = StepLog()
        logger.info("%r: a program of %d workers and %d micro-batches", self,
                    program.n_workers, program.n_microbatches)

    @property
    def chunks(self) -> int:
        return self.program.n_microbatches

    @property
    def last_step(self) -> StepFigures | None:
        """The last step's figures (time, samples and tokens per second, peak memory,
        bubble), as logged; ``None`` before the first step."""
        return self._times.last

    @property
    def stateful(self) -> bool:
        """Whether the stages carry state (the pipeline was built with ``state=``)."""
        return self.state is not None

    def __call__(self, x: Any, *, params: Sequence[Any] | None = None,
                 state: Sequence[Any] | None = None, record: Recorder | None = None,
                 tokens: int | None = None) -> Any:
        """The last stage's output for the whole batch, forward only (and the new state, for
        a stateful pipeline). A :class:`fpipe.Recorder` passed as ``record`` receives the
        step's timeline; ``tokens``, the batch's token count, for :attr:`last_step`."""
        leaves, states, n, inputs, sizes = self._step_inputs(x, params, state,
                                                             entry="pipe(x)")
        with self._times.step("forward step", self.devices, self.step_log, record) as measure:
            measure.count(n, x, tokens)
            outputs, new_state = self._driver.infer(self.inference_program, leaves, states,
                                                    inputs, sizes, measure.record)
        y = microbatch.join(outputs)
        return (y, new_state) if self.stateful else y

    def value_and_grad(self, x: Any, target: Any = None, *,
                       params: Sequence[Any] | None = None,
                       state: Sequence[Any] | None = None,
                       record: Recorder | None = None, tokens: int | None = None,
                       accumulate: bool = False) -> tuple:
        """The mean loss over the batch and its gradient with respect to every stage's
        parameters, as a list of pytrees shaped like ``params`` (and the new state, for a
        stateful pipeline). A :class:`fpipe.Recorder` passed as ``record`` receives the step's
        timeline; ``tokens``, the batch's token count, for :attr:`last_step`.

        ``accumulate=True``: keep this call's gradients (``None`` is returned for them) and
        add them into the next call's; the first call without it returns the sum over the
        calls since the last one that returned gradients, each call's weighted as its own
        would be (the gradient of its own mean loss), as ``fpipe.distributed``'s pipeline
        does. Until then :meth:`vjp` is refused."""
        if self.loss_fn is None:
            raise ValueError("value_and_grad needs a loss: build the pipeline with loss_fn=...")
        check_untransformed("Pipeline value_and_grad", target=target)
        leaves, states, n, inputs, sizes = self._step_inputs(x, params, state, training=True,
                                                             entry="value_and_grad")
        if target is None:
            targets = [None] * self.chunks
        else:
            m = microbatch.batch_size(target, "target")
            if m != n:
                raise BatchError(f"the input has {n} samples but the target has {m}")
            targets = microbatch.split(self._to(target, self.devices[-1]), self.chunks, "target")
        with self._times.step("training step", self.devices, self.step_log, record) as measure:
            measure.count(n, x, tokens)
            result = self._driver.train(self.program, leaves, states, inputs, targets,
                                        [size / n for size in sizes], sizes, measure.record)
        losses = torch.stack(result.losses)
        error = nonfinite_error(losses) if self.nonfinite == "raise" else None
        if error is not None:
            raise error
        loss = returned_loss(losses.sum())
        grads = self._carried(result.grads, accumulate, self.params if params is None else params)
        return (loss, grads, result.state) if self.stateful else (loss, grads)

    def _carried(self, grads: list, accumulate: bool, params: Sequence[Any]) -> list | None:
        """A training call's flat gradients, added to those kept by the calls before it that
        accumulated: kept again (``None`` returned) when it accumulates too, else returned as
        pytrees (:meth:`_grad_trees`) and the sums dropped."""
        if self._accumulated is not None:
            grads = [plus(kept, new) for kept, new in zip(self._accumulated, grads)]
        self._accumulated = grads if accumulate else None
        return None if accumulate else self._grad_trees(grads, params)

    def vjp(self, x: Any, *, params: Sequence[Any] | None = None,
            state: Sequence[Any] | None = None) -> tuple:
        """The output for the whole batch and its vjp function, as ``torch.func.vjp`` gives:
        ``y, vjp_fn = pipe.vjp(x)``, then ``grads, x_grad = vjp_fn(y_cotangent)`` (once).

        For a loss computed outside the pipeline, e.g. by autograd (``fpipe.GPipe``). The
        schedule must run every worker's forwards first (``gpipe``): the forwards run now,
        recomputes and backwards in ``vjp_fn``. ``x_grad`` is shaped like ``x``, with ``None``
        at leaves that carry no gradient. A stateful pipeline returns
        ``(y, vjp_fn, new_state)``.
        """
        return two_calls(self, x, params, state)

    def _step_inputs(self, x: Any, params: Sequence[Any] | None,
                     state: Sequence[Any] | None, training: bool = False,
                     entry: str = "pipe(x)") -> tuple:
        """What every call starts from: parameter leaves, states, the batch size, the input's
        micro-batches (flattened, on the first stage's device) and their sizes."""
        check_untransformed(f"Pipeline {entry}", x, params=params, state=state)
        if training:
            check_training()
        leaves, states = self._param_leaves(params, training), self._state(state)
        n = microbatch.batch_size(x, "input")
        inputs = microbatch.split(self._to(x, self.devices[0]), self.chunks, "input")
        return (leaves, states, n, [flatten(mb) for mb in inputs],
                microbatch.sizes(n, self.chunks))

    def _grad_trees(self, grads: list, hooks_of: Sequence[Any] | None = None) -> list:
        """A step's flat gradients, reduced (tied leaves summed), as pytrees like ``params``;
        with ``hooks_of`` (the step's params), through their leaves' gradient hooks (see
        :mod:`fpipe._runtime.sources`). The one place where a step's gradients are
        post-processed."""
        grads = self._ties(grads)
        if hooks_of is not None:
            grads = hooked(grads, [optree.tree_leaves(p) for p in hooks_of], self._sources)
        return [optree.tree_unflatten(spec, g) for spec, g in zip(self.param_specs, grads)]

    def close(self) -> None:
        """Stop the worker threads (a later step starts them again)."""
        self._driver.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Pipeline({len(self.stages)} stages on {[str(d) for d in self.devices]}, "
                f"schedule={self.schedule!r})")

    def _param_leaves(self, params: Sequence[Any] | None,
                      training: bool = False) -> list[list[torch.Tensor]]:
        if params is None:
            params = self.params
        else:
            params = list(params)
            if len(params) != len(self.stages):
                raise ValueError(f"got {len(params)} parameter pytrees for "
                                 f"{len(self.stages)} stages")
            for s, (tree, spec) in enumerate(zip(params, self.param_specs)):
                if optree.tree_structure(tree) != spec:
                    raise ValueError(f"params[{s}] has structure {optree.tree_structure(tree)}, "
                                     f"but the pipeline was built with {spec}")
            check_params(dict(enumerate(params)), self.devices)
        leaves = [param_leaves(p, training) for p in params]
        return follow(leaves, self._sources) if any(self._sources) else leaves

    def _state(self, state: Sequence[Any] | None) -> list:
        if not self.stateful:
            if state is not None:
                raise ValueError("this pipeline has no state: build it with state=... to pass "
                                 "state to its stages")
            return [None] * len(self.stages)
        if state is None:
            return self.state
        if len(state) != len(self.stages):
            raise ValueError(f"got {len(state)} state pytrees for {len(self.stages)} stages")
        check_state(dict(enumerate(state)), self.devices)
        return list(state)

    @staticmethod
    def _to(tree: Any, device: torch.device) -> Any:
        # Only a copy to a GPU may return before it lands: it is ordered on the caller's
        # stream, which the step's streams wait for. A copy to the CPU must be complete when
        # the CPU stage (or the caller) reads it.
        non_blocking = device.type == "cuda"
        return tree_map(lambda leaf: leaf.to(device, non_blocking=non_blocking)
                        if isinstance(leaf, torch.Tensor) else leaf, tree)


def _unpacked(cut: Stages, params: Any, state: Any, ties: Any) -> tuple:
    """A ``Stages`` value's stages, params, state and ties (``state=`` and ``ties=`` given
    beside it win; its stages and ties as for ``fpipe.distributed``: ``unpacked``)."""
    if params is not None:
        raise TypeError("fpipe.pipeline(s, ...) takes the params from the Stages value s: do "
                        "not pass params= beside it")
    stages, ties = unpacked(cut, ties)
    return stages, cut.params, cut.state if state is None else state, ties
