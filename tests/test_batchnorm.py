"""DeferredBatchNorm: a pipelined step leaves the running statistics of a whole-batch pass."""

from __future__ import annotations

import copy

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


def two_steps(schedule):
    """Two training steps of the split model on 10 samples (uneven: 3, 3, 2, 2 in 4 chunks),
    the state threaded through: what the tests below hold to their references."""
    parts, params, state = split_model(schedule.chunks)
    x = torch.randn(10, 3, 5, 5, dtype=torch.float64)
    target = torch.randn(10, 6, dtype=torch.float64)
    with fpipe.pipeline([stage_of(p) for p in parts], params, state=state, schedule=schedule,
                        loss_fn=mse) as pipe:
        loss, grads, new_state = pipe.value_and_grad(x, target)
        _, _, second = pipe.value_and_grad(x, target, state=new_state)
    return parts, params, x, target, loss, grads, new_state, second


@pytest.mark.parametrize("schedule", [gpipe(chunks=4, remat="always"), gpipe(chunks=3),
                                      one_f_one_b(chunks=4)])
def test_running_stats_equal_a_whole_batch_pass(schedule):
    chunks = schedule.chunks
    parts, params, x, target, loss, grads, new_state, second = two_steps(schedule)

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


def by_hand(params, x, target, chunks, steps=1, eps=1e-5, momentum=0.1):
    """``split_model`` written out: each BatchNorm normalises a micro-batch by that
    micro-batch's own statistics (biased variance), the loss is the size-weighted sum of the
    micro-batches' losses, and the running statistics move once per step, by the whole batch's
    mean and unbiased variance of that layer's inputs. Returns (loss, grads, running stats)."""
    leaves = [{k: v.detach().clone().requires_grad_() for k, v in p.items()} for p in params]
    p0, p1 = leaves

    def normalise(h, weight, bias, dims):
        shape = (1, -1) + (1,) * (h.dim() - 2)
        mean = h.mean(dims, keepdim=True)
        var = ((h - mean) ** 2).mean(dims, keepdim=True)
        return (h - mean) / torch.sqrt(var + eps) * weight.view(shape) + bias.view(shape)

    loss, seen = 0.0, ([], [])
    for xm, tm in zip(x.tensor_split(chunks), target.tensor_split(chunks)):
        h = torch.nn.functional.conv2d(xm, p0["0.weight"], p0["0.bias"], padding=1)
        seen[0].append(h.detach())
        h = torch.relu(normalise(h, p0["1.weight"], p0["1.bias"], (0, 2, 3)))
        h = h.flatten(1) @ p1["1.weight"].T + p1["1.bias"]
        seen[1].append(h.detach())
        y = normalise(h, p1["2.weight"], p1["2.bias"], (0,))
        loss = loss + mse(y, tm) * xm.shape[0] / x.shape[0]
    loss.backward()
    stats = []
    for inputs, dims in zip(seen, ((0, 2, 3), (0,))):
        h = torch.cat(inputs)
        count = h.numel() // h.shape[1]
        mean = h.mean(dims)
        var = ((h - mean.view((1, -1) + (1,) * (h.dim() - 2))) ** 2).sum(dims) / (count - 1)
        running_mean, running_var = torch.zeros_like(mean), torch.ones_like(var)
        for _ in range(steps):
            running_mean = (1 - momentum) * running_mean + momentum * mean
            running_var = (1 - momentum) * running_var + momentum * var
        stats.append((running_mean, running_var))
    return loss.detach(), [{k: v.grad for k, v in p.items()} for p in leaves], stats


@pytest.mark.parametrize("schedule", [gpipe(chunks=4, remat="always"), one_f_one_b(chunks=4)])
def test_gradients_and_statistics_match_a_hand_written_computation(schedule):
    """Loss and gradients of per-micro-batch normalisation, running statistics of the whole
    batch: against the computation written out in plain autograd, not against fpipe."""
    chunks = schedule.chunks
    parts, params, x, target, loss, grads, new_state, second = two_steps(schedule)
    for got, steps in ((new_state, 1), (second, 2)):
        expected_loss, expected_grads, stats = by_hand(params, x, target, chunks, steps)
        if steps == 1:
            torch.testing.assert_close(loss, expected_loss)
            for a, e in zip(optree.tree_leaves(grads), optree.tree_leaves(expected_grads)):
                torch.testing.assert_close(a, e)
        for s, layer in enumerate(("1", "2")):
            torch.testing.assert_close(got[s][f"{layer}.running_mean"], stats[s][0])
            torch.testing.assert_close(got[s][f"{layer}.running_var"], stats[s][1])


def test_eval_uses_running_stats_and_changes_nothing():
    bn = DeferredBatchNorm(4, chunks=2).double().eval()
    bn.running_mean.fill_(1.0)
    x = torch.randn(5, 4, dtype=torch.float64)
    y = bn(x)
    torch.testing.assert_close(y, (x - 1.0) / torch.sqrt(torch.tensor(1 + 1e-5,
                                                                       dtype=torch.float64)))
    assert int(bn.tracked) == 0


def test_convert_swaps_in_place_keeping_the_very_tensors():
    """As torchgpipe's: the given module is converted, and the new layer holds the old one's
    parameters and buffers themselves, so an optimiser made before still trains them."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.BatchNorm1d(3)))
    old = model[1][0]
    converted = DeferredBatchNorm.convert(model, chunks=4)
    assert converted is model
    new = model[1][0]
    assert isinstance(new, DeferredBatchNorm) and new.chunks == 4
    for name, tensor in (*old.named_parameters(), *old.named_buffers()):
        assert getattr(new, name) is tensor, name
    assert DeferredBatchNorm.convert(model, chunks=4)[1][0] is new  # already converted
    again = DeferredBatchNorm.convert(model, chunks=2)[1][0]
    assert again is not new and again.chunks == 2 and again.weight is old.weight
    untracked = nn.BatchNorm1d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert(untracked, chunks=4) is untracked
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        DeferredBatchNorm(3, chunks=0)


def test_convert_keeps_the_count_momentum_none_averages_by():
    """With ``momentum=None`` the running statistics are a cumulative average over
    ``num_batches_tracked`` mini-batches; a conversion that restarted the count would weigh
    the next mini-batch as if it were the first."""
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(3, momentum=None).double()
    for _ in range(3):
        plain(torch.randn(8, 3, dtype=torch.float64) * 2 + 1)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain), chunks=2)
    assert int(deferred.num_batches_tracked) == 3
    x = torch.randn(8, 3, dtype=torch.float64)
    plain(x)
    for xm in x.chunk(2):
        deferred(xm)
    torch.testing.assert_close(deferred.running_mean, plain.running_mean)
    torch.testing.assert_close(deferred.running_var, plain.running_var)
