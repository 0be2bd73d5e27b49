"""Mixed precision: autocast inside stages, bfloat16 parameters with float32 gradients, and
float16 loss scaling that skips overflowing steps (its logic on the CPU, a run on CUDA)."""

from __future__ import annotations

import optree
import pytest
import torch
from models import assert_trees_close, block, mlp_params, mse, whole_batch

import fpipe
from fpipe import amp
from fpipe.optim import bind_grads
from fpipe.schedules import gpipe, one_f_one_b

BF16 = dict(rtol=2e-2, atol=2e-2)


def data(n=8, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
    return x.to(device, dtype), t.to(device, dtype)


def matmul_block(p, x):
    return torch.tanh(x @ p["w"])  # in bfloat16 under autocast


def test_autocast_reaches_stages_in_worker_threads():
    params = mlp_params(3, dtype=torch.float32)
    stages = [amp.autocast(matmul_block)] * 3
    x, t = data()
    with fpipe.pipeline(stages, params, schedule=one_f_one_b(chunks=4), loss_fn=mse) as pipe:
        assert pipe(x).dtype == torch.bfloat16
        loss, grads = pipe.value_and_grad(x, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected_grads = whole_batch([matmul_block] * 3, params, x, t, mse)
    assert all(g.dtype == torch.float32 for g in optree.tree_leaves(grads))
    torch.testing.assert_close(loss, expected_loss, **BF16)
    assert_trees_close(grads, expected_grads, **BF16)


def test_bfloat16_params_with_float32_gradients_and_master_weights():
    master = mlp_params(3, dtype=torch.float32)
    params = amp.cast(master, torch.bfloat16)
    x, t = data(dtype=torch.bfloat16)
    with fpipe.pipeline([block] * 3, params, schedule=gpipe(chunks=4), loss_fn=mse,
                        grad_dtype=torch.float32) as pipe:
        _, grads = pipe.value_and_grad(x, t)
        # The reference: each micro-batch's bfloat16 gradient, summed in float32.
        expected = None
        for xs, ts in zip(x.split(2), t.split(2)):
            _, part = whole_batch([block] * 3, params, xs, ts, lambda y, t: mse(y, t) / 4)
            part = amp.cast(part, torch.float32)
            expected = part if expected is None else optree.tree_map(torch.add, expected, part)
        assert_trees_close(grads, expected, rtol=1e-6, atol=1e-6)
        # A step on the float32 masters, then the bfloat16 copy the pipeline runs on.
        optimizer = torch.optim.SGD(optree.tree_leaves(master), lr=0.1)
        bind_grads(master, grads)
        optimizer.step()
        params = amp.cast(master, torch.bfloat16)
        loss, _ = pipe.value_and_grad(x, t, params=params)
    assert loss.dtype == torch.bfloat16


def fp16_step(scaler, device="cpu"):
    params = [optree.tree_map(lambda p: p.to(device, torch.float16), p) for p in mlp_params(2)]
    x, t = data(dtype=torch.float16, device=device)
    with fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=2),
                        loss_fn=scaler.scaled(mse), nonfinite="ignore") as pipe:
        loss, grads = pipe.value_and_grad(x, t)
    return params, loss, grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_loss_scaling_skips_overflowing_steps_and_unscales_the_others(device):
    scaler = amp.LossScaler(init_scale=2.0 ** 40, growth_interval=2)
    _, _, grads = fp16_step(scaler, device)
    grads, finite = scaler.unscale(grads)
    assert not finite  # float16 overflows at 65504
    scaler.update(finite)
    assert scaler.scale == 2.0 ** 39

    scaler.scale = 2.0 ** 8
    params, loss, grads = fp16_step(scaler, device)
    grads, finite = scaler.unscale(grads)
    assert finite
    x, t = data(dtype=torch.float16, device=device)
    expected_loss, expected_grads = whole_batch([block] * 2, params, x, t, mse)
    torch.testing.assert_close(loss / scaler.scale, expected_loss, rtol=1e-2, atol=1e-3)
    assert_trees_close(grads, expected_grads, rtol=1e-2, atol=1e-3)
    scaler.update(finite)
    scaler.update(finite)
    assert scaler.scale == 2.0 ** 9  # grown after growth_interval finite steps


def test_a_nan_on_any_stage_marks_the_step_not_finite():
    scaler = amp.LossScaler(init_scale=4.0)
    grads = [{"w": torch.ones(3)}, {"w": torch.tensor([1.0, float("nan")])}]
    unscaled, finite = scaler.unscale(grads)
    assert not finite
    torch.testing.assert_close(unscaled[0]["w"], torch.full((3,), 0.25))


def test_autocast_defaults_to_the_stages_device_type():
    """No device type given: the stage's tensors say it (on CUDA stages, "cuda"; the old
    default "cpu" did nothing there), here for a stage with parameters and one without."""
    seen = []

    def noting(p, x):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                    else None)
        return torch.tanh(x @ p["w"]) if p else x * 2

    params = [mlp_params(1, dtype=torch.float32)[0], {}]
    x, t = data()
    with fpipe.pipeline([amp.autocast(noting)] * 2, params, schedule=gpipe(chunks=2),
                        loss_fn=mse) as pipe:
        assert pipe(x).dtype == torch.bfloat16
    assert seen == [torch.bfloat16] * 4
    assert amp.autocast(noting).device_type is None
