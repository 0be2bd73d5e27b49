"""Pipelined loss and gradients equal whole-batch ``torch.func`` ones, for every schedule."""

from __future__ import annotations

import functools
from collections import namedtuple

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from models import (
    TIGHT,
    assert_trees_close,
    block,
    forward,
    mlp_params,
    mse,
    two_stages_per_worker,
    whole_batch,
)

import fpipe
from fpipe.schedules import (
    Program,
    gpipe,
    interleaved_one_f_one_b,
    looped_bfs,
    one_f_one_b,
    zero_bubble,
    zero_bubble_v,
)

KINDS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble,
         "interleaved": interleaved_one_f_one_b, "looped_bfs": looped_bfs,
         "zero_bubble_v": zero_bubble_v}


@st.composite
def pipeline_cases(draw, kind):
    """(schedule, n_stages, batch size, width) for a schedule of ``kind``: 1 to 8 workers
    (uniformly), v = 2 or 3 stages per worker for the looped kinds (at most 12 stages), two per
    worker for ZB-V, else one; 1 to 8 chunks; an uneven split half of the time (the batch is
    1 to 3 samples per micro-batch, plus a remainder); width 2, 5 or 8; any remat policy."""
    # Hypothesis's first example takes each list's first entry and shrinks towards it: a
    # middling case first, rather than the one-worker, one-chunk corner every time.
    workers = draw(st.sampled_from([4, 1, 2, 3, 5, 6, 7, 8]))
    make = KINDS[kind]
    if kind in ("interleaved", "looped_bfs"):
        per_worker = draw(st.sampled_from([2, 3]))
        workers = min(workers, 12 // per_worker)
        n_stages = workers * per_worker
        make = functools.partial(make, stages_per_worker=per_worker)
    else:
        n_stages = workers * (2 if kind == "zero_bubble_v" else 1)
    chunks = draw(st.sampled_from([4, 1, 2, 3, 5, 6, 7, 8]))
    n = chunks * draw(st.sampled_from([2, 1, 3]))
    if chunks > 1 and draw(st.booleans()):
        n += draw(st.integers(1, chunks - 1))  # uneven: micro-batch sizes differ by one
    width = draw(st.sampled_from([5, 2, 8]))
    remat = draw(st.one_of(st.sampled_from(["always", "except_last", "never"]),
                           st.frozensets(st.integers(0, n_stages - 1), max_size=n_stages)))
    return make(chunks=chunks, remat=remat), n_stages, n, width


# Examples are spread by stratifying on the schedule kind: each kind gets a sixth of the
# profile's examples (ci: 10 each, 60 in all; dev: 83 each).
@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=max(5, settings.default.max_examples // len(KINDS)))
@given(data=st.data())
def test_matches_whole_batch(kind, data):
    """Loss, gradients and inference output equal the whole batch's, for every schedule kind.

    The examples, as measured by running ``pipeline_cases`` under ``@given`` and tabulating:
    - ci profile (10 per kind, 60 in all; four runs): every kind gets 10; 7 to 10 of each
      kind's 10 run on 2 or more workers and each kind reaches 6 to 8 workers (the looped ones,
      at most 12 stages, 6); chunks=1 in 3 to 11 of 60 (4 chunks the most common, 14 to 18);
      uneven splits in 27-52 %; width 2, 5 and 8 each 12 to 33.
    - 1000 draws per kind: 9 % one worker, 2 to 8 workers spread evenly (4 and 6 more often
      for the looped kinds, whose workers are capped), chunks 1 to 8 each 10-14 %, uneven
      46 %, each width a third.
    Before (one strategy over all kinds, 60 examples, four runs): 30-37 of 60 on one worker,
    chunks=1 in 14-26, some kinds 1 to 6 times, the looped kinds never beyond 2 workers and
    1F1B or ZB-V at most 1-5 workers, width always 8."""
    schedule, n_stages, n, width = data.draw(pipeline_cases(kind))
    params = mlp_params(n_stages, width=width)
    stages = [block] * n_stages
    x = torch.randn(n, width, dtype=torch.float64)
    target = torch.randn(n, width, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch(stages, params, x, target, mse)
    autodiff = data.draw(st.sampled_from(["func", "autograd"]))
    with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse,
                        autodiff=autodiff) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
        torch.testing.assert_close(loss, expected_loss, **TIGHT)
        assert_trees_close(grads, expected_grads)
        torch.testing.assert_close(pipe(x), forward(stages, params, x), **TIGHT)


def test_ten_samples_in_four_chunks():
    params = mlp_params(3)
    stages = [block] * 3
    x, target = torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch(stages, params, x, target, mse)
    for schedule in (gpipe(chunks=4), one_f_one_b(chunks=4)):
        with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse) as pipe:
            loss, grads = pipe.value_and_grad(x, target)
        torch.testing.assert_close(loss, expected_loss, **TIGHT)
        assert_trees_close(grads, expected_grads)


Affine = namedtuple("Affine", ["weight", "bias"])


def embed(p, batch):
    """Dict in (with integer ids and a Python value), tuple out (with the ids passed on)."""
    h = p["table"][batch["ids"]] * batch["scale"] + batch["features"] @ p["proj"]
    return h, batch["ids"]


def mix(p, value):
    h, ids = value
    return {"h": torch.tanh(h @ p[0].weight + p[0].bias), "ids": ids, "extra": [p[1]["gain"] * h]}


def head(p, value):
    return (value["h"] + value["extra"][0]) @ p["out"]


def pytree_model(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype) * 0.5

    params = [
        {"table": r(11, 6), "proj": r(4, 6)},
        [Affine(r(6, 6), r(6)), {"gain": r(6)}],
        {"out": r(6, 3)},
    ]
    return [embed, mix, head], params


def pytree_batch(n):
    """Input for pytree_model: token ids, float features and a Python scalar."""
    return {"ids": torch.randint(0, 11, (n,)), "features": torch.randn(n, 4, dtype=torch.float64),
            "scale": 2.0}


@pytest.mark.parametrize("schedule", [gpipe(chunks=3), gpipe(chunks=5, remat="always"),
                                      one_f_one_b(chunks=4, remat="except_last")])
def test_pytree_inputs_outputs_and_params(schedule):
    stages, params = pytree_model()
    n = 7
    batch = pytree_batch(n)
    target = torch.randn(n, 3, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch(stages, params, batch, target, mse)
    with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(batch, target)
        torch.testing.assert_close(loss, expected_loss, **TIGHT)
        assert_trees_close(grads, expected_grads)
        assert isinstance(grads[1][0], Affine)
        torch.testing.assert_close(pipe(batch), forward(stages, params, batch), **TIGHT)


def test_other_params_same_pipeline():
    params = mlp_params(3)
    other = mlp_params(3, seed=5)
    stages = [block] * 3
    x, target = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch(stages, other, x, target, mse)
    with fpipe.pipeline(stages, params, schedule=gpipe(chunks=3), loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target, params=other)
        torch.testing.assert_close(pipe(x, params=other), forward(stages, other, x), **TIGHT)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)


def test_requires_grad_params_are_not_tracked():
    params = [{k: v.requires_grad_() for k, v in p.items()} for p in mlp_params(2)]
    x, target = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    with fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    assert not loss.requires_grad
    assert all(not g.requires_grad for g in optree.tree_leaves(grads))
    assert all(p.grad is None for p in optree.tree_leaves(params))


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_several_stages_per_worker(chunks):
    params = mlp_params(4)
    stages = [block] * 4
    x, target = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch(stages, params, x, target, mse)
    with fpipe.pipeline(stages, params, schedule=two_stages_per_worker(chunks),
                        loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)


def test_split_backward_program_runs():
    """A hand-written program with input- and weight-gradient actions gives the same grads."""
    program = Program([["0F0", "0F1", "0I1", "0I0", "0W0", "0W1"],
                       ["1F0", "1I0", "1F1", "1I1", "1W1", "1W0"]], n_stages=2, n_microbatches=2)
    params = mlp_params(2)
    stages = [block] * 2
    x, target = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch(stages, params, x, target, mse)
    with fpipe.pipeline(stages, params, schedule=program, loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)


def dropout_block(p, x):
    return F.dropout(torch.tanh(x @ p["w"] + p["b"]), p=0.5, training=True)


def dropout_step(schedule, seed=0, n_stages=3):
    params = mlp_params(n_stages)
    torch.manual_seed(123)
    x, target = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    with fpipe.pipeline([dropout_block] * n_stages, params, schedule=schedule,
                        loss_fn=mse) as pipe:
        torch.manual_seed(seed)
        return pipe.value_and_grad(x, target)


@pytest.mark.parametrize("remat", ["always", "except_last", frozenset({1})])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_dropout_recompute_draws_the_same_numbers(make, remat):
    loss, grads = dropout_step(make(chunks=4, remat="never"))
    loss_remat, grads_remat = dropout_step(make(chunks=4, remat=remat))
    torch.testing.assert_close(loss_remat, loss, rtol=0, atol=0)
    assert_trees_close(grads_remat, grads, rtol=0, atol=0)


def test_dropout_is_active_and_seeded_by_the_caller():
    loss_a, grads_a = dropout_step(gpipe(chunks=4), seed=0)
    loss_b, grads_b = dropout_step(gpipe(chunks=4), seed=0)
    loss_c, _ = dropout_step(gpipe(chunks=4), seed=1)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(grads_a),
                                                 optree.tree_leaves(grads_b)))
    assert not torch.equal(loss_a, loss_c)


