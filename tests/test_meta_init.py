"""Models built on the meta device: each stage is made and initialised on its own device only,
with the values a CPU-built model gets from the same seed and the same initialiser order."""

from __future__ import annotations

import hashlib

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


def seed_of(base, name):
    """The documented rule (docs/from-modules.md), written out here rather than imported."""
    return int.from_bytes(hashlib.blake2b(f"{base}/{name}".encode(), digest_size=8).digest(),
                          "little")


def by_the_rule(model, seed, init=None):
    """``model`` (built on the CPU, whatever it drew) initialised by the rule: one base seed
    drawn after ``torch.manual_seed(seed)``, then each submodule under the seed of its name in
    the model; a tied weight is its first owner's (the embedding's)."""
    torch.manual_seed(seed)
    base = int(torch.randint(0, 2**62, ()))
    with torch.no_grad():
        for name, sub in model.named_modules():
            torch.manual_seed(seed_of(base, name))
            if init is not None:
                init(sub)
            elif hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
        model.lm_head.weight.copy_(model.wte.weight)
    return model


def reference(seed):
    torch.manual_seed(123)  # whatever the build draws is overwritten
    return by_the_rule(Tiny(tie=False), seed)


def meta_model():
    with torch.device("meta"):
        return Tiny()


def test_a_meta_model_materialised_equals_the_cpu_model_initialised_by_the_rule():
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
    expected = reference(5).double()  # untied, the head holding the embedding's value
    s = s._replace(params=[{k: v.double() for k, v in p.items()} for p in s.params],
                   state=[{k: v.double() if v.is_floating_point() else v for k, v in p.items()}
                          for p in s.state])
    ids, target = torch.randint(0, 11, (8,)), torch.randn(8, 11, dtype=torch.float64)
    with fpipe.pipeline(s, schedule=gpipe(chunks=1), loss_fn=F.mse_loss) as pipe:
        loss, grads, _ = pipe.value_and_grad(ids, target)
    want = F.mse_loss(expected.lm_head(expected.body(expected.wte(ids))), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    tied = expected.lm_head.weight.grad + expected.wte.weight.grad  # the one weight's
    torch.testing.assert_close(grads[2]["head.weight"], tied, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0]["embed.weight"], tied, rtol=1e-10, atol=1e-12)


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


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(self.ln(x))))


class GPTish(nn.Module):
    """Token embedding, blocks, final norm, and an LM head tied to the embedding."""

    def __init__(self, vocab=13, width=8, depth=4, tie=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


class Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.lm_head

    def forward(self, h):
        return self.head(self.ln_f(h))


def gpt_cut(model, bounds):
    """Stages over the layers [embedding, block 0, ..., block 3, head], cut at ``bounds``."""
    layers = [TiedEmbed(model), *model.blocks, Head(model)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip((0, *bounds), (*bounds, len(layers)))]


def gpt_layouts():
    """Name -> (cut bounds, the stages each process holds): 1F1B and interleaved placements
    of 2 workers (from the schedules), another balance, and one process holding it all (the
    tie then within one stage)."""
    from fpipe.distributed import my_stages
    from fpipe.schedules import interleaved_one_f_one_b, one_f_one_b

    return {"1f1b": ((3,), [my_stages(one_f_one_b(chunks=4), 2, rank=r) for r in (0, 1)]),
            "interleaved": ((2, 3, 4), [my_stages(interleaved_one_f_one_b(chunks=4), 4, rank=r)
                                        for r in (0, 1)]),
            "balance 1-3-1-1": ((1, 4, 5), [(0, 3), (1,), (2,)]),
            "whole": ((), [(0,)])}


def gpt_values(bounds, ranks, seed, init):
    """Every tensor by its model name, each taken from the process (a fresh meta model, seeded
    alike) holding it, checking that copies held twice agree; and the random state each
    process is left in."""
    values, states = {}, []
    for held in ranks:
        with torch.device("meta"):
            model = GPTish()
        torch.manual_seed(seed)
        s = from_modules(gpt_cut(model, bounds), root=model, held=held, init=init)
        states.append(torch.get_rng_state())
        for i in held:
            buffers = s.state[i].items() if s.state is not None else ()  # none: stateless
            for local, value in [*s.params[i].items(), *buffers]:
                name = s.names[i][local]
                assert name not in values or torch.equal(values[name], value), name
                values[name] = value
    return values, states


def gpt2_style(module):
    """An init function as Hugging Face's ``_init_weights``: called on every submodule."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()


@pytest.mark.parametrize("init", ["reset_parameters", gpt2_style], ids=["reset", "function"])
def test_a_seed_gives_the_same_weights_in_every_layout(init):
    """The values depend on the seed only: the 1F1B and interleaved placements, another
    balance and one process give every tensor (both names of the tie) the same bits, those of
    the rule applied to a CPU-built model; each process's random state after the build is the
    same, whatever it holds; another seed gives other values."""
    torch.manual_seed(3)
    torch.randint(0, 2**62, ())
    after = torch.get_rng_state()  # one draw, whatever a process holds
    torch.manual_seed(0)
    expected = by_the_rule(GPTish(tie=False), 3, None if init == "reset_parameters" else init)
    expected = {**dict(expected.named_parameters()), **dict(expected.named_buffers())}
    assert len(expected) == 28
    for layout, (bounds, ranks) in gpt_layouts().items():
        values, states = gpt_values(bounds, ranks, 3, init)
        shared = {"lm_head.weight"} if layout == "whole" else set()  # one tensor, one name
        assert sorted(values) == sorted(set(expected) - shared), layout
        for name, value in values.items():
            assert torch.equal(value, expected[name]), (layout, name)
        assert all(torch.equal(state, after) for state in states), layout
    other, _ = gpt_values((3,), [(0,), (1,)], 4, init)
    drawn = [n for n in expected if n.endswith("weight") and "ln" not in n]
    assert len(drawn) == 10 and not any(torch.equal(other[n], expected[n]) for n in drawn)


def test_from_sequential_seeds_by_the_layer_names_whatever_the_balance():
    """A meta ``nn.Sequential`` cut by any balance, held in any part, gives each layer the
    values the rule gives the layer called ``"2"`` of the Sequential."""
    def build():
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3), nn.LayerNorm(3))

    torch.manual_seed(9)
    base = int(torch.randint(0, 2**62, ()))
    expected = build()
    for name, sub in expected.named_modules():
        if hasattr(sub, "reset_parameters"):
            torch.manual_seed(seed_of(base, name))
            sub.reset_parameters()
    for balance, held in (([4], None), ([1, 3], [1]), ([2, 1, 1], [0, 2]), ([3, 1], [0])):
        with torch.device("meta"):
            model = build()
        torch.manual_seed(9)
        s = from_sequential(model, balance, held=held)
        for i in held or [0]:
            for name, value in s.params[i].items():
                assert torch.equal(value, expected.get_parameter(name)), (balance, name)
