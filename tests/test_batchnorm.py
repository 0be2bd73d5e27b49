"""DeferredBatchNorm: a pipelined step leaves the running statistics of a whole-batch pass."""

from __future__ import annotations

import optree
import pytest
import torch
from torch import nn
from torch.func import functional_call

import fpipe
from fpipe.schedules import gpipe, one_f_one_b
from fpipe.stages import DeferredBatchNorm


def stage_of(module):
    def stage(p, state, x):
        new = {k: v.clone() for k, v in state.items()}
        return functional_call(module, (p, new), (x,)), new
    return stage


def split_model(chunks, deferred=True):
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
             nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6))]
    parts = [p.double() for p in parts]
    if deferred:
        parts = [DeferredBatchNorm.convert(p, chunks) for p in parts]
    params = [{k: v.detach() for k, v in p.named_parameters()} for p in parts]
    state = [{k: v.detach().clone() for k, v in p.named_buffers()} for p in parts]
    return parts, params, state


def mse(y, t):
    return ((y - t) ** 2).mean()


@pytest.mark.parametrize("schedule", [gpipe(chunks=4, remat="always"), gpipe(chunks=3),
                                      one_f_one_b(chunks=4)])
def test_running_stats_equal_a_whole_batch_pass(schedule):
    chunks = schedule.chunks
    parts, params, state = split_model(chunks)
    x = torch.randn(10, 3, 5, 5, dtype=torch.float64)
    target = torch.randn(10, 6, dtype=torch.float64)
    with fpipe.pipeline([stage_of(p) for p in parts], params, state=state, schedule=schedule,
                        loss_fn=mse) as pipe:
        loss, grads, new_state = pipe.value_and_grad(x, target)
        _, _, second = pipe.value_and_grad(x, target, state=new_state)

    for got, steps in ((new_state, 1), (second, 2)):
        for s, stats in enumerate(reference_stats(x, chunks, steps)):
            for name, value in stats.items():
                torch.testing.assert_close(got[s][name], value)
        for s, layer in enumerate(("1", "2")):
            assert int(got[s][f"{layer}.num_batches_tracked"]) == steps
            assert int(got[s][f"{layer}.tracked"]) == 0


def reference_stats(x, chunks, steps):
    """Each BatchNorm fed, once per step, the whole batch of the inputs it sees in the pipeline
    (there the layers before it normalise per micro-batch)."""
    per_microbatch = split_model(chunks, deferred=False)[0]
    whole_batch = split_model(chunks, deferred=False)[0]
    h = x
    for s in range(2):
        for _ in range(steps):
            whole_batch[s](h)
        h = torch.cat([per_microbatch[s](xm) for xm in h.tensor_split(chunks)])
    return [{k: v for k, v in m.state_dict().items() if "running" in k} for m in whole_batch]


def test_gradients_are_those_of_per_microbatch_batchnorm():
    chunks = 3
    parts, params, state = split_model(chunks)
    plain_parts, _, plain_state = split_model(chunks, deferred=False)
    x = torch.randn(9, 3, 5, 5, dtype=torch.float64)
    target = torch.randn(9, 6, dtype=torch.float64)
    results = []
    for modules, buffers in ((parts, state), (plain_parts, plain_state)):
        with fpipe.pipeline([stage_of(p) for p in modules], params, state=buffers,
                            schedule=gpipe(chunks=chunks), loss_fn=mse) as pipe:
            results.append(pipe.value_and_grad(x, target))
    (loss_d, grads_d, _), (loss_p, grads_p, _) = results
    torch.testing.assert_close(loss_d, loss_p)
    for a, b in zip(optree.tree_leaves(grads_d), optree.tree_leaves(grads_p)):
        torch.testing.assert_close(a, b)


def test_eval_uses_running_stats_and_changes_nothing():
    bn = DeferredBatchNorm(4, chunks=2).double().eval()
    bn.running_mean.fill_(1.0)
    x = torch.randn(5, 4, dtype=torch.float64)
    y = bn(x)
    torch.testing.assert_close(y, (x - 1.0) / torch.sqrt(torch.tensor(1 + 1e-5,
                                                                       dtype=torch.float64)))
    assert int(bn.tracked) == 0


def test_convert_leaves_the_original_alone():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    converted = DeferredBatchNorm.convert(model, chunks=4)
    assert isinstance(converted[1], DeferredBatchNorm) and converted[1].chunks == 4
    assert type(model[1]) is nn.BatchNorm1d
    assert converted[0].weight is model[0].weight
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        DeferredBatchNorm(3, chunks=0)
