"""Optimiser helpers: torch.optim on the parameter leaves, the functional SGD step, and
clipping by one norm over every stage's gradients, against the plain model's."""

from __future__ import annotations

import optree
import pytest
import torch
from models import assert_trees_close, block, mlp_params, mse

import fpipe
from fpipe.optim import bind_grads, clip_grad_norm, global_norm, sgd
from fpipe.schedules import gpipe, one_f_one_b


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


# -- gradient accumulation, the PyTorch way (issue 34) ------------------------------------------

EXACT = dict(rtol=1e-12, atol=1e-12)


def leaf_copies(params):
    """The parameters as plain PyTorch trains them: leaves requiring grad."""
    return [{k: v.detach().clone().requires_grad_() for k, v in p.items()} for p in params]


def run(params, x):
    for p in params:
        x = block(p, x)
    return x


def halves(x, target):
    return [(x[:4], target[:4]), (x[4:], target[4:])]


def plain_whole_batch_step(params, x, target):
    """One AdamW step of the plain model on the whole batch: the reference."""
    ref = leaf_copies(params)
    optimizer = torch.optim.AdamW(optree.tree_leaves(ref), lr=0.1, weight_decay=0.1)
    mse(run(ref, x), target).backward()
    grads = [{k: v.grad.clone() for k, v in p.items()} for p in ref]
    optimizer.step()
    return grads, ref


def accumulation_case():
    """A 3-stage float64 model, a batch of 8, the plain whole-batch step's gradients and
    parameters (the reference), and an AdamW over the model's leaves: what a test of two
    half-batch passes steps from."""
    params = mlp_params(3)
    x, target = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    expected_grads, expected = plain_whole_batch_step(params, x, target)
    optimizer = torch.optim.AdamW(optree.tree_leaves(params), lr=0.1, weight_decay=0.1)
    return params, x, target, expected_grads, expected, optimizer


def assert_stepped_as(params, expected):
    """The parameters after the step equal the reference's, exactly."""
    assert_trees_close(params, [{k: v.detach() for k, v in p.items()} for p in expected],
                       **EXACT)


def test_two_half_batch_passes_bound_with_accumulate_equal_one_whole_batch_step():
    """PyTorch's idiom: each half's loss divided by the number of passes, backward twice, one
    step. With fpipe: loss_fn divided alike, bind_grads(accumulate=True) twice, one step."""
    params, x, target, expected_grads, expected, optimizer = accumulation_case()
    with fpipe.pipeline([block] * 3, params, schedule=one_f_one_b(chunks=2),
                        loss_fn=lambda y, t: mse(y, t) / 2) as pipe:
        returned = []
        for xh, th in halves(x, target):
            loss, grads = pipe.value_and_grad(xh, th)
            returned.append(grads)
            bind_grads(params, grads, accumulate=True)
    for p, g in zip(params, expected_grads):
        for k in p:
            torch.testing.assert_close(p[k].grad, g[k], **EXACT)
    # the first call's gradients were copied, not added into: they are still its own
    assert all(p["w"].grad is not g["w"] for p, g in zip(params, returned[0]))
    torch.testing.assert_close(returned[0][0]["w"] + returned[1][0]["w"], params[0]["w"].grad,
                               **EXACT)
    optimizer.step()
    assert_stepped_as(params, expected)


def test_value_and_grad_accumulate_sums_the_calls_as_one_whole_batch_step():
    params, x, target, expected_grads, expected, optimizer = accumulation_case()
    with fpipe.pipeline([block] * 3, params, schedule=gpipe(chunks=2),
                        loss_fn=lambda y, t: mse(y, t) / 2) as pipe:
        (x1, t1), (x2, t2) = halves(x, target)
        loss1, kept = pipe.value_and_grad(x1, t1, accumulate=True)
        assert kept is None
        torch.testing.assert_close(loss1, mse(run(params, x1), t1) / 2, **EXACT)
        with pytest.raises(RuntimeError, match="accumulate=True.*vjp cannot add"):
            pipe.vjp(x1)
        loss2, grads = pipe.value_and_grad(x2, t2)
        assert_trees_close(grads, expected_grads, **EXACT)
        # the sums were handed over: the next call returns its own gradients only
        alone = pipe.value_and_grad(x2, t2)[1]
        assert_trees_close(alone, pipeline_own(params, x2, t2), **EXACT)
        pipe.vjp(x1)  # nothing waits any more
    bind_grads(params, grads)
    optimizer.step()
    assert_stepped_as(params, expected)


