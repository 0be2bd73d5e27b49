"""A model trained from an ``nn.Module`` trains as plain PyTorch trains it, on the user's own
idioms: buffers updated or reassigned in forward, weights reached through plain references,
ties, gradient hooks and late freezing. Each case is compared in float64 with plain PyTorch
on the same micro-batches (a loop over ``torch.chunk``), in every checkpoint/remat mode, or
refused with a reason."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import fpipe
from fpipe.errors import StageError
from fpipe.schedules import gpipe, one_f_one_b
from fpipe.stages import from_modules, from_sequential, load_into
from tests.models import TiedEmbed, TiedHead

TIGHT = dict(rtol=1e-12, atol=1e-12)
CHECKPOINTS = ["always", "except_last", "never"]


class EMA(nn.Module):
    """Scales by a running average of its input, which it updates in place in training."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("avg", torch.full((width,), 0.5))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.8).add_(x.mean(0), alpha=0.2)
        return x * torch.tanh(self.avg)


class Counter(nn.Module):
    """Reassigns its buffer in forward (``self.steps = self.steps + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps = self.steps + 1
        return x * (1 + 0.1 * self.steps)


class Nested(nn.Module):
    """A layer whose submodule reassigns its buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.inner = nn.Sequential(Counter())

    def forward(self, x):
        return self.inner(self.linear(x))


def ema_model():
    return nn.Sequential(nn.Linear(4, 6), EMA(6), nn.Tanh(), nn.Linear(6, 3))


def spectral_model():
    return nn.Sequential(parametrizations.spectral_norm(nn.Linear(4, 6)), nn.Tanh(),
                         nn.Linear(6, 3))


def old_spectral_model():
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))


def counter_model():
    return nn.Sequential(nn.Linear(4, 4), Nested(4), nn.Tanh(), nn.Linear(4, 3))


MODELS = {"ema": ema_model, "spectral_norm": spectral_model,
          "old_spectral_norm": old_spectral_model, "reassigned": counter_model}


def build(make, seed=0):
    torch.manual_seed(seed)
    return make().double()


def batches(steps=3, n=8):
    torch.manual_seed(1)
    return [(torch.randn(n, 4, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64))
            for _ in range(steps)]


def plain_steps(model, data, chunks, lr=0.1):
    """Plain PyTorch on the pipeline's micro-batches: a forward per micro-batch (buffers
    updated in order), the whole batch's loss, one SGD step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    outputs = []
    for x, target in data:
        optimizer.zero_grad()
        y = torch.cat([model(c) for c in x.chunk(chunks)])
        F.mse_loss(y, target).backward()
        optimizer.step()
        outputs.append(y.detach())
    return outputs


def assert_same_model(actual: nn.Module, expected: nn.Module):
    got = dict(actual.named_parameters()) | dict(actual.named_buffers())
    want = dict(expected.named_parameters()) | dict(expected.named_buffers())
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **TIGHT, msg=name)


# -- buffers: a recompute sees its forward's, a reassignment is kept ---------------------------

@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gpipe_trains_buffer_updating_layers_as_plain_pytorch(name, checkpoint):
    plain, data = build(MODELS[name]), batches()
    piped = fpipe.GPipe(copy.deepcopy(plain), balance=[2, 2] if len(plain) == 4 else [1, 2],
                        chunks=4, checkpoint=checkpoint)
    expected = plain_steps(plain, data, chunks=4)
    optimizer = torch.optim.SGD(piped.parameters(), lr=0.1)
    for (x, target), want in zip(data, expected):
        optimizer.zero_grad()
        y = piped(x)
        F.mse_loss(y, target).backward()
        optimizer.step()
        torch.testing.assert_close(y.detach(), want, **TIGHT)
    assert_same_model(nn.Sequential(*piped), plain)
    if name == "reassigned":
        assert float(piped[1].inner[0].steps) == 12  # 4 micro-batches x 3 steps


@pytest.mark.parametrize("remat", ["always", "except_last", "never"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_sequential_trains_buffer_updating_layers_as_plain_pytorch(name, remat):
    plain, data = build(MODELS[name]), batches()
    model = copy.deepcopy(plain)
    s = from_sequential(model, [2, 2] if len(model) == 4 else [1, 2])
    plain_steps(plain, data, chunks=4)
    optimizer = torch.optim.SGD(optree.tree_leaves(s.params), lr=0.1)
    state = s.state
    with fpipe.pipeline(s, schedule=gpipe(chunks=4, remat=remat), loss_fn=F.mse_loss) as pipe:
        for x, target in data:
            _, grads, state = pipe.value_and_grad(x, target, state=state)
            fpipe.optim.bind_grads(s.params, grads)
            optimizer.step()
    load_into(model, s.params, state)
    assert_same_model(model, plain)


def test_a_reassigned_buffer_comes_back_from_the_stage_nested_or_not():
    model = counter_model().double()
    s = from_sequential(model, [2, 2])
    assert s.state[0] == {"1.inner.0.steps": torch.zeros((), dtype=torch.float64)}
    with fpipe.pipeline(s, schedule=one_f_one_b(chunks=2), loss_fn=F.mse_loss) as pipe:
        _, state = pipe(torch.randn(4, 4, dtype=torch.float64))
    assert float(state[0]["1.inner.0.steps"]) == 2
    assert float(s.state[0]["1.inner.0.steps"]) == 0  # the caller's state is not written


# -- weights the stage reaches without holding them -----------------------------------------

class ListHead(nn.Module):
    """An output layer reusing another layer's weight through a plain list (unregistered)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self.refs = [source]

    def forward(self, h):
        return h @ self.refs[0].weight


