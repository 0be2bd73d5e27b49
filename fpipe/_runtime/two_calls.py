"""A local pipeline's ``vjp``: the step in two calls, the forwards now and the recomputes and
backwards in ``vjp_fn``, which gets the output's cotangent (:meth:`fpipe.Pipeline.vjp`
documents it), as :mod:`fpipe._runtime.ranks.two_calls` is the distributed face's."""

from __future__ import annotations

from typing import Any

from fpipe._runtime import microbatch
from fpipe._runtime.engine import check_untransformed, input_grads, output_cotangents

__all__ = ["two_calls"]


def two_calls(pipe: Any, x: Any, params: Any, state: Any) -> tuple:
    """``(y, vjp_fn)`` (and the new state, with state) of ``pipe``, a
    :class:`~fpipe.Pipeline`."""
    if pipe._accumulated is not None:
        raise RuntimeError("gradients of value_and_grad(..., accumulate=True) wait for a "
                           "last value_and_grad call; vjp cannot add to them")
    leaves, states, _, inputs, sizes = pipe._step_inputs(x, params, state, training=True,
                                                         entry="vjp")
    step = pipe._driver.begin(pipe.program, leaves, states, inputs, sizes)
    outputs = step.outputs
    y = microbatch.join([out.tree() for out in outputs])
    used = []

    def vjp_fn(cotangent: Any) -> tuple[list, Any]:
        check_untransformed("Pipeline vjp_fn", cotangent=cotangent)
        if used:
            raise RuntimeError("this vjp function was called already: a pipeline step "
                               "runs its backward once")
        used.append(True)
        cotangents = output_cotangents(outputs, pipe._to(cotangent, pipe.devices[-1]),
                                       pipe.chunks)
        grads = pipe._grad_trees(pipe._driver.finish(pipe.program, step, cotangents).grads)
        return grads, input_grads(inputs, step.ends.grads)

    return (y, vjp_fn, step.state) if pipe.stateful else (y, vjp_fn)
