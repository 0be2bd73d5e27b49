"""The autodiff engines on flat leaves (``fpipe._runtime.vjp``): functorch's internals give what
``torch.func.vjp`` gives, bit for bit; gradients accumulated inside autograd equal the sums of
the micro-batches' gradients, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import block, mlp_params, mse

import fpipe
from fpipe._runtime import instructions
from fpipe._runtime import vjp as engines
from fpipe.schedules import gpipe, one_f_one_b, zero_bubble


def _layer_norm_stage(params, inputs):
    x, skip = inputs
    h = F.layer_norm(x @ params[0] + params[1], (x.shape[-1],))
    return [torch.tanh(h) * skip, (h ** 2).sum(-1)], [h.detach().abs()]


def _unused_input(params, inputs):  # a parameter and an input that reach no output
    return [torch.sigmoid(inputs[0] @ params[0])], []


@pytest.mark.parametrize("fn", [_layer_norm_stage, _unused_input])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_func_engine_is_torch_func_vjp_bit_for_bit(fn, dtype):
    torch.manual_seed(0)
    params = [torch.randn(6, 6, dtype=dtype), torch.randn(6, dtype=dtype)]
    inputs = [torch.randn(5, 6, dtype=dtype), torch.randn(5, 6, dtype=dtype)]
    results = []
    for engine in (engines.func_vjp, engines.public_func_vjp):
        outs, vjp_fn, aux = engine(fn, params, inputs)
        cotangents = [torch.ones_like(o) * 0.5 for o in outs]
        with torch.enable_grad():  # as in a training step, where the backward runs
            results.append((outs, aux, *vjp_fn(cotangents)))
    fast, public = results
    for got, want in zip(fast, public):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            if a is None:  # a parameter no output uses: None here, zeros from torch.func
                assert fn is _unused_input and not b.any()
                continue
            assert torch.equal(a, b) and not a.requires_grad
    if fn is _unused_input:
        assert fast[2][1] is None  # the unused parameter has no gradient, as in PyTorch


def test_func_engine_uses_functorch_internals_on_this_torch():
    # The fallback is for torch versions without them; this one has them.
    assert engines.func_vjp is not engines.public_func_vjp


@pytest.mark.parametrize("schedule, accumulates", [
    (gpipe(4), True), (gpipe(4, remat="always"), True), (one_f_one_b(4), True),
    (zero_bubble(4), False)])  # a split backward's W half adds its own gradients
def test_gradients_accumulated_in_autograd_equal_the_summed_ones(schedule, accumulates,
                                                                 monkeypatch):
    x = torch.randn(8, 8, dtype=torch.float64)
    accumulating = instructions._accumulate
    used = []
    monkeypatch.setattr(instructions, "_accumulate",
                        lambda *args: used.append(accumulating(*args)) or used[-1])
    results = []
    for accumulate in (True, False):
        if not accumulate:  # every backward returns its gradients, which GradSums adds
            assert any(leaves is not None for leaves in used) == accumulates
            monkeypatch.setattr(instructions, "_accumulate", lambda *args: None)
        with fpipe.pipeline([block] * 3, mlp_params(3), schedule=schedule, loss_fn=mse,
                            autodiff="autograd") as pipe:
            results.append(pipe.value_and_grad(x, x))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b):
        for key in a:
            assert torch.equal(a[key], b[key])
