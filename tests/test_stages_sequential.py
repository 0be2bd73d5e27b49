"""Modules cut into stages train as the plain module does: same outputs, gradients, statistics."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import TiedEmbed, TiedHead, load_example
from torch import nn
from torch.func import functional_call, grad_and_value

import fpipe
from fpipe.schedules import gpipe, one_f_one_b
from fpipe.stages import (
    ModuleStage,
    StatefulModuleStage,
    from_modules,
    from_sequential,
    load_into,
)

TIGHT = dict(rtol=1e-10, atol=1e-12)
ROOT = Path(__file__).resolve().parent.parent


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3),
    ).double()


def batch(n=10, width=6, out=3):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, width, generator=g, dtype=torch.float64),
            torch.randn(n, out, generator=g, dtype=torch.float64))


def grads_by_tensor(stages, grads):
    """Pipeline gradients keyed by the module parameter they belong to."""
    return {id(p): grads[i][name] for i, stage in enumerate(stages)
            for name, p in stage.module.named_parameters()}


SCHEDULES = [gpipe(chunks=1), gpipe(chunks=3), gpipe(chunks=4, remat="always"),
             one_f_one_b(chunks=3), one_f_one_b(chunks=4, remat="always")]


@pytest.mark.parametrize("balance", [[8], [2, 6], [3, 3, 2], [1, 2, 2, 3]])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_sequential_gradients_match_the_module(balance, schedule):
    model = mlp()
    x, target = batch()
    whole = {name: p.detach() for name, p in model.named_parameters()}
    expected_grads, expected_loss = grad_and_value(
        lambda p: F.mse_loss(functional_call(model, p, (x,)), target))(whole)
    s = from_sequential(model, balance, stateful=False)
    assert s.state is None and all(isinstance(f, ModuleStage) for f in s.stages)
    with fpipe.pipeline(s.stages, s.params, schedule=schedule, loss_fn=F.mse_loss) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
        torch.testing.assert_close(pipe(x), model(x), **TIGHT)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert [sorted(g) for g in grads] == [sorted(p) for p in s.params]
    merged = {name: g for part in grads for name, g in part.items()}
    assert merged.keys() == expected_grads.keys()
    for name, g in expected_grads.items():
        torch.testing.assert_close(merged[name], g, **TIGHT)


def test_params_are_parameter_copies_on_the_devices_with_the_models_requires_grad():
    model = mlp()
    model[2].bias.requires_grad_(False)  # frozen in the model: frozen in the stages
    s = from_sequential(model, [3, 5], devices=["cpu", torch.device("cpu")])
    assert list(s.params[0]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert s.state is None  # no buffers: stateless stages by default
    for part in s.params:
        for name, t in part.items():
            assert t.is_leaf and isinstance(t, nn.Parameter)
            assert t.requires_grad == (name != "2.bias")
            assert t.device == torch.device("cpu")
    with torch.no_grad():
        s.params[0]["0.weight"].zero_()
    assert model[0].weight.abs().sum() > 0  # the module is not aliased


def test_training_then_load_into_hands_the_model_back():
    model, reference = mlp(), mlp()
    x, target = batch()
    s = from_sequential(model, [4, 4], stateful=False)
    leaves = [t for part in s.params for t in part.values()]
    optimizer = torch.optim.SGD(leaves, lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with fpipe.pipeline(s.stages, s.params, schedule=one_f_one_b(chunks=2),
                        loss_fn=F.mse_loss) as pipe:
        for _ in range(3):
            _, grads = pipe.value_and_grad(x, target)
            for leaf, g in zip(leaves, [g for part in grads for g in part.values()]):
                leaf.grad = g
            optimizer.step()
            reference_optimizer.zero_grad()
            F.mse_loss(reference(x), target).backward()
            reference_optimizer.step()
    load_into(model, s.params, s.state)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)


# The torchvision-ResNet recipe (README, "From nn.Module") on a small model built from torch.nn.

class Bottleneck(nn.Module):
    def __init__(self, channels, norm, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm(channels)
        self.downsample = nn.AvgPool2d(stride) if stride > 1 else nn.Identity()

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.downsample(x) + self.bn2(self.conv2(h)))


class ResNetLike(nn.Module):
    """torchvision's ResNet layout in miniature: a forward that is not an nn.Sequential."""

    def __init__(self, norm, channels=4, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(Bottleneck(channels, norm), Bottleneck(channels, norm))
        self.layer2 = nn.Sequential(Bottleneck(channels, norm, stride=2),
                                    Bottleneck(channels, norm))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def flatten_resnet(m):
    """The README recipe: stem, every block, pooling + flatten, classifier."""
    return nn.Sequential(nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool),
                         *m.layer1, *m.layer2,
                         nn.Sequential(m.avgpool, nn.Flatten()), m.fc)


