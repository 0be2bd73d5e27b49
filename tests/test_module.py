"""fpipe.GPipe: torchgpipe's nn.Module face fills .grad exactly as the plain module would."""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path

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


def _replace_weight(m: nn.Sequential) -> None:
    m[0].weight = nn.Parameter(torch.randn_like(m[0].weight))


def _drop_bias(m: nn.Sequential) -> None:
    m[0].bias = None


def _tie(m: nn.Sequential) -> None:
    m[2].bias = m[0].bias


def _new_buffer(m: nn.Sequential) -> None:
    m[0].register_buffer("seen", torch.zeros(1, dtype=torch.float64))


def _bias_given(m: nn.Sequential) -> None:
    m[0].bias = nn.Parameter(torch.randn(8, dtype=torch.float64))


@pytest.mark.parametrize("prepare, change", [(None, _replace_weight), (None, _drop_bias),
                                             (None, _tie), (None, _new_buffer),
                                             (_drop_bias, _bias_given)])
def test_a_model_changed_between_calls_trains_as_the_plain_changed_model(prepare, change):
    """The face reads each partition's tensors from where they live, not by walking the
    partitions at every call; a model changed after a call (a weight replaced, a bias set to
    None, two weights tied, a buffer registered, a bias registered as None given a tensor:
    each module's count of names unchanged, so the structure check must see the None go)
    trains as the plain model does after the same change: the same output, the same
    gradients on the tensors the model now holds."""
    x = torch.randn(6, 6, dtype=torch.float64)
    layers = model()
    if prepare is not None:
        prepare(layers)
    piped = fpipe.GPipe(layers, [3, 2], chunks=2)
    piped(x).sum().backward()
    piped.zero_grad(set_to_none=True)
    change(piped.partitions[0])
    plain = nn.Sequential(*copy.deepcopy(list(piped)))
    out, expected = piped(x), plain(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(piped.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


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


class Boom(Exception):
    pass


class Counter(nn.Module):
    def __init__(self, seen, fail=False, sleep=0.0):
        super().__init__()
        self.seen, self.fail, self.sleep = seen, fail, sleep

    def forward(self, x):
        time.sleep(self.sleep)
        self.seen.append(x.shape[0])
        if self.fail:
            raise Boom("failed")
        return x


def test_partitions_on_one_device_stop_where_torchgpipe_stops():
    """Forwards in torchgpipe's clock order: the counter before the failing partition has run
    two micro-batches when the third partition fails on the first, and runs no more."""
    seen, failed = [], []
    model = fpipe.GPipe(nn.Sequential(nn.Identity(), Counter(seen), Counter(failed, fail=True)),
                        [1, 1, 1], chunks=3)
    with pytest.raises(Boom):
        model(torch.rand(3, 1))
    assert seen == [1, 1] and failed == [1]


def test_workers_start_nothing_once_a_step_failed():
    """On several workers (devices), a failure stops the others at their next action."""
    seen = []
    stages = [lambda p, x: Counter(seen, sleep=0.05)(x),
              lambda p, x: Counter([], fail=True)(x)]
    with fpipe.pipeline(stages, [{}, {}], schedule=fpipe.gpipe(chunks=6)) as pipe:
        with pytest.raises(Boom):
            pipe(torch.rand(6, 1))
    assert len(seen) <= 3


def flags(checkpoint, batch, training=True, grad=True, chunks=2):
    """(micro-batch size, is_checkpointing, is_recomputing) at each call of a layer, forwards
    then backward."""
    calls = []

    class Watch(nn.Module):
        def forward(self, x):
            calls.append((x.shape[0], fpipe.is_checkpointing(), fpipe.is_recomputing()))
            return x

    model = fpipe.GPipe(nn.Sequential(nn.Linear(2, 2), Watch()), [1, 1], chunks=chunks,
                        checkpoint=checkpoint).train(training)
    with torch.set_grad_enabled(grad):
        y = model(torch.randn(batch, 2))
    if y.requires_grad:
        y.sum().backward()
    return calls


@pytest.mark.parametrize("checkpoint, batch, training, grad, expected", [
    ("always", 4, True, True, [(2, True, False)] * 2 + [(2, False, True)] * 2),
    ("except_last", 4, True, True, [(2, True, False), (2, False, False), (2, False, True)]),
    ("never", 4, True, True, [(2, False, False)] * 2),
    # Under no_grad nothing is recomputed, so no forward is checkpointing (torchgpipe's says
    # it is for the micro-batches it would checkpoint; see test_torchgpipe_compat).
    ("except_last", 4, True, False, [(2, False, False), (2, False, False)]),
    ("always", 4, False, True, [(2, False, False)] * 2),  # eval: no checkpoints
    ("always", 4, False, False, [(2, False, False)] * 2),
    # One micro-batch of a batch smaller than chunks: torchgpipe checkpoints it.
    ("except_last", 1, True, True, [(1, True, False), (1, False, True)]),
    ("except_last", 5, True, True, [(3, True, False), (2, False, False), (3, False, True)]),
])
def test_checkpointing_and_recomputing_flags(checkpoint, batch, training, grad, expected):
    assert flags(checkpoint, batch, training, grad) == expected
    assert not fpipe.is_checkpointing() and not fpipe.is_recomputing()


def test_tuples_in_and_out_and_batches_torch_chunk_cuts_short():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, pair):
            h, ids = pair
            return torch.tanh(self.linear(h)) + ids[:, None], ids

    class First(nn.Module):
        def forward(self, pair):
            return (pair[0] * 2,)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Pair(), Pair(), First()).double()

    plain, piped = build(), fpipe.GPipe(build(), [1, 2], chunks=4)
    for n in (8, 3, 6):  # 3 and 6 samples in 4 chunks: 3 micro-batches, as torch.chunk cuts
        h, ids = torch.randn(n, 3, dtype=torch.float64), torch.arange(n)
        x, x_plain = h.clone().requires_grad_(), h.clone().requires_grad_()
        y, y_plain = piped((x, ids)), plain((x_plain, ids))
        assert isinstance(y, tuple) and len(y) == 1
        torch.testing.assert_close(y[0], y_plain[0])
        y[0].sum().backward()
        y_plain[0].sum().backward()
        torch.testing.assert_close(x.grad, x_plain.grad)
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    with pytest.raises(TypeError, match="GPipe takes a tensor or a tuple of tensors, got a list"):
        piped([h])
    with pytest.raises(TypeError, match="tuple of tensors, got an empty tuple"):
        piped(())
    with pytest.raises(TypeError, match="partition 0 returned a list: a partition's output"):
        fpipe.GPipe(nn.Sequential(Returns(list), nn.Identity()), [1, 1])(h)