def test_dropout_same_masks_under_both_schedules():
    loss_gpipe, grads_gpipe = dropout_step(gpipe(chunks=4, remat="always"))
    loss_1f1b, grads_1f1b = dropout_step(one_f_one_b(chunks=4))
    torch.testing.assert_close(loss_1f1b, loss_gpipe, **TIGHT)
    assert_trees_close(grads_1f1b, grads_gpipe)


def test_caller_generator_advances_by_one_draw_per_step():
    params = mlp_params(2)
    x = torch.randn(4, 8, dtype=torch.float64)
    with fpipe.pipeline([dropout_block] * 2, params, schedule=gpipe(chunks=2)) as pipe:
        torch.manual_seed(7)
        pipe(x)
        after_step = torch.rand(3)
    torch.manual_seed(7)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(after_step, torch.rand(3))


def test_float32_training_with_torch_optim():
    """The README's glue: an optimiser over the parameter leaves, grads assigned to .grad."""
    torch.manual_seed(0)
    params = mlp_params(4, width=16, dtype=torch.float32)
    leaves = optree.tree_leaves(params)
    optimizer = torch.optim.SGD(leaves, lr=0.1)
    x = torch.randn(32, 16)
    target = torch.sin(x)
    losses = []
    with fpipe.pipeline([block] * 4, params, schedule=one_f_one_b(chunks=4),
                        loss_fn=mse) as pipe:
        for _ in range(30):
            loss, grads = pipe.value_and_grad(x, target)
            for leaf, grad in zip(leaves, optree.tree_leaves(grads)):
                leaf.grad = grad
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("remat", ["always", "except_last", "never"])
def test_vjp_matches_torch_func_vjp(remat):
    stages, params = pytree_model()
    n = 7
    batch = pytree_batch(n)
    cotangent = torch.randn(n, 3, dtype=torch.float64)
    with fpipe.pipeline(stages, params, schedule=gpipe(chunks=3, remat=remat)) as pipe:
        y, vjp_fn = pipe.vjp(batch)
        grads, batch_grad = vjp_fn(cotangent)
        with pytest.raises(RuntimeError, match="called already"):
            vjp_fn(cotangent)

    def plain(ps, features):
        return forward(stages, ps, {**batch, "features": features})

    expected_y, expected_vjp = torch.func.vjp(plain, params, batch["features"])
    expected_grads, expected_features_grad = expected_vjp(cotangent)
    torch.testing.assert_close(y, expected_y, **TIGHT)
    assert_trees_close(grads, expected_grads)
    torch.testing.assert_close(batch_grad["features"], expected_features_grad, **TIGHT)
    assert batch_grad["ids"] is None and batch_grad["scale"] is None