class Stem(nn.Module):
    """An adapter for from_modules: references the model's layers, owns nothing new."""

    def __init__(self, m):
        super().__init__()
        self.conv1, self.bn1, self.maxpool = m.conv1, m.bn1, m.maxpool

    def forward(self, x):
        return self.maxpool(F.relu(self.bn1(self.conv1(x))))


class Head(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.avgpool, self.fc = m.avgpool, m.fc

    def forward(self, x):
        return self.fc(torch.flatten(self.avgpool(x), 1))


def group_norm(c):
    return nn.GroupNorm(2, c)


def resnet_batch(n=6):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (n,), generator=g))


def reference_grads(model, x, target):
    model.zero_grad()
    loss = F.cross_entropy(model(x), target)
    loss.backward()
    return loss.detach(), {id(p): p.grad for p in model.parameters()}


@pytest.mark.parametrize("cut", ["recipe", "from_modules"])
@pytest.mark.parametrize("schedule", [gpipe(chunks=3), one_f_one_b(chunks=2, remat="always")],
                         ids=repr)
def test_resnet_like_model_matches_its_own_forward(cut, schedule):
    torch.manual_seed(0)
    model = ResNetLike(group_norm).double()
    x, target = resnet_batch()
    expected_loss, expected = reference_grads(model, x, target)
    if cut == "recipe":
        flat = flatten_resnet(model)
        s = from_sequential(flat, [2, 2, 1, 2], stateful=False)
    else:
        s = from_modules([Stem(model), model.layer1, model.layer2, Head(model)], stateful=False)
    with fpipe.pipeline(s.stages, s.params, schedule=schedule,
                        loss_fn=F.cross_entropy) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
        torch.testing.assert_close(pipe(x), model(x), **TIGHT)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    got = grads_by_tensor(s.stages, grads)
    assert got.keys() == expected.keys()
    for key, g in expected.items():
        torch.testing.assert_close(got[key], g, **TIGHT)


# Buffers: stateful stages.

def bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_stateful_stage_returns_new_state_and_leaves_the_old_one():
    model = bn_model()
    plain = copy.deepcopy(model)
    s = from_sequential(model, [3, 4])
    assert isinstance(s.stages[0], StatefulModuleStage)
    assert sorted(s.state[0]) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    x, _ = batch()
    before = {k: v.clone() for k, v in s.state[0].items()}
    y, new_state = s.stages[0](s.params[0], s.state[0], x)
    for k, v in s.state[0].items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    torch.testing.assert_close(y, plain[:3](x), **TIGHT)
    for name, buffer in plain.named_buffers():
        if name in new_state:
            torch.testing.assert_close(new_state[name], buffer, rtol=0, atol=0)
    assert int(new_state["1.num_batches_tracked"]) == 1
    # A name in both params and state is refused, as functional_call refuses it.
    doubled = {**s.state[0], "0.weight": s.params[0]["0.weight"]}
    with pytest.raises(ValueError, match=r"\['0.weight'\] appeared in multiple dictionaries"):
        s.stages[0](s.params[0], doubled, x)


