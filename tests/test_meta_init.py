"""Models built on the meta device: each stage is made and initialised on its own device only,
with the values a CPU-built model gets from the same seed and the same initialiser order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import TiedEmbed, TiedHead
from torch import nn

import fpipe
from fpipe.schedules import gpipe
from fpipe.stages import from_modules, from_sequential


class Tiny(nn.Module):
    """Embedding, norms with running statistics, and an output layer tied to the embedding."""

    def __init__(self, vocab=11, width=6, tie=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width),
                                  nn.LayerNorm(width), nn.Tanh())
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def cut(model):
    return [TiedEmbed(model), model.body, TiedHead(model)]


def reference(seed):
    """The defined order on a CPU-built model: first the owner of each tie's first member
    (its value is every copy's), then stage by stage, each submodule in ``modules()`` order
    once, ``reset_parameters()`` where it has one. (Built untied, as materialising gives each
    stage its own copy.)"""
    torch.manual_seed(123)  # whatever the build draws is overwritten
    model = Tiny(tie=False)
    torch.manual_seed(seed)
    model.wte.reset_parameters()
    seen = {id(model.wte)}
    for stage in cut(model):
        for sub in stage.modules():
            if id(sub) not in seen and hasattr(sub, "reset_parameters"):
                seen.add(id(sub))
                sub.reset_parameters()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.wte.weight)
    return model


def meta_model():
    with torch.device("meta"):
        return Tiny()


def test_a_meta_model_materialised_equals_the_cpu_model_initialised_in_the_same_order():
    model = meta_model()
    torch.manual_seed(5)
    s = from_modules(cut(model), root=model)
    expected = reference(5)
    for names, params, state in zip(s.names, s.params, s.state):
        for local, value in [*params.items(), *state.items()]:
            want = expected.get_parameter(names[local]) if local in params else \
                expected.get_buffer(names[local])
            assert value.device.type == "cpu" and value.dtype == want.dtype
            assert torch.equal(value, want), names[local]
    # BatchNorm's statistics are initialised, not left as whatever memory held.
    assert torch.equal(s.state[1]["1.running_var"], torch.ones(6))
    assert int(s.state[1]["1.num_batches_tracked"]) == 0
    # The tie: a copy per stage, equal values; the module holds the stage's own tensors.
    assert s.ties == (((0, "embed.weight"), (2, "head.weight")),)
    assert s.params[0]["embed.weight"].data_ptr() != s.params[2]["head.weight"].data_ptr()
    assert s.params[2]["head.weight"].data_ptr() == model.lm_head.weight.data_ptr()
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_a_materialised_model_trains_as_the_cpu_model():
    model = meta_model()
    torch.manual_seed(5)
    s = from_modules(cut(model), root=model)
    expected = reference(5).double()
    s = s._replace(params=[{k: v.double() for k, v in p.items()} for p in s.params],
                   state=[{k: v.double() if v.is_floating_point() else v for k, v in p.items()}
                          for p in s.state])
    ids, target = torch.randint(0, 11, (8,)), torch.randn(8, 11, dtype=torch.float64)
    with fpipe.pipeline(s.stages, s.params, state=s.state, schedule=gpipe(chunks=1),
                        loss_fn=F.mse_loss) as pipe:
        loss, grads, _ = pipe.value_and_grad(ids, target)
    want = F.mse_loss(expected.lm_head(expected.body(expected.wte(ids))), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[2]["head.weight"], expected.lm_head.weight.grad,
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0]["embed.weight"], expected.wte.weight.grad,
                               rtol=1e-10, atol=1e-12)


def test_stages_not_held_are_never_allocated():
    model = meta_model()
    s = from_modules(cut(model), root=model, held=[1])
    assert not any(t.is_meta for t in [*s.params[1].values(), *s.state[1].values()])
    for i in (0, 2):
        assert all(t.is_meta for t in s.params[i].values())
    assert model.wte.weight.is_meta and model.lm_head.weight.is_meta
    assert s.params[2]["head.weight"].shape == (11, 6)
    assert not any(t.is_meta for t in model.body.parameters())


def test_processes_holding_different_stages_of_a_tie_give_it_one_value():
    """Rank 0 holds the embedding, rank 1 the head tied to it: seeded alike, each initialises
    the tie first (rank 1 on a scratch copy of the embedding), so the copies are equal, and
    equal to a one-process build's; a checkpoint can fill them instead (``init=None``)."""
    built = {}
    for held in ([0], [1, 2], [0, 1, 2]):
        model = meta_model()
        torch.manual_seed(7)
        built[tuple(held)] = from_modules(cut(model), held=held)
        assert model.wte.weight.is_meta == (0 not in held)  # the scratch copy is not kept
    first = built[(0,)].params[0]["embed.weight"]
    assert torch.equal(built[(1, 2)].params[2]["head.weight"], first)
    assert torch.equal(built[(0, 1, 2)].params[2]["head.weight"], first)
    assert torch.equal(built[(0, 1, 2)].params[0]["embed.weight"], first)
    torch.manual_seed(8)
    other = from_modules(cut(meta_model()), held=[1, 2])
    assert not torch.equal(other.params[2]["head.weight"], first)  # the seed decides
    model = meta_model()
    s = from_modules(cut(model), held=[1, 2], init=None)  # a checkpoint fills it in place
    assert not s.params[2]["head.weight"].is_meta and s.params[0]["embed.weight"].is_meta


def test_init_none_leaves_storage_for_a_checkpoint():
    model = meta_model()
    s = from_modules(cut(model), init=None)
    assert all(not t.is_meta and t.device.type == "cpu" for p in s.params for t in p.values())


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.linear(x) * self.scale


def test_a_parameter_without_an_initialiser_is_an_error_unless_init_is_given():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scaled())
    with pytest.raises(ValueError, match=r"stage 1's \['1.scale'\] are on the meta device and "
                                         r"their Scaled has no reset_parameters\(\).*init="):
        from_sequential(model, [1, 1])
    assert all(p.is_meta for p in model.parameters())  # refused before anything was made
    calls = []

    def init(module):
        calls.append(type(module).__name__)
        if isinstance(module, Scaled):
            module.scale.fill_(2.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    s = from_sequential(model, [1, 1], init=init)
    assert calls == ["Sequential", "Linear", "Sequential", "Scaled", "Linear"]
    assert torch.equal(s.params[1]["1.scale"], torch.full((3,), 2.0))


def test_a_tensor_shared_within_a_stage_stays_shared():
    with torch.device("meta"):
        model = Tiny()
    s = from_modules([nn.Sequential(TiedEmbed(model), TiedHead(model))], root=model, stateful=False)
    assert s.ties == () and list(s.params[0]) == ["0.embed.weight"]
    assert model.wte.weight is model.lm_head.weight and not model.wte.weight.is_meta
    assert s.names == [{"0.embed.weight": "wte.weight"}]


def test_a_stage_partly_on_meta_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.device("meta"):
        model.append(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"stage 0 has tensors on the meta device "
                                         r"\(\['1.weight', '1.bias'\]\) and others not"):
        from_sequential(model, [2])