def test_vjp_needs_forwards_first():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=one_f_one_b(chunks=2)) as pipe:
        with pytest.raises(ValueError, match="run all their forwards before any other action"):
            pipe.vjp(torch.randn(4, 8, dtype=torch.float64))


def test_schedules_doing_the_same_arithmetic_agree_bitwise():
    """Every shipped schedule sums a stage's gradients in micro-batch order, and a recompute
    repeats its forward exactly: so these give the very same bits, run after run."""
    params = mlp_params(4)
    torch.manual_seed(3)
    x, target = torch.randn(11, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    results = []
    for schedule in (gpipe(chunks=4, remat="never"), gpipe(chunks=4, remat="always"),
                     one_f_one_b(chunks=4), one_f_one_b(chunks=4, remat="except_last"),
                     gpipe(chunks=4)):
        with fpipe.pipeline([dropout_block] * 4, params, schedule=schedule, loss_fn=mse) as pipe:
            for _ in range(2):
                torch.manual_seed(0)
                results.append(pipe.value_and_grad(x, target))
    loss, grads = results[0]
    for other_loss, other_grads in results[1:]:
        assert torch.equal(other_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(other_grads),
                                                     optree.tree_leaves(grads)))


def test_a_plain_function_is_a_schedule():
    def fill_drain(n_stages):
        return gpipe(chunks=2, remat="never").program(n_stages)

    params = mlp_params(3)
    x = torch.randn(6, 8, dtype=torch.float64)
    with fpipe.pipeline([block] * 3, params, schedule=fill_drain, loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, x)
    want_loss, want_grads = whole_batch([block] * 3, params, x, x, mse)
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    assert_trees_close(grads, want_grads)
    with pytest.raises(TypeError, match=r"<lambda>\(2\) must return a Program for 2 stages"):
        fpipe.pipeline([block] * 2, params[:2], schedule=lambda n: fill_drain(3), loss_fn=mse)