def test_stateful_stage_under_vjp():
    """The driver differentiates stages with torch.func.vjp; BatchNorm's in-place update of the
    cloned statistics must work under it, and the gradient be the plain module's."""
    model = bn_model()
    s = from_sequential(model, [7])
    x, target = batch()

    def loss(params):
        y, new_state = s.stages[0](params, s.state[0], x)
        return F.mse_loss(y, target), new_state

    value, vjp_fn, new_state = torch.func.vjp(loss, s.params[0], has_aux=True)
    (grads,) = vjp_fn(torch.ones_like(value))
    model.zero_grad()
    F.mse_loss(model(x), target).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TIGHT)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(new_state[name], buffer, rtol=0, atol=0)


def per_microbatch_reference(model, x, target, chunks):
    """Plain BatchNorm semantics: one forward, one momentum update per micro-batch, in order;
    gradients of the mean loss over the batch."""
    model.zero_grad()
    for xs, ts in zip(x.tensor_split(chunks), target.tensor_split(chunks)):
        (F.mse_loss(model(xs), ts) * (len(xs) / len(x))).backward()


@pytest.mark.parametrize("balance", [[2, 5], [3, 2, 2]])
@pytest.mark.parametrize("schedule", [gpipe(chunks=3), gpipe(chunks=3, remat="always"),
                                      one_f_one_b(chunks=4)], ids=repr)
def test_batchnorm_gradients_and_running_stats(balance, schedule):
    model = bn_model()
    plain = copy.deepcopy(model)
    x, target = batch(n=11)
    per_microbatch_reference(plain, x, target, schedule.program(1).n_microbatches)
    s = from_sequential(model, balance)
    with fpipe.pipeline(s.stages, s.params, state=s.state, schedule=schedule,
                        loss_fn=F.mse_loss) as pipe:
        _, grads, new_state = pipe.value_and_grad(x, target, state=s.state)
    got = grads_by_tensor(s.stages, grads)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got[id(p)], q.grad, **TIGHT)
    load_into(model, s.params, new_state)
    for (name, b), reference in zip(model.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b, reference, **TIGHT, msg=name)


def test_resnet_with_batchnorm_recipe_trains_like_the_module():
    torch.manual_seed(0)
    model = ResNetLike(nn.BatchNorm2d).double()
    plain = copy.deepcopy(model)
    x, target = resnet_batch(n=8)
    plain.zero_grad()
    for xs, ts in zip(x.tensor_split(2), target.tensor_split(2)):
        (F.cross_entropy(plain(xs), ts) / 2).backward()
    s = from_sequential(flatten_resnet(model), [2, 3, 2])
    with fpipe.pipeline(s.stages, s.params, state=s.state, schedule=gpipe(chunks=2),
                        loss_fn=F.cross_entropy) as pipe:
        _, grads, new_state = pipe.value_and_grad(x, target, state=s.state)
    got = grads_by_tensor(s.stages, grads)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got[id(p)], q.grad, **TIGHT)
    load_into(flatten_resnet(model), s.params, new_state)
    for b, reference in zip(model.buffers(), plain.buffers()):
        torch.testing.assert_close(b, reference, **TIGHT)


# Errors.

@pytest.mark.parametrize("balance, message", [
    ([3, 4], "sums to 7 layers but the module has 8"),
    ([4, 0, 4], r"balance\[1\] is 0"),
    ([9, -1], r"balance\[1\] is -1"),
    ([4.0, 4], r"balance\[0\] is 4.0"),
    ([], "balance is empty"),
])
def test_balance_errors(balance, message):
    with pytest.raises(ValueError, match=message):
        from_sequential(mlp(), balance)


def test_more_partitions_than_devices():
    with pytest.raises(ValueError, match="3 partitions but only 2 devices"):
        from_sequential(mlp(), [2, 3, 3], devices=["cpu", "cpu"])


def test_not_a_sequential():
    with pytest.raises(TypeError, match="from_modules"):
        from_sequential(ResNetLike(group_norm), [1])


def test_stateless_stages_refuse_buffers():
    with pytest.raises(ValueError, match=r"stage 1 has buffers \['1.num_batches_tracked'"):
        from_sequential(bn_model(), [1, 6], stateful=False)


