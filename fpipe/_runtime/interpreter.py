"""The :class:`Interpreter`: what every instruction of a compiled program means, for one
worker. The local driver's threads and :mod:`fpipe.distributed`'s ranks run the same
interpreter and differ only in their :class:`~fpipe._runtime.step.Channel`, so both compute
exactly the same thing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fpipe._runtime.adapters import core_of
from fpipe._runtime.autodiff import ENGINES, StageCall
from fpipe._runtime.compiled import is_compiled
from fpipe._runtime.instructions import Job, located
from fpipe._runtime.rng import RandomStages
from fpipe._runtime.skips import Skips
from fpipe._runtime.step import Channel, Step
from fpipe._runtime.stream import Transport
from fpipe._runtime.workers import Aborted
from fpipe.recompute import run as one_run

__all__ = ["Interpreter"]

_NOTHING = contextlib.nullcontext()


class Interpreter:
    """What every action of a compiled program means, for one worker; drivers share it and
    differ only in their :class:`Channel` and in how they start workers."""

    def __init__(self, stages: Sequence[Callable], param_specs: Sequence[Any],
                 devices: Sequence[torch.device], loss_fn: Callable | None,
                 transport: Transport, stateful: bool = False,
                 grad_dtype: torch.dtype | None = None, autodiff: str = "autograd",
                 concurrent: bool = True, skips: Skips | None = None) -> None:
        if autodiff not in ENGINES:
            raise ValueError(f"autodiff must be 'func' or 'autograd', got {autodiff!r}")
        n = len(stages)
        self.grad_dtype = grad_dtype
        self.devices = list(devices)
        skips = Skips.none(n) if skips is None else skips
        # Per stage, the names of the skips it pops (inputs after x) and stashes (outputs
        # after y), and each skip's (stashing, popping) stages: where the handlers route them.
        self.routes, self.pops, self.stashes = skips.routes, skips.pops, skips.stashes

        def calls(grad_input: Callable[[int], bool], loss: Callable | None) -> list:
            # A ``None`` spec marks a stage this process does not hold (distributed): no call.
            return [None if spec is None else
                    self._call(s, fn, spec, grad_input(s), stateful, autodiff,
                               loss if s == n - 1 else None)
                    for s, (fn, spec) in enumerate(zip(stages, param_specs))]

        # By Ends.calls: forward only; with the loss (the first stage's input gradients not
        # wanted); without it, every input's gradient wanted (a vjp). A forward-only call's
        # inputs require grad as a training call's would (only grad mode differs, so ATen picks
        # the same kernels: see StageCall.forward).
        self.calls = {"inference": calls(lambda s: s > 0, None),
                      "training": calls(lambda s: s > 0, loss_fn),
                      "vjp": calls(lambda s: True, None)}
        self.transport = transport
        self.random = RandomStages(self.devices, concurrent)

    def _call(self, s: int, fn: Callable, spec: Any, grad_input: bool, stateful: bool,
              autodiff: str, loss_fn: Callable | None) -> StageCall:
        """Stage ``s`` adapted to a core (see :mod:`fpipe._runtime.adapters`), ready to run."""
        return StageCall(
            core_of(fn, stateful, loss_fn, self.pops[s], self.stashes[s]), spec,
            grad_input=grad_input,
            # torch.func.vjp would run a compiled stage uncompiled (see compiled.py)
            engine=ENGINES["autograd" if is_compiled(fn) else autodiff],
            inputs_named=("its input x", *(f"skip {name!r}" for name in self.pops[s])),
            outputs_named=("output", *(f"stashed skip {name!r}" for name in self.stashes[s])),
            name_of=getattr(fn, "name_of", None))  # a module stage names its model's tensors

    def run(self, step: Step, actions: tuple, channel: Channel) -> None:
        """Execute ``actions`` in order. A failure is recorded with :meth:`Step.fail`, located
        (stage, op, micro-batch); only interrupts propagate."""
        # Grad mode is the step's; the rest of the caller's thread-local state is carried. A
        # run (see fpipe.recompute): module stages check their modules once in it.
        with one_run(), torch.enable_grad() if step.training else torch.no_grad(), \
                _NOTHING if step.context is None else step.context.applied(step.training):
            self._run(step, actions, channel)

    def _run(self, step: Step, actions: tuple, channel: Channel) -> None:
        job = Job(self, step, channel)
        kind = stage = microbatch = None
        try:
            for kind, stage, microbatch in actions:
                if step.error is not None:  # another worker failed: start nothing more
                    return
                job.received = None
                kind.handler(job, kind, stage, microbatch)
        except Aborted:
            return
        except BaseException as exc:
            step.fail(located(exc, kind, stage, microbatch, job.received,
                              _held(step.params, stage)))
            if not isinstance(exc, Exception):
                raise


def _held(params: Any, stage: int | None) -> list | None:
    """``stage``'s parameter leaves in a step's ``params`` (a list per stage, or a rank's
    ``{stage: leaves}``), for an error's notes; ``None`` where there are none."""
    if stage is None:
        return None
    try:
        return params[stage]
    except (IndexError, KeyError, TypeError):
        return None