def pipeline_own(params, x, target):
    ref = leaf_copies(params)
    (mse(run(ref, x), target) / 2).backward()
    return [{k: v.grad for k, v in p.items()} for p in ref]


def test_bind_grads_with_a_none_gradient_clears_a_stale_grad_or_keeps_it_when_accumulating():
    params = mlp_params(1)
    for leaf in optree.tree_leaves(params):
        leaf.grad = torch.ones_like(leaf)
    stale = params[0]["b"].grad
    new = torch.full_like(params[0]["w"], 2.0)
    bind_grads(params, [{"w": new, "b": None}], accumulate=True)
    assert params[0]["b"].grad is stale and torch.equal(stale, torch.ones_like(stale))
    assert torch.equal(params[0]["w"].grad, torch.full_like(new, 3.0))
    assert torch.equal(new, torch.full_like(new, 2.0))  # added into .grad, not into the gradient
    bind_grads(params, [{"w": new, "b": None}])
    assert params[0]["b"].grad is None and params[0]["w"].grad is new


def gated(use):
    """``block`` plus ``x * p["e"]`` while ``use["e"]``: a branch a later step leaves unused."""
    def stage(p, x):
        y = block(p, x)
        return y + x * p["e"] if use["e"] and "e" in p else y
    return stage


@pytest.mark.parametrize("zero_grad", [True, False])
def test_a_leaf_unused_in_the_second_step_gets_the_grad_plain_pytorch_gives_it(zero_grad):
    """Two AdamW steps; the second leaves ``e`` unused (gradient None). With zero_grad between
    the steps, plain PyTorch's ``.grad`` of ``e`` is None in the second step, and so is the
    bound one; without, backward keeps adding into ``.grad`` (``e`` keeps its first step's
    gradient and moves again), and so does ``bind_grads(..., accumulate=True)``."""
    params = mlp_params(2)
    params[1]["e"] = torch.full((8,), 0.5, dtype=torch.float64)
    use = {"e": True}
    stage = gated(use)
    data = [(torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
            for _ in range(2)]
    ref = leaf_copies(params)
    ref_opt = torch.optim.AdamW(optree.tree_leaves(ref), lr=0.1, weight_decay=0.1)
    optimizer = torch.optim.AdamW(optree.tree_leaves(params), lr=0.1, weight_decay=0.1)
    with fpipe.pipeline([stage] * 2, params, schedule=one_f_one_b(chunks=2),
                        loss_fn=mse) as pipe:
        for step, (x, target) in enumerate(data):
            use["e"] = step == 0
            if zero_grad:
                ref_opt.zero_grad()
                optimizer.zero_grad()
            mse(stage(ref[1], stage(ref[0], x)), target).backward()
            loss, grads = pipe.value_and_grad(x, target)
            assert (grads[1]["e"] is None) == (step == 1)
            bind_grads(params, grads, accumulate=True)
            for p, q in zip(params, ref):
                for k in p:
                    assert (p[k].grad is None) == (q[k].grad is None), k
                    if q[k].grad is not None:
                        torch.testing.assert_close(p[k].grad, q[k].grad, **EXACT)
            ref_opt.step()
            optimizer.step()
    assert (params[1]["e"].grad is None) == zero_grad
    assert_trees_close(params, [{k: v.detach() for k, v in p.items()} for p in ref], **EXACT)