@pytest.mark.parametrize("cut", ["sequential", "modules"])
def test_by_default_stages_are_stateful_exactly_when_the_model_has_buffers(cut):
    """No buffers: stateless stages and state None, so state=s.state builds a pipeline whose
    calls return (loss, grads) and y, the plain module's; one module with buffers makes every
    stage stateful (the others carry {})."""
    def make(model, balance):
        if cut == "sequential":
            return from_sequential(model, balance)
        return from_modules([model[:balance[0]], model[balance[0]:]])
    x, target = batch()
    model = mlp()
    s = make(model, [3, 5])
    assert s.state is None and all(type(f) is ModuleStage for f in s.stages)
    with fpipe.pipeline(s.stages, s.params, state=s.state, schedule=gpipe(chunks=2),
                        loss_fn=F.mse_loss) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
        torch.testing.assert_close(pipe(x), model(x), **TIGHT)
    torch.testing.assert_close(loss, F.mse_loss(model(x), target), **TIGHT)
    s = make(bn_model(), [3, 4])
    assert all(type(f) is StatefulModuleStage for f in s.stages)
    assert sorted(s.state[0]) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert sorted(s.state[1]) == ["4.num_batches_tracked", "4.running_mean", "4.running_var"]
    s = make(bn_model(), [1, 6])  # only the second stage has buffers: the first carries {}
    assert s.state[0] == {} and all(type(f) is StatefulModuleStage for f in s.stages)
    assert from_sequential(mlp(), [8], stateful=True).state == [{}]  # explicit, as asked


def test_stateful_stages_without_state_are_refused_at_build_naming_the_remedy():
    s = from_sequential(bn_model(), [3, 4])
    with pytest.raises(TypeError, match=r"stage 0 is a stateful module stage .* built without "
                                        r"state=: pass state=s.state.*stateful=False"):
        fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2), loss_fn=F.mse_loss)
    s = from_sequential(unet_like(), [1, 2], stateful=True)  # skips routed: still seen
    with pytest.raises(TypeError, match=r"stage 0 is a stateful module stage"):
        fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2), loss_fn=F.mse_loss)
    s = from_sequential(mlp(), [3, 5], stateful=False)
    with pytest.raises(TypeError, match=r"stage 0 is a stateless module stage .* built with "
                                        r"state=: leave out state="):
        fpipe.pipeline(s.stages, s.params, state=[{}, {}], schedule=gpipe(chunks=2))
    # a stage function of the user's own is not judged: its signature is the user's
    fpipe.pipeline([lambda p, st, x: (x, st)], [{}], state=[{}], schedule=gpipe(chunks=2))


def unet_like() -> nn.Sequential:
    """Three layers, the first stashing for the last (torchgpipe's skippable layers)."""
    from fpipe.stages import pop, skippable, stash

    @skippable(stash=["skip"])
    class Keep(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return x

    @skippable(pop=["skip"])
    class Add(nn.Module):
        def forward(self, x):
            return x + (yield pop("skip"))

    return nn.Sequential(Keep(), nn.Linear(6, 6), Add()).double()


def tied_sequential():
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), last).double()


def test_a_parameter_in_two_stages_becomes_a_tie_with_a_copy_per_stage():
    model = tied_sequential()
    s = from_sequential(model, [2, 1], stateful=False)
    assert s.ties == (((0, "0.weight"), (1, "2.weight")),)
    assert s.names == [{"0.weight": "0.weight", "0.bias": "0.bias"},
                       {"2.weight": "2.weight", "2.bias": "2.bias"}]
    a, b = s.params[0]["0.weight"], s.params[1]["2.weight"]
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert a.data_ptr() != model[0].weight.data_ptr()
    # Summed over the tie, each copy's gradient is the tied weight's own (float64).
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with fpipe.pipeline(s, schedule=gpipe(chunks=3), loss_fn=F.mse_loss) as pipe:
        _, grads = pipe.value_and_grad(x, target)
    F.mse_loss(model(x), target).backward()
    torch.testing.assert_close(grads[0]["0.weight"], model[0].weight.grad, **TIGHT)
    torch.testing.assert_close(grads[1]["2.weight"], model[0].weight.grad, **TIGHT)
    torch.testing.assert_close(grads[1]["2.bias"], model[2].bias.grad, **TIGHT)


