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


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_a_tied_weight_is_clipped_as_the_model_with_one_tensor_clips_it(max_norm):
    """Embedding and LM head as one tensor in a plain model; as two copies over two stages of
    a pipeline with ``ties=``: the norm and the clipped gradients are the model's."""
    torch.manual_seed(0)
    emb, mid = torch.randn(11, 5, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    ids, target = torch.randint(0, 11, (8, 3)), torch.randint(0, 11, (8, 3))

    def first(p, x):
        return p["wte"][x] @ p["mid"]

    def last(p, h):
        return h @ p["head"].T

    def loss_fn(logits, t):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())

    params = [{"wte": emb.clone(), "mid": mid.clone()}, {"head": emb.clone()}]
    pipe = fpipe.pipeline([first, last], params, schedule=one_f_one_b(chunks=4),
                          loss_fn=loss_fn, ties=[[(0, "wte"), (1, "head")]])
    _, grads = pipe.value_and_grad(ids, target)
    pipe.close()
    grads, norm = clip_grad_norm(grads, max_norm, ties=[[(1, "head"), (0, "wte")]])

    model = [emb.clone().requires_grad_(), mid.clone().requires_grad_()]
    loss_fn(model[0][ids] @ model[1] @ model[0].T, target).backward()
    expected = torch.nn.utils.clip_grad_norm_(model, max_norm)
    torch.testing.assert_close(norm, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grads[0]["wte"], model[0].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1]["head"], model[0].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0]["mid"], model[1].grad, rtol=1e-10, atol=1e-12)
    # Counted twice (no ties=), the norm would be the untied model's: larger.
    assert global_norm(grads) > global_norm(grads, ties=[[(0, "wte"), (1, "head")]])


def test_global_norm_counts_a_rank_s_stages_by_their_numbers():
    """A ``{stage: pytree}`` (a distributed rank's) skips a tie's later copies by stage."""
    grads = {2: {"w": torch.full((4,), 3.0)}, 5: {"w": torch.full((4,), 3.0),
                                                  "b": torch.full((1,), 4.0)}}
    torch.testing.assert_close(global_norm(grads, ties=[[(2, "w"), (5, "w")]]),
                               torch.tensor((36.0 + 16.0) ** 0.5))
    torch.testing.assert_close(global_norm(grads), torch.tensor((72.0 + 16.0) ** 0.5))
