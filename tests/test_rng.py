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
from models import TIGHT, assert_trees_close, block, mlp_params, mse

import fpipe
from fpipe.schedules import Op, gpipe, one_f_one_b, zero_bubble


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


# --- Masks against a reference outside fpipe ------------------------------------------------
# Comparing a pipeline with another pipeline cannot see a mask shared by every micro-batch (both
# share it). Here each stage records the mask it drew, per sample and per call, and the test
# checks the masks themselves and the gradients against plain autograd fed those masks.


def recording_stage(record):
    """A dropout block that records ``(recomputing, sample ids) -> keep mask``; the ids travel
    with the activations as an integer tensor, so each call names its samples."""
    def stage(p, x):
        h = torch.tanh(x["h"] @ p["w"] + p["b"])
        keep = torch.rand(h.shape, dtype=h.dtype) < 0.5  # a plain tensor, drawn by the stage
        # A retried step (fpipe._runtime.rng) overwrites its first attempt's entries.
        record[fpipe.is_recomputing(), tuple(x["ids"].tolist())] = keep.clone()
        return {"h": h * keep / 0.5, "ids": x["ids"]}
    return stage


def masked_reference(params, x, target, masks):
    """Loss and gradients of the whole batch in plain autograd, each stage dropping with the
    whole-batch mask ``masks[s]`` (rows in sample order)."""
    leaves = [{k: v.detach().clone().requires_grad_() for k, v in p.items()} for p in params]
    h = x
    for p, keep in zip(leaves, masks):
        h = torch.tanh(h @ p["w"] + p["b"]) * keep / 0.5
    loss = mse(h, target)
    loss.backward()
    return loss.detach(), [{k: v.grad for k, v in p.items()} for p in leaves]


@pytest.mark.parametrize("schedule", [gpipe(4, remat="always"), gpipe(4, remat="except_last"),
                                      one_f_one_b(4, remat="always"),
                                      zero_bubble(4, remat="always")])
def test_masks_differ_between_micro_batches_and_recomputes_redraw_them(schedule):
    n_stages, n = 3, 8
    records = [{} for _ in range(n_stages)]
    params = mlp_params(n_stages)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, dtype=torch.float64, generator=gen)
    target = torch.randn(n, 8, dtype=torch.float64, generator=gen)
    batch = {"h": x, "ids": torch.arange(n)}
    with fpipe.pipeline([recording_stage(r) for r in records], params, schedule=schedule,
                        loss_fn=lambda y, t: mse(y["h"], t)) as pipe:
        torch.manual_seed(0)
        loss, grads = pipe.value_and_grad(batch, target)
    program = schedule.program(n_stages)
    recomputed = {(a.stage, a.microbatch) for w in program.workers for a in w
                  if a.op is Op.RECOMPUTE}
    micro_ids = [tuple(ids.tolist()) for ids in torch.arange(n).tensor_split(4)]
    masks = []
    for s, record in enumerate(records):
        forwards = [record[False, ids] for ids in micro_ids]
        # Every micro-batch draws its own mask (not one mask for the whole step).
        for i in range(len(forwards)):
            for j in range(i):
                assert not torch.equal(forwards[i], forwards[j]), (s, i, j)
        # Each recompute drew exactly its forward's mask.
        for m, ids in enumerate(micro_ids):
            if (s, m) in recomputed:
                assert torch.equal(record[True, ids], forwards[m]), (s, m)
            else:
                assert (True, ids) not in record
        masks.append(torch.cat(forwards))
    assert 0.3 < torch.stack(masks).double().mean() < 0.7  # the masks really drop
    # The gradients are those of the recorded forward masks: a recompute that drew another
    # mask would give the gradients of a model the forward never ran.
    expected_loss, expected_grads = masked_reference(params, x, target, masks)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)
