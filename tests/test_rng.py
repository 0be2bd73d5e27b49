"""A recompute draws what its forward drew, whatever the stage did on earlier calls.

Nothing about a stage's random draws is learnt once and trusted: a stage that starts drawing
later (dropout switched on after warm-up, a data-dependent branch) gets the same gradients
under every remat policy, and the same step as a pipeline that saw it draw from the start.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from models import block, mlp_params, mse

import fpipe
from fpipe.schedules import gpipe, one_f_one_b, zero_bubble


def switchable(flag):
    def stage(p, x):
        y = block(p, x)
        return F.dropout(y, 0.5, training=True) if flag["drop"] else y
    return stage


def step_after_switch(schedule, fresh: bool):
    """One step with dropout off (unless ``fresh``), then dropout on and a seeded step."""
    flag = {"drop": fresh}
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with fpipe.pipeline([switchable(flag)] * 2, mlp_params(2), schedule=schedule,
                        loss_fn=mse) as pipe:
        if not fresh:
            pipe.value_and_grad(x, x)
            pipe(x)
            flag["drop"] = True
        torch.manual_seed(1)
        return pipe.value_and_grad(x, x)


def assert_same(a, b):
    for u, v in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert torch.equal(u, v)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zero_bubble])
def test_a_stage_that_starts_drawing_gets_one_mask_under_every_remat_policy(make):
    """The issue's reproduction: before, the two policies differed by 0.26 in the gradients."""
    never = step_after_switch(make(chunks=4, remat="never"), fresh=False)
    always = step_after_switch(make(chunks=4, remat="always"), fresh=False)
    assert_same(never, always)
    # ... and exactly the step of a pipeline that drew from its first call on.
    assert_same(always, step_after_switch(make(chunks=4, remat="always"), fresh=True))


def test_dropout_really_drops_after_the_switch():
    on = step_after_switch(gpipe(chunks=4), fresh=False)
    flag = {"drop": False}
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with fpipe.pipeline([switchable(flag)] * 2, mlp_params(2), schedule=gpipe(chunks=4),
                        loss_fn=mse) as pipe:
        off = pipe.value_and_grad(x, x)
    assert not torch.equal(on[0], off[0])


def test_a_branch_that_draws_on_one_micro_batch_only_is_reproduced():
    """The draw happens on micro-batch 0 of the second step only: its forward runs watched
    (the stage was seen not to draw), is caught, and the step runs again seeded."""
    calls = {"n": 0}

    def sometimes(p, x):
        y = block(p, x)
        if x.shape[0] == 3 and calls["n"] >= 1:  # micro-batch 0, from the second step on
            y = y * torch.rand_like(y)
        return y

    x = torch.randn(9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    results = []
    for remat in ("never", "always"):
        calls["n"] = 0
        with fpipe.pipeline([block, sometimes], mlp_params(2),
                            schedule=one_f_one_b(chunks=4, remat=remat), loss_fn=mse) as pipe:
            pipe.value_and_grad(x, x)
            calls["n"] = 1
            torch.manual_seed(7)
            results.append(pipe.value_and_grad(x, x))
    assert_same(*results)


def test_the_retry_leaves_the_callers_generator_as_one_step_would():
    flag = {"drop": False}
    x = torch.randn(8, 8, dtype=torch.float64)
    with fpipe.pipeline([switchable(flag)] * 2, mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=mse) as pipe:
        pipe.value_and_grad(x, x)
        flag["drop"] = True
        torch.manual_seed(0)
        pipe.value_and_grad(x, x)  # caught and run again
        after_retry = torch.rand(3)
        torch.manual_seed(0)
        pipe.value_and_grad(x, x)  # seeded from the start now
        after_plain = torch.rand(3)
    assert torch.equal(after_retry, after_plain)


def test_a_recompute_that_draws_when_its_forward_did_not_is_an_error():
    """The module face runs forwards and recomputes in two calls: a stage that starts drawing
    between them cannot be reproduced, and says so instead of giving wrong gradients."""
    flag = {"drop": False}

    class Switch(torch.nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, training=True) if flag["drop"] else x

    model = fpipe.GPipe(torch.nn.Sequential(torch.nn.Linear(4, 4), Switch(),
                                            torch.nn.Linear(4, 4)),
                        balance=[2, 1], chunks=2, checkpoint="always")
    y = model(torch.randn(4, 4))
    flag["drop"] = True
    with pytest.raises(fpipe.StageError, match="recompute cannot reproduce the forward"):
        y.sum().backward()
    flag["drop"] = False
    model(torch.randn(4, 4)).sum().backward()  # and the pipeline stays usable


def test_stages_that_never_draw_leave_no_trace_in_the_generator():
    x = torch.randn(6, 8, dtype=torch.float64)
    with fpipe.pipeline([block] * 3, mlp_params(3), schedule=gpipe(chunks=3),
                        loss_fn=mse) as pipe:
        for _ in range(3):
            torch.manual_seed(4)
            pipe.value_and_grad(x, x)
            after = torch.rand(2)
            torch.manual_seed(4)
            torch.empty((), dtype=torch.int64).random_()  # the step's one draw: its seed
            assert torch.equal(after, torch.rand(2))