@pytest.mark.parametrize("remat", ["always", "never"])
def test_autograd_vjp_draws_the_same_dropout_and_gives_the_same_gradients(remat):
    def noisy(p, x):
        return F.dropout(block(p, x), 0.3, training=True)

    x = torch.randn(8, 8, dtype=torch.float64)
    results = []
    for autodiff in ("func", "autograd"):
        torch.manual_seed(7)
        with fpipe.pipeline([noisy] * 3, mlp_params(3), schedule=gpipe(4, remat=remat),
                            loss_fn=mse, autodiff=autodiff) as pipe:
            results.append(pipe.value_and_grad(x, x))
    (loss_func, grads_func), (loss_autograd, grads_autograd) = results
    torch.testing.assert_close(loss_autograd, loss_func, **TIGHT)
    assert_trees_close(grads_autograd, grads_func)


def test_unknown_autodiff_is_an_error():
    with pytest.raises(ValueError, match="autodiff must be 'func' or 'autograd'"):
        fpipe.pipeline([block], mlp_params(1), schedule=gpipe(1), autodiff="jax")


@pytest.mark.parametrize("schedule", [gpipe(chunks=3), zero_bubble(chunks=3),
                                      zero_bubble_v(chunks=3)])
@pytest.mark.parametrize("autodiff", ["func", "autograd"])
def test_a_stage_without_parameters(schedule, autodiff):
    """A scaling stage with ``params = {}`` under every engine and split backward."""
    def halve(p, x):
        return x * 0.5

    n = 4
    stages = [halve, block, halve, block]  # the first: nothing to differentiate at all
    params = mlp_params(n)
    params[0] = params[2] = {}
    x, target = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch(stages, params, x, target, mse)
    with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse,
                        autodiff=autodiff) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert grads[0] == {} and grads[2] == {}
    for s in (1, 3):
        for name in ("w", "b"):
            torch.testing.assert_close(grads[s][name], expected_grads[s][name], **TIGHT)
