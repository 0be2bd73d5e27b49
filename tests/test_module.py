"""fpipe.GPipe: torchgpipe's nn.Module face fills .grad exactly as the plain module would."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpipe


def model(seed=0, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    layers += [nn.Tanh(), nn.Linear(8, 4)]
    return nn.Sequential(*layers).double()


def test_torchgpipe_usage_runs_as_written():
    a, b, c, d = nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5), nn.Linear(5, 3)
    input = torch.randn(16, 5)

    from fpipe import GPipe
    model = nn.Sequential(a, b, c, d)
    model = GPipe(model, balance=[1, 1, 1, 1], chunks=8)
    output = model(input)

    target = torch.randint(0, 3, (16,)).to(model.devices[-1])
    loss = F.cross_entropy(output, target)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("balance", [[1, 1, 1, 2], [3, 2], [5]])
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_grads_equal_the_plain_module(balance, chunks, checkpoint):
    plain = model()
    piped = fpipe.GPipe(copy.deepcopy(plain), balance, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    target = torch.randn(10, 4, dtype=torch.float64)

    F.mse_loss(plain(x_plain), target).backward()
    output = piped(x)
    F.mse_loss(output, target).backward()

    torch.testing.assert_close(output, plain(x_plain))
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-10, atol=1e-12)


def test_grads_accumulate_over_two_backwards():
    plain, piped = model(), fpipe.GPipe(model(), [2, 3], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64)
    for _ in range(2):
        plain(x).sum().backward()
        piped(x).sum().backward()
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_eval_recomputes_nothing_and_keeps_a_graph_only_under_grad():
    recomputes = []

    class Watch(nn.Module):
        def forward(self, x):
            recomputes.append(fpipe.is_recomputing())
            return x

    piped = fpipe.GPipe(nn.Sequential(nn.Linear(3, 3), Watch(), nn.Linear(3, 3)), [2, 1],
                        chunks=2, checkpoint="always")
    x = torch.randn(4, 3)
    piped(x).sum().backward()
    assert recomputes.count(True) == 2  # training: both micro-batches recomputed
    recomputes.clear()
    piped.eval()
    y = piped(x)  # as torchgpipe: eval under grad keeps a graph, without checkpoints
    y.sum().backward()
    assert recomputes == [False, False] and y.requires_grad
    with torch.no_grad():
        assert not piped(x).requires_grad
        piped.train()(x)
    assert recomputes == [False] * 6


def test_batchnorm_statistics_follow_the_module():
    plain = model(batchnorm=True)
    piped = fpipe.GPipe(copy.deepcopy(plain), [3, 3], chunks=1)
    x = torch.randn(8, 6, dtype=torch.float64)
    plain(x).sum().backward()
    piped(x).sum().backward()
    torch.testing.assert_close(piped[3].running_mean, plain[3].running_mean)
    torch.testing.assert_close(piped[3].running_var, plain[3].running_var)
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_deferred_batch_norm_updates_once_per_minibatch():
    plain = model(batchnorm=True)
    piped = fpipe.GPipe(copy.deepcopy(plain), [3, 3], chunks=4, deferred_batch_norm=True)
    assert isinstance(piped[3], fpipe.stages.DeferredBatchNorm)
    x = torch.randn(8, 6, dtype=torch.float64)
    piped(x).sum().backward()
    plain(x)
    torch.testing.assert_close(piped[3].running_mean, plain[3].running_mean)
    torch.testing.assert_close(piped[3].running_var, plain[3].running_var)
    assert int(piped[3].num_batches_tracked) == 1


def test_attributes_and_refusals():
    piped = fpipe.GPipe(model(), [2, 3], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    assert piped.balance == [2, 3] and piped.chunks == 4 and piped.checkpoint == "never"
    assert piped.devices == [torch.device("cpu")] * 2
    assert len(piped.partitions) == 2 and len(piped) == 5
    assert isinstance(piped[0], nn.Linear)
    for move in (lambda: piped.to("cpu"), piped.cpu, piped.cuda):
        with pytest.raises(TypeError, match="moving the whole module is refused"):
            move()
    assert piped.to(torch.float32) is piped  # a dtype alone is fine
    with pytest.raises(ValueError, match="sums to 4 layers but the module has 5"):
        fpipe.GPipe(model(), [2, 2])
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        fpipe.GPipe(model(), [5], checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        fpipe.GPipe(model(), [5], chunks=0)
    with pytest.raises(IndexError, match="too few devices for 2 partitions: got 1"):
        fpipe.GPipe(model(), [2, 3], devices=["cpu"])


def test_dropout_is_reproduced_by_the_recompute():
    def grads_with(checkpoint, seed=1):
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 16),
                               nn.Dropout(0.5), nn.Linear(16, 2)).double()
        piped = fpipe.GPipe(layers, [2, 3], chunks=3, checkpoint=checkpoint)
        torch.manual_seed(seed)
        piped(torch.ones(6, 6, dtype=torch.float64)).sum().backward()
        return [p.grad for p in piped.parameters()]

    never, always = grads_with("never"), grads_with("always")
    for a, b in zip(never, always):
        assert torch.equal(a, b)
    assert not torch.equal(never[0], grads_with("never", seed=2)[0])  # dropout is active