def list_head_model():
    first = nn.Linear(4, 4)
    return nn.Sequential(first, nn.Tanh(), ListHead(first)).double()


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_gpipe_refuses_a_weight_reached_through_a_plain_list(checkpoint):
    piped = fpipe.GPipe(list_head_model(), balance=[1, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(StageError, match=r"not among its parameters or inputs: "
                                         r"Parameter\(4, 4\) float64, the model's partition 0's "
                                         r"'0.weight'.*Register it") as caught:
        piped(x).sum().backward()
    assert caught.value.stage == 1


def test_from_sequential_refuses_a_weight_reached_through_a_plain_list():
    s = from_sequential(list_head_model(), [1, 2], stateful=False)
    with fpipe.pipeline(s, schedule=gpipe(chunks=2), loss_fn=F.mse_loss) as pipe:
        with pytest.raises(StageError, match=r"the model's stage 0's '0.weight'") as caught:
            pipe.value_and_grad(torch.randn(4, 4, dtype=torch.float64),
                                torch.randn(4, 4, dtype=torch.float64))
    assert caught.value.stage == 1


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
def test_a_stage_closing_over_a_tensor_that_requires_grad_is_refused(autodiff):
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    stages = [lambda p, x: torch.tanh(x @ p["w"]), lambda p, x: x @ w]  # w: not given
    params = [{"w": torch.randn(4, 4, dtype=torch.float64)}, {}]
    with fpipe.pipeline(stages, params, schedule=gpipe(chunks=2), loss_fn=F.mse_loss,
                        autodiff=autodiff) as pipe:
        x = torch.randn(4, 4, dtype=torch.float64)
        pipe(x)  # a forward alone differentiates nothing: fine
        with pytest.raises(StageError, match=r"Tensor\(4, 4\) float64\. Its gradient would be "
                                             r"lost"):
            pipe.value_and_grad(x, torch.randn(4, 4, dtype=torch.float64))
        w.requires_grad_(False)  # a constant: fine
        pipe.value_and_grad(x, torch.randn(4, 4, dtype=torch.float64))


def test_an_input_that_requires_grad_is_given_not_refused():
    stages = [lambda p, x: torch.tanh(x @ p["w"])] * 2
    params = [{"w": torch.randn(4, 4, dtype=torch.float64)} for _ in range(2)]
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    with fpipe.pipeline(stages, params, schedule=gpipe(chunks=2), loss_fn=F.mse_loss) as pipe:
        pipe.value_and_grad(x, torch.randn(4, 4, dtype=torch.float64))
        y, vjp_fn = pipe.vjp(x * 2)
        vjp_fn(torch.ones_like(y))


# -- ties travel with the stages -------------------------------------------------------------

class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(7, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.lm_head = nn.Linear(4, 7, bias=False)
        self.lm_head.weight = self.wte.weight


def tied_stages(model):
    return [TiedEmbed(model), model.body, TiedHead(model)]


def test_stages_cut_with_a_tie_refuse_a_pipeline_without_it():
    model = TiedLM().double()
    s = from_modules(tied_stages(model), root=model, stateful=False)
    assert s.ties == (((0, "embed.weight"), (2, "head.weight")),)
    with pytest.raises(ValueError, match=r"'embed.weight' of stage 0 and 'head.weight' of "
                                         r"stage 2 are one weight.*ties=s.ties"):
        fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2))
    with pytest.raises(ValueError, match="one weight"):
        fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2), ties=[])
    fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2), ties=s.ties).close()


