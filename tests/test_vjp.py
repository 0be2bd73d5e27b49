"""``Pipeline.vjp`` is ``torch.func.vjp`` of the same function on the whole batch, also for
leaves without a batch dimension (0-dim tensors) and ``None`` leaves."""

from __future__ import annotations

import pytest
import torch
from models import block, mlp_params
from torch.func import vjp

import fpipe
from fpipe.schedules import gpipe


def scaled(p, inputs):
    """Takes ``{"x": batch, "scale": 0-dim}`` and passes the scale on (a 0-dim output)."""
    return {"y": block(p, inputs["x"]) * inputs["scale"], "scale": inputs["scale"] * 1.0}


def last(p, h):
    return block(p, h["y"]) * h["scale"], h["scale"] * 2.0, None


def whole_batch(params, inputs):
    """The same function unpipelined, without the None leaf torch.func.vjp does not take."""
    return last(params[1], scaled(params[0], inputs))[:2]


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_zero_dim_leaves_match_torch_func_vjp(chunks):
    params = mlp_params(2)
    inputs = {"x": torch.randn(8, 8, dtype=torch.float64),
              "scale": torch.tensor(1.5, dtype=torch.float64)}
    cotangent = (torch.randn(8, 8, dtype=torch.float64),
                 torch.tensor(0.7, dtype=torch.float64), None)
    expected_y, expected_vjp = vjp(whole_batch, params, inputs)
    expected_grads, expected_x_grad = expected_vjp(cotangent[:2])
    with fpipe.pipeline([scaled, last], params, schedule=gpipe(chunks=chunks)) as pipe:
        y, vjp_fn = pipe.vjp(inputs)
        grads, x_grad = vjp_fn(cotangent)
    torch.testing.assert_close(y[0], expected_y[0])
    torch.testing.assert_close(y[1], expected_y[1])
    assert y[2] is None
    # The 0-dim input's gradient is summed over micro-batches (before: micro-batch 0's share);
    # the 0-dim output's cotangent counts once (before: once per micro-batch).
    torch.testing.assert_close(x_grad["scale"], expected_x_grad["scale"])
    torch.testing.assert_close(x_grad["x"], expected_x_grad["x"])
    for got, want in zip(grads, expected_grads):
        for name in ("w", "b"):
            torch.testing.assert_close(got[name], want[name])


def test_a_cotangent_of_another_structure_is_refused_with_the_output_structure():
    with fpipe.pipeline([block, block], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        _, vjp_fn = pipe.vjp(torch.randn(4, 8, dtype=torch.float64))
        with pytest.raises(ValueError, match="structure of the output"):
            vjp_fn((torch.ones(4, 8, dtype=torch.float64), None))
