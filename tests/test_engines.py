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


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("autodiff", ["autograd", "func"])
def test_a_training_step_makes_one_leaf_per_parameter_and_leaves_the_callers_alone(
        requires_grad, autodiff):
    """A training step differentiates leaves of its own: for a parameter that requires grad,
    the one detached tensor the step takes it as (not a second made from that one: each is
    tracked by Python's garbage collector, and a model of 800 made 1,700 a step); for a plain
    tensor that does not, a new leaf, the caller's tensor left as it is. Either way the
    gradients are the whole batch's (torch.func) and the caller's tensors keep their flag,
    their version and no ``.grad``."""
    import gc

    from models import whole_batch
    params = mlp_params(2)
    for tree in params:
        for leaf in tree.values():
            leaf.requires_grad_(requires_grad)
    versions = [leaf._version for tree in params for leaf in tree.values()]
    x = torch.randn(8, 8, dtype=torch.float64)
    with fpipe.pipeline([block] * 2, params, schedule=gpipe(4), loss_fn=mse,
                        autodiff=autodiff) as pipe:
        y, vjp_fn = pipe.vjp(x)
        if autodiff == "autograd":  # (the func engine's calls hold wrappers of their own)
            gc.collect()
            storages = {leaf.data_ptr() for tree in params for leaf in tree.values()}
            aliases = [t for t in gc.get_objects() if type(t) is torch.Tensor
                       and t.data_ptr() in storages]
            assert len(aliases) == 8  # the caller's 4 tensors, the step's 4 leaves
        grads, _ = vjp_fn(2 * (y - x) / y.numel())
    _, expected = whole_batch([block] * 2, [{k: v.detach() for k, v in tree.items()}
                                             for tree in params], x, x, mse)
    for got, want in zip(grads, expected):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-12)
    for tree in params:
        for leaf in tree.values():
            assert leaf.requires_grad == requires_grad and leaf.grad is None
    assert [leaf._version for tree in params for leaf in tree.values()] == versions