def test_the_stages_value_brings_its_ties_and_trains_as_the_tied_model():
    torch.manual_seed(0)
    plain = TiedLM().double()
    model = copy.deepcopy(plain)
    s = from_modules(tied_stages(model), root=model, stateful=False)
    ids = torch.randint(0, 7, (6,))
    target = torch.randn(6, 7, dtype=torch.float64)
    optimizer = torch.optim.SGD(optree.tree_leaves(s.params), lr=0.5)
    reference = torch.optim.SGD(plain.parameters(), lr=0.5)
    with fpipe.pipeline(s, schedule=gpipe(chunks=3), loss_fn=F.mse_loss) as pipe:
        for _ in range(3):
            _, grads = pipe.value_and_grad(ids, target)
            fpipe.optim.bind_grads(s.params, grads)
            optimizer.step()
            reference.zero_grad()
            F.mse_loss(plain.lm_head(plain.body(plain.wte(ids))), target).backward()
            reference.step()
    load_into(model, s.params, names=s.names)  # refuses copies that drifted apart
    assert_same_model(model, plain)


def test_params_beside_a_stages_value_are_refused():
    s = from_sequential(nn.Sequential(nn.Linear(2, 2)), [1], stateful=False)
    with pytest.raises(TypeError, match="takes the params from the Stages value"):
        fpipe.pipeline(s, s.params, schedule=gpipe(chunks=1))


# -- gradient hooks and late freezing follow the model's parameters ------------------------

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def fpipe_steps(s, data, before_step=lambda step: None):
    optimizer = torch.optim.SGD(optree.tree_leaves(s.params), lr=0.1)
    with fpipe.pipeline(s, schedule=one_f_one_b(chunks=2), loss_fn=F.mse_loss) as pipe:
        for step, (x, target) in enumerate(data):
            before_step(step)
            _, grads = pipe.value_and_grad(x, target)
            fpipe.optim.bind_grads(s.params, grads)
            optimizer.step()


def reference_steps(model, data, before_step=lambda step: None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, target) in enumerate(data):
        before_step(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), target).backward()
        optimizer.step()


@pytest.mark.parametrize("where", ["model before the cut", "model after the cut",
                                   "stage copy"])
def test_a_gradient_hook_applies_as_in_plain_pytorch(where):
    plain, data = mlp(), batches(3)
    model = copy.deepcopy(plain)
    mask = (torch.arange(24).reshape(6, 4) % 3 != 0).double()
    plain[0].weight.register_hook(lambda g: g * mask)
    if where == "model before the cut":
        model[0].weight.register_hook(lambda g: g * mask)
    s = from_sequential(model, [2, 3], stateful=False)
    if where == "model after the cut":
        model[0].weight.register_hook(lambda g: g * mask)
    elif where == "stage copy":
        s.params[0]["0.weight"].register_hook(lambda g: g * mask)
    reference_steps(plain, data)
    fpipe_steps(s, data)
    load_into(model, s.params)
    assert_same_model(model, plain)
    masked = s.params[0]["0.weight"].detach()[mask == 0]
    torch.testing.assert_close(masked, mlp()[0].weight.detach()[mask == 0], rtol=0, atol=0)


def test_a_post_accumulate_grad_hook_is_refused_at_the_cut():
    model = mlp()
    model[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ValueError, match=r"stage 1's parameter '2.bias' has a "
                                         r"post-accumulate-grad hook"):
        from_sequential(model, [2, 3])


@pytest.mark.parametrize("where", ["model", "stage copy"])
def test_requires_grad_false_after_the_cut_freezes_from_the_next_step(where):
    plain, data = mlp(), batches(4)
    model = copy.deepcopy(plain)
    s = from_sequential(model, [2, 3], stateful=False)

    def freeze(tensors):
        return lambda step: step == 2 and [t.requires_grad_(False) for t in tensors]

    reference_steps(plain, data, freeze(list(plain[0].parameters())))
    fpipe_steps(s, data, freeze(list(model[0].parameters()) if where == "model" else
                                [s.params[0]["0.weight"], s.params[0]["0.bias"]]))
    load_into(model, s.params)
    assert_same_model(model, plain)