def test_a_tensor_shared_within_one_stage_is_passed_once():
    model = tied_sequential()
    s = from_sequential(model, [3])
    assert s.ties == () and sorted(s.params[0]) == ["0.bias", "0.weight", "2.bias"]
    x = torch.randn(5, 4, dtype=torch.float64)
    assert s.state is None  # no buffers: a stateless stage
    y = s.stages[0](s.params[0], x)
    torch.testing.assert_close(y, model(x), **TIGHT)


def test_a_buffer_in_two_stages_is_refused():
    first, second = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    second.running_mean = first.running_mean
    model = nn.Sequential(first, second)
    with pytest.raises(ValueError, match=r"'0.running_mean' \(buffer\) of stage 0, "
                                         r"'1.running_mean' \(buffer\) of stage 1 are the same "
                                         r"tensor.*state cannot be tied"):
        from_sequential(model, [1, 1])


class Tiny(nn.Module):
    """A model whose output layer shares the input embedding's weight, as GPT-2's does."""

    def __init__(self, vocab=7, width=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


def tiny_stages(model):
    return [TiedEmbed(model), model.body, TiedHead(model)]


def test_names_are_the_models_own_found_by_module():
    model = Tiny()
    s = from_modules(tiny_stages(model), root=model, stateful=False)
    assert s.names == [{"embed.weight": "wte.weight"},
                       {"0.weight": "body.0.weight", "0.bias": "body.0.bias"},
                       {"head.weight": "lm_head.weight"}]  # by module: not wte.weight
    assert s.ties == (((0, "embed.weight"), (2, "head.weight")),)
    # Without root, the names are the stages' own.
    assert from_modules(tiny_stages(model), stateful=False).names[2] == {
        "head.weight": "head.weight"}
    stray = nn.Sequential(model.body, nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"stage 1's '1.weight' belongs to a Linear that is "
                                         r"not a submodule of root \(Tiny\)"):
        from_modules([TiedEmbed(model), stray], root=model)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_load_into_hands_a_tied_weight_to_both_names(device):
    with torch.device(device):  # on meta, materialising gives each stage its own copy
        model = Tiny()
    modules = tiny_stages(model)
    s = from_modules(modules, root=model, stateful=False)
    assert (model.wte.weight is model.lm_head.weight) == (device == "cpu")
    trained = torch.randn(7, 4)
    with torch.no_grad():  # the copies are nn.Parameters, as the model's
        for (stage, name) in s.ties[0]:
            s.params[stage][name].copy_(trained)  # what a step on summed gradients keeps equal
    load_into(modules, s.params)
    assert torch.equal(model.wte.weight, trained) and torch.equal(model.lm_head.weight, trained)
    trained = trained + 1
    with torch.no_grad():
        for (stage, name) in s.ties[0]:
            s.params[stage][name].copy_(trained)
    load_into(model, s.params, names=s.names)  # the whole model, by the model's names
    assert torch.equal(model.wte.weight, trained) and torch.equal(model.lm_head.weight, trained)


def test_held_stages_only_are_copied():
    model = Tiny()
    s = from_modules(tiny_stages(model), root=model, stateful=False, held=[1])
    assert all(t.is_meta for t in s.params[0].values())
    assert all(t.is_meta for t in s.params[2].values())
    assert s.params[2]["head.weight"].shape == (7, 4)
    torch.testing.assert_close(s.params[1]["0.weight"], model.body[0].weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"held names stage 3, but the stages are 0 to 2"):
        from_modules(tiny_stages(model), held=[3])


def test_load_into_errors():
    model = mlp()
    s = from_sequential(model, [4, 4])
    with pytest.raises(KeyError, match="stage 1's '5.weight' is not a parameter"):
        load_into(model[:4], s.params)
    with pytest.raises(ValueError, match="got 1 modules but 2 parameter dicts"):
        load_into([model], s.params)


def test_documented_from_module_snippet_runs():
    page = "docs/from-modules.md"  # README's "From nn.Module" until issue 27
    text = (ROOT / page).read_text()
    code = re.search(r"# From nn.Module in detail\n.*?```python\n(.*?)```", text, re.S).group(1)
    torch.manual_seed(0)
    snippet = {}
    exec(compile(code, page, "exec"), snippet)
    # The same five Adam steps on the module itself in plain autograd (one draw per step
    # from the CPU generator: the pipeline's step seed): load_into handed back these weights.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x, target = torch.randn(64, 32), torch.randint(0, 10, (64,))
    torch.testing.assert_close(x, snippet["features"], rtol=0, atol=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(5):
        torch.empty((), dtype=torch.int64).random_()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), target).backward()
        optimizer.step()
    trained = dict(snippet["model"].named_parameters())
    for name, value in model.named_parameters():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.needs_extra