class Returns(nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.wrap = wrap

    def forward(self, x):
        return self.wrap([x])


def test_an_empty_sequential_is_the_identity():
    model = fpipe.GPipe(nn.Sequential(), [])
    x = torch.randn(2, 2)
    assert model(x) is x and model.devices == [] and len(model) == 0


def test_constructor_arguments_as_torchgpipe_takes_them():
    class Mode:
        def __str__(self):
            return "never"

    piped = fpipe.GPipe(model(), (2, 3), chunks=42.0, checkpoint=Mode())
    assert piped.chunks == 42 and type(piped.chunks) is int and piped.checkpoint == "never"
    assert piped.balance == [2, 3] and type(piped.balance) is list
    with pytest.raises(ValueError, match="balance is required.*balance_by_time.*balance_by_size"):
        fpipe.GPipe(model())
    with pytest.raises(ValueError, match="chunks must be a whole number, got 2.5"):
        fpipe.GPipe(model(), [5], chunks=2.5)
    with pytest.raises(TypeError, match="chunks must be a positive integer, got None"):
        fpipe.GPipe(model(), [5], chunks=None)
    with pytest.raises(ValueError, match=r"balance\[0\] is 0: every partition needs"):
        fpipe.GPipe(model(), [0, 5])
    layer = nn.Linear(6, 6)
    with pytest.raises(ValueError, match="the module holds the same layer twice"):
        fpipe.GPipe(nn.Sequential(layer, layer), [1, 1])
    with pytest.raises(TypeError, match="moving the whole module is refused"):
        fpipe.GPipe(model(), [5]).to(0)  # before torch would look for CUDA


def test_the_documented_torchgpipe_face_runs():
    page = "docs/gpipe-face.md"  # the torchgpipe face in detail (README's section until issue 27)
    text = (Path(__file__).resolve().parent.parent / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, page, "exec"), namespace)
    assert all(p.grad is not None for p in namespace["model"].parameters())
