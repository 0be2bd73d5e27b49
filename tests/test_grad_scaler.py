"""``torch.amp.GradScaler`` with a pipeline, as docs/mixed-precision.md shows it: the loss scaled
inside ``loss_fn``, the gradients bound with ``fpipe.optim.bind_grads``, then the scaler's own
``step`` and ``update``. Unscaled, the gradients are the unscaled pipeline's; an overflowing
step is skipped and the scale backs off; the scaler's state_dict round-trips."""

from __future__ import annotations

import optree
import torch
from models import assert_trees_close, block, mlp_params, mse

import fpipe
from fpipe.optim import bind_grads
from fpipe.schedules import gpipe, one_f_one_b


def data(n=12):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def scaled_pipeline(params, scaler, schedule):
    return fpipe.pipeline([block] * 3, params, schedule=schedule, nonfinite="ignore",
                          loss_fn=lambda y, t: scaler.scale(mse(y, t)))


def test_grad_scaler_unscales_to_the_plain_gradients_and_steps():
    params = mlp_params(3, dtype=torch.float32)
    x, t = data()
    with fpipe.pipeline([block] * 3, params, schedule=gpipe(chunks=4), loss_fn=mse) as pipe:
        expected_loss, expected_grads = pipe.value_and_grad(x, t)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    optimizer = torch.optim.SGD(optree.tree_leaves(params), lr=0.1)
    before = optree.tree_map(torch.clone, params)
    with scaled_pipeline(params, scaler, one_f_one_b(chunks=4)) as pipe:
        loss, grads = pipe.value_and_grad(x, t)
    torch.testing.assert_close(loss, expected_loss * 2.0 ** 10)
    bind_grads(params, grads)
    scaler.unscale_(optimizer)  # what scaler.step does first
    assert_trees_close(optree.tree_map(lambda p: p.grad, params), expected_grads,
                       rtol=1e-6, atol=1e-7)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 10  # finite: kept (until growth_interval steps)
    stepped = optree.tree_map(lambda p, g: p - 0.1 * g, before, expected_grads)
    assert_trees_close(params, stepped, rtol=1e-6, atol=1e-7)


def test_an_overflowing_step_is_skipped_and_the_scale_backs_off():
    params = mlp_params(3, dtype=torch.float32)
    x, t = data()
    t = t * 1e6  # a large loss: its gradients, scaled by 2**127, overflow float32
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    optimizer = torch.optim.SGD(optree.tree_leaves(params), lr=0.1)
    before = optree.tree_map(torch.clone, params)
    with scaled_pipeline(params, scaler, gpipe(chunks=4)) as pipe:
        _, grads = pipe.value_and_grad(x, t)
        assert not all(torch.isfinite(g).all() for g in optree.tree_leaves(grads))
        bind_grads(params, grads)
        scaler.step(optimizer)
        scaler.update()
        assert_trees_close(params, before, rtol=0, atol=0)  # skipped
        assert scaler.get_scale() == 2.0 ** 126
        saved = scaler.state_dict()
        resumed = torch.amp.GradScaler("cpu")
        resumed.load_state_dict(saved)
        assert resumed.get_scale() == 2.0 ** 126