def test_gpt_example_learns_and_hands_the_model_back(capsys):
    pytest.importorskip("tqdm")  # the example's progress bar: the [examples] extra
    example = load_example("gpt_pipeline")
    first, trained = example.main(["--steps", "8", "--schedule", "1f1b"])
    # The loss is that of the GPT's own forward after load_into, on fresh data.
    assert trained < 0.7 * first
    assert "-> " in capsys.readouterr().out
    # The same training on the GPT itself in plain autograd (the pipeline draws one number
    # per step from the CPU generator, the step's seed, so the reference draws it too).
    torch.manual_seed(0)
    gpt = example.GPT(64, context=32, width=64, depth=4, heads=4)
    optimizer = torch.optim.Adam(gpt.parameters(), lr=3e-3)
    for step in range(8):
        ids, targets = example.synthetic_batch(32, 32, 64)
        torch.empty((), dtype=torch.int64).random_()
        loss = example.next_token_loss(gpt(ids), targets)
        if step == 0:
            assert first == pytest.approx(loss.item(), rel=1e-5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ids, targets = example.synthetic_batch(32, 32, 64)
    with torch.no_grad():
        assert trained == pytest.approx(example.next_token_loss(gpt(ids), targets).item(),
                                        rel=1e-3)


# -- the swap of a module's tensors (fpipe.stages.swap) ---------------------------------------

class _Counts(nn.Module):
    """A tied weight (two names, one tensor), a buffer updated in place and one reassigned."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("last", torch.zeros(3))

    def forward(self, x):
        self.seen.add_(1)
        self.last = x.mean(0)  # reassigned, not updated
        return self.b(torch.relu(self.a(x)))


def test_the_swap_computes_what_functional_call_computes_and_restores_the_module():
    from fpipe.stages.swap import Swap

    torch.manual_seed(0)
    module = _Counts().double()
    own = {name: t for name, t in (*module.named_parameters(), *module.named_buffers())}
    assert "b.weight" not in own  # a tie: one name, as named_parameters gives it
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(2):  # the second call uses the slots found by the first
        values = {name: t.detach().clone() + 1 for name, t in own.items()}
        expected = {name: t.clone() for name, t in values.items()}
        y_expected = torch.func.functional_call(module, expected, (x,), strict=True)
        swap = Swap(module)
        y = swap(values, (x,))
        torch.testing.assert_close(y, y_expected, rtol=0, atol=0)
        assert values.keys() == expected.keys()
        for name in values:  # in place and reassigned buffers come back alike
            torch.testing.assert_close(values[name], expected[name], rtol=0, atol=0)
        assert module.b.weight is module.a.weight is own["a.weight"]
        assert module.last is own["last"] and float(module.seen) == 0
    with pytest.raises(RuntimeError, match="Missing key"):
        swap({k: v for k, v in values.items() if k != "a.bias"}, (x,))
    with pytest.raises(RuntimeError, match="mat1 and mat2"):  # the originals put back
        swap(values, (torch.randn(4, 5, dtype=torch.float64),))
    assert module.a.bias is own["a.bias"]
