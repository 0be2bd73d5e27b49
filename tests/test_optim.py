"""Optimiser helpers: torch.optim on the parameter leaves, the functional SGD step, and
clipping by one norm over every stage's gradients, against the plain model's."""

from __future__ import annotations

import optree
import pytest
import torch
from models import assert_trees_close, block, mlp_params, mse

import fpipe
from fpipe.optim import bind_grads, clip_grad_norm, global_norm, sgd
from fpipe.schedules import one_f_one_b


def pipeline_grads(params):
    x, target = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    with fpipe.pipeline([block] * len(params), params, schedule=one_f_one_b(chunks=4),
                        loss_fn=mse) as pipe:
        return pipe.value_and_grad(x, target)[1]


def test_torch_optim_on_bound_grads_equals_functional_sgd():
    params = mlp_params(3)
    grads = pipeline_grads(params)
    expected = sgd(params, grads, lr=0.1)
    optimizer = torch.optim.SGD(optree.tree_leaves(params), lr=0.1)
    bind_grads(params, grads)
    optimizer.step()
    assert_trees_close(params, expected)


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clip_grad_norm_equals_torch_on_the_whole_model(max_norm):
    grads = pipeline_grads(mlp_params(3))
    # torch's own clipping over the same gradients bound to one flat list of tensors.
    leaves = [torch.zeros_like(g, requires_grad=True) for g in optree.tree_leaves(grads)]
    for leaf, g in zip(leaves, optree.tree_leaves(grads)):
        leaf.grad = g.clone()
    clipped, norm = clip_grad_norm(grads, max_norm)
    assert clipped is grads  # in place, as torch's
    expected_norm = torch.nn.utils.clip_grad_norm_(leaves, max_norm)
    torch.testing.assert_close(norm, expected_norm)
    for leaf, g in zip(leaves, optree.tree_leaves(clipped)):
        torch.testing.assert_close(g, leaf.grad)
    assert (norm > max_norm) == (max_norm == 1e-3)


def test_global_norm_of_low_precision_grads_is_taken_in_float32():
    grads = [{"w": torch.full((1000,), 300.0, dtype=torch.float16)}]
    torch.testing.assert_close(global_norm(grads), torch.tensor(300.0 * 1000 ** 0.5))
