"""Skip connections: values go straight from the stage that stashes them to the one that pops
them, and gradients come back exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import (
    TIGHT,
    assert_trees_close,
    block,
    mlp_params,
    mse,
    two_stages_per_worker,
    whole_batch,
)

import fpipe
from fpipe.schedules import gpipe, one_f_one_b
from fpipe.stages import skippable


@skippable(stash=["enc0"])
def encode0(p, x):
    h = block(p, x)
    return h, {"enc0": h * 2}


@skippable(stash=["enc1"])
def encode1(p, x):
    h = block(p, x)
    return h, {"enc1": {"value": h, "ids": (h > 0).sum(1)}}  # an integer leaf rides along


@skippable(pop=["enc1"])
def decode1(p, x, skips):
    enc = skips["enc1"]
    return block(p, x + enc["value"] * (enc["ids"][:, None] % 2))


@skippable(pop=["enc0"])
def decode0(p, x, skips):
    return block(p, x) + skips["enc0"]


UNET = [encode0, encode1, block, decode1, decode0]


def plain(stage):
    """The same stage without the pipeline: skips passed by hand, as a whole-batch model."""
    return stage.fn if hasattr(stage, "fn") else stage


def unet_whole_batch(params, x, target):
    def loss(ps):
        h, s0 = plain(encode0)(ps[0], x)
        h, s1 = plain(encode1)(ps[1], h)
        h = block(ps[2], h)
        h = plain(decode1)(ps[3], h, s1)
        h = plain(decode0)(ps[4], h, s0)
        return mse(h, target)
    return torch.func.grad_and_value(loss)(params)


@given(chunks=st.integers(1, 5), extra=st.integers(0, 4),
       make=st.sampled_from([gpipe, one_f_one_b]),
       remat=st.sampled_from(["always", "except_last", "never", frozenset({0, 3})]))
def test_unet_gradients_are_exact(chunks, extra, make, remat):
    params = mlp_params(5)
    n = chunks + extra
    x = torch.randn(n, 8, dtype=torch.float64)
    target = torch.randn(n, 8, dtype=torch.float64)
    expected_grads, expected_loss = unet_whole_batch(params, x, target)
    with fpipe.pipeline(UNET, params, schedule=make(chunks=chunks, remat=remat),
                        loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)


def test_skip_across_workers_holding_several_stages():
    stages = [encode0, block, block, decode0]
    params = mlp_params(4)
    x, target = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)

    def loss(ps):
        h, s0 = plain(encode0)(ps[0], x)
        h = block(ps[2], block(ps[1], h))
        return mse(plain(decode0)(ps[3], h, s0), target)

    expected_grads, expected_loss = torch.func.grad_and_value(loss)(params)
    with fpipe.pipeline(stages, params, schedule=two_stages_per_worker(3), loss_fn=mse) as pipe:
        loss_value, grads = pipe.value_and_grad(x, target)
        y = pipe(x)
    torch.testing.assert_close(loss_value, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)
    h, s0 = plain(encode0)(params[0], x)
    torch.testing.assert_close(y, plain(decode0)(params[3], block(params[2], block(params[1], h)),
                                                 s0), **TIGHT)


def test_skip_to_the_next_stage_and_from_stage_zero_to_the_last():
    stages = [encode0, skippable(lambda p, x, s: block(p, x) * s["enc0"], pop=["enc0"])]
    params = mlp_params(2)
    x, target = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)

    def loss(ps):
        h, s0 = plain(encode0)(ps[0], x)
        return mse(block(ps[1], h) * s0["enc0"], target)

    expected_grads, expected_loss = torch.func.grad_and_value(loss)(params)
    with fpipe.pipeline(stages, params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        loss_value, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss_value, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)


def test_stateful_stage_with_skips():
    @skippable(stash=["a"])
    def first(p, state, x):
        h = block(p, x)
        return (h, {"a": h}), {"calls": state["calls"] + 1}

    @skippable(pop=["a"])
    def last(p, state, x, skips):
        return block(p, x) + skips["a"], state

    params = mlp_params(3)
    state = [{"calls": 0}, {}, {}]

    def middle(p, state, x):
        return block(p, x), state

    x, target = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)

    def loss(ps):
        h = block(ps[0], x)
        return mse(block(ps[2], block(ps[1], h)) + h, target)

    expected_grads, expected_loss = torch.func.grad_and_value(loss)(params)
    with fpipe.pipeline([first, middle, last], params, state=state,
                        schedule=gpipe(chunks=3, remat="always"), loss_fn=mse) as pipe:
        loss_value, grads, new_state = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss_value, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)
    assert new_state[0]["calls"] == 3


def test_bad_skips_are_refused_before_running():
    with pytest.raises(fpipe.stages.SkipError, match="no later stage pops it"):
        fpipe.pipeline([encode0, block], mlp_params(2), schedule=gpipe(chunks=1))


def test_a_stage_stashing_other_names_is_an_error():
    @skippable(stash=["enc0"])
    def wrong(p, x):
        return block(p, x), {"other": x}

    with fpipe.pipeline([wrong, decode0], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        expected = r"must stash exactly \['enc0'\], got \['other'\]"
        with pytest.raises(fpipe.StageError, match=expected):
            pipe(torch.randn(4, 8, dtype=torch.float64))


def test_stash_with_another_batch_size_is_an_error():
    @skippable(stash=["enc0"])
    def wrong(p, x):
        return block(p, x), {"enc0": x[:1]}

    with fpipe.pipeline([wrong, decode0], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        with pytest.raises(fpipe.StageError, match="stashed skip 'enc0'.*micro-batch size 2"):
            pipe(torch.randn(4, 8, dtype=torch.float64))


def test_whole_batch_reference_helper_agrees():
    """The reference used above is itself the plain model (guards the test's own logic)."""
    params = mlp_params(3)
    x, target = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    loss, _ = whole_batch([block] * 3, params, x, target, mse)
    with fpipe.pipeline([block] * 3, params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        torch.testing.assert_close(pipe.value_and_grad(x, target)[0], loss, **TIGHT)


def test_a_popped_skip_beside_an_input_with_an_integer_leaf():
    """The input gradients of a stage that pops a skip are cut per input by the number of
    leaves that carry a gradient: an integer leaf of ``x`` carries none, so counting it would
    send the skip's gradient to the previous stage instead of the stage that stashed it."""
    @skippable(stash=["h"])
    def first(p, x):
        h = block(p, x)
        return h, {"h": h * 3}

    def middle(p, x):
        h = block(p, x)
        return h, (h > 0).sum(1)

    @skippable(pop=["h"])
    def last(p, x_ids, skips):
        x, ids = x_ids
        return block(p, x) * skips["h"] + ids[:, None]

    params = mlp_params(3)
    x, target = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)

    def loss(ps):
        h, s = plain(first)(ps[0], x)
        return mse(plain(last)(ps[2], middle(ps[1], h), s), target)

    expected_grads, expected_loss = torch.func.grad_and_value(loss)(params)
    with fpipe.pipeline([first, middle, last], params, schedule=gpipe(chunks=2),
                        loss_fn=mse) as pipe:
        loss_value, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss_value, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)
