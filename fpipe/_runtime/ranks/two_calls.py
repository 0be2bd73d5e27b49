"""A distributed pipeline's ``vjp``: the step in two calls, the forwards now and the rest in
``vjp_fn``, which gets the output's cotangent (:meth:`fpipe.distributed.DistributedPipeline.vjp`
documents it). The compiled program is cut at its turn (:mod:`fpipe._runtime.instructions`),
and nothing else runs on the pipeline in between."""

from __future__ import annotations

from typing import Any

from fpipe._runtime import microbatch
from fpipe._runtime.engine import check_untransformed, input_grads
from fpipe._runtime.instructions import after_turn, before_turn, check_turn

__all__ = ["two_calls"]


def two_calls(pipe: Any, x: Any, params: Any, state: Any) -> tuple:
    """``(y, vjp_fn)`` (and the new state, with state) of ``pipe``, a
    :class:`~fpipe.distributed.DistributedPipeline`, on this rank."""
    plan = pipe.driver.plan(pipe.program, True, pipe.stateful)
    check_turn(plan)
    with pipe._calls.alone():
        step, channel, replica = pipe._begin(pipe.program, 2, x, None, params, state,
                                             None)
        with pipe.driver.seeded(step):
            pipe.driver.faults.guarded(
                lambda: pipe.driver.run(step, before_turn(plan[pipe.worker]), channel))
        new_state = pipe._results.state(step, replica) if pipe.stateful else None
    pending = pipe._calls.pending = object()
    last = pipe.worker == pipe.program.placement[-1]

    def vjp_fn(cotangent: Any = None) -> tuple[dict, Any]:
        check_untransformed("a distributed pipeline's vjp_fn", cotangent=cotangent)
        with pipe._calls.alone(pending):
            pipe._calls.pending = None
            pipe.driver.faults.guarded(lambda: pipe.driver.backward(
                step, channel, after_turn(plan[pipe.worker]), cotangent,
                None if replica is None else replica.reduce))
            grads = pipe._results.grads(step, replica)
        first = pipe.worker == pipe.program.placement[0]
        return grads, input_grads(step.inputs, step.ends.grads) if first else None

    y = microbatch.join([out.tree() for out in step.outputs]) if last else None
    return (y, vjp_fn, new_state) if pipe.stateful else (y, vjp_fn)
