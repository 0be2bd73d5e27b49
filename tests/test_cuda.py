"""The numerical checks again with stages on CUDA (skipped where there is no GPU).

Several stages share ``cuda:0`` so the compute and copy streams, and the events between them,
are exercised; a mixed CPU/CUDA pipeline makes values cross devices.
"""

from __future__ import annotations

import optree
import pytest
import torch
from models import block, forward, mlp_params, mse, whole_batch

import fpipe
from fpipe.schedules import gpipe, one_f_one_b

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TIGHT = dict(rtol=1e-10, atol=1e-12)


def to(params, devices):
    return [optree.tree_map(lambda t, d=d: t.to(d), p) for p, d in zip(params, devices)]


@pytest.mark.parametrize("devices", [["cuda:0"] * 4, ["cpu", "cuda:0", "cuda:0", "cpu"]])
@pytest.mark.parametrize("schedule", [gpipe(chunks=4), gpipe(chunks=3, remat="never"),
                                      one_f_one_b(chunks=5, remat="always")])
def test_matches_whole_batch_on_cuda(devices, schedule):
    params = to(mlp_params(4), devices)
    x = torch.randn(11, 8, dtype=torch.float64, device=devices[0])
    target = torch.randn(11, 8, dtype=torch.float64, device=devices[-1])

    def moving(stage_device):
        def stage(p, h):
            return block(p, h.to(stage_device))
        return stage

    reference_stages = [moving(d) for d in devices]
    expected_loss, expected_grads = whole_batch(reference_stages, params, x, target, mse)
    with fpipe.pipeline([block] * 4, params, schedule=schedule, loss_fn=mse) as pipe:
        for _ in range(3):  # repeated steps reuse the streams
            loss, grads = pipe.value_and_grad(x, target)
            torch.testing.assert_close(loss.cpu(), expected_loss.cpu(), **TIGHT)
            for g, e in zip(optree.tree_leaves(grads), optree.tree_leaves(expected_grads)):
                assert g.device == e.device
                torch.testing.assert_close(g, e, **TIGHT)
        y = pipe(x)
        torch.testing.assert_close(y, forward(reference_stages, params, x), **TIGHT)


def test_dropout_on_cuda_recompute_matches():
    import torch.nn.functional as F

    def dropout_block(p, x):
        return F.dropout(block(p, x), p=0.3, training=True)

    params = to(mlp_params(3), ["cuda:0"] * 3)
    x = torch.randn(8, 8, dtype=torch.float64, device="cuda:0")
    results = []
    for remat in ("never", "always"):
        with fpipe.pipeline([dropout_block] * 3, params, schedule=gpipe(chunks=4, remat=remat),
                            loss_fn=mse) as pipe:
            torch.manual_seed(0)
            results.append(pipe.value_and_grad(x, x))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(optree.tree_leaves(grads_a), optree.tree_leaves(grads_b)):
        assert torch.equal(a, b)
