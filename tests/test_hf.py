"""A Hugging Face ``transformers`` GPT-2 cut into stages trains as the unpipelined model does:
the same loss and gradients at every step (skipped when transformers is not installed)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.needs_extra  # [hf]
pytest.importorskip("transformers")

from models import load_example as load  # noqa: E402

import fpipe  # noqa: E402
from fpipe.optim import bind_grads  # noqa: E402
from fpipe.schedules import gpipe  # noqa: E402
from fpipe.stages import from_modules, load_into  # noqa: E402


def load_example():
    return load("hf_gpt2")


def hf_pair(seed=0):
    """The example's tied GPT-2 twice, equal: the unpipelined reference and the one to cut."""
    example = load_example()
    torch.manual_seed(seed)
    reference = example.tiny_gpt2(layers=4).double()
    torch.manual_seed(seed)
    model = example.tiny_gpt2(layers=4).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    return example, reference, model


def check_grads(s, grads, reference, summed):
    """Each leaf's gradient (``summed``: a tie's copies' sum) is the reference's, by name."""
    for names, part in zip(s.names, grads):
        for local, grad in part.items():
            torch.testing.assert_close(summed.get(names[local], grad),
                                       reference.get_parameter(names[local]).grad,
                                       rtol=1e-8, atol=1e-10)


def test_hf_gpt2_cut_with_its_tie_finds_names_and_the_tie():
    """Names by module (the head's weight is ``lm_head.weight``, though it is the embedding's
    tensor), the tie between the first stage and the last, which the Stages value brings to the
    pipeline: each copy's gradient is the tied model's, and trained copies go back to both
    names."""
    example, reference, model = hf_pair()
    s = from_modules(example.cut(model), root=model, stateful=False)
    assert len(s.stages) == 4
    assert s.names[3] == {"ln_f.weight": "transformer.ln_f.weight",
                          "ln_f.bias": "transformer.ln_f.bias",
                          "lm_head.weight": "lm_head.weight"}
    assert s.names[0]["wte.weight"] == "transformer.wte.weight"
    assert s.ties == (((0, "wte.weight"), (3, "lm_head.weight")),)
    ids, targets = example.synthetic_batch(6, 12, vocab=100)
    with fpipe.pipeline(s, schedule=gpipe(chunks=3), loss_fn=example.next_token_loss) as pipe:
        loss, grads = pipe.value_and_grad(ids, targets)
    expected = example.next_token_loss(reference(ids).logits, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-10)
    tied = grads[0]["wte.weight"]
    torch.testing.assert_close(grads[3]["lm_head.weight"], tied, rtol=0, atol=0)
    check_grads(s, grads, reference, {"transformer.wte.weight": tied, "lm_head.weight": tied})
    with torch.no_grad():
        for stage, name in s.ties[0]:
            s.params[stage][name].sub_(0.1 * tied.to(s.params[stage][name].device))
    load_into(model, s.params, names=s.names)
    want = reference.lm_head.weight.detach() - 0.1 * tied  # the same update on both copies
    torch.testing.assert_close(model.transformer.wte.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, want, rtol=0, atol=0)


def test_hf_gpt2_pipeline_trains_as_the_plain_model():
    example, reference, model = hf_pair()
    s = from_modules(example.cut(model), root=model, stateful=False)
    assert sum(map(len, s.params)) == len(list(reference.parameters())) + 1  # the tie's copy
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = torch.optim.SGD([t for part in s.params for t in part.values()], lr=0.1)
    with fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=3),
                        loss_fn=example.next_token_loss, ties=s.ties) as pipe:
        for _ in range(2):
            ids, targets = example.synthetic_batch(6, 12, vocab=100)
            reference_optimizer.zero_grad()
            expected = example.next_token_loss(reference(ids).logits, targets)
            expected.backward()
            loss, grads = pipe.value_and_grad(ids, targets)
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-10)
            check_grads(s, grads, reference, {})  # each copy's gradient is the tie's sum
            bind_grads(s.params, grads)
            optimizer.step()
            reference_optimizer.step()
    load_into(model, s.params, names=s.names)
    for name, value in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(model.get_parameter(name), value, rtol=1e-8, atol=1e-10)


def test_hf_example_learns(capsys):
    first, trained = load_example().main(["--steps", "10"])
    assert trained < 0.7 * first


def test_hf_gpt2_built_on_meta_initialises_with_its_own_scheme():
    """``init=model._init_weights``: the meta-built GPT-2's stages get HF's initialisation
    (normal(0.02) weights, zero biases, unit layer norms), each on its device, the tie equal."""
    example = load_example()
    with torch.device("meta"):
        model = example.tiny_gpt2(layers=2)
    torch.manual_seed(0)
    s = from_modules(example.cut(model, blocks_per_stage=1), root=model, stateful=False,
                     init=model._init_weights)
    assert not any(t.is_meta for part in s.params for t in part.values())
    assert torch.equal(s.params[0]["wte.weight"], s.params[3]["lm_head.weight"])
    assert torch.equal(s.params[3]["ln_f.weight"], torch.ones(32))
    assert torch.equal(s.params[1]["blocks.0.attn.c_attn.bias"], torch.zeros(96))
    assert 0.015 < s.params[1]["blocks.0.mlp.c_fc.weight"].std() < 0.025


def tiny_gpt2():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Model(config).double()


def test_a_model_output_crosses_a_stage_boundary():
    """An HF ``ModelOutput`` (registered with torch's pytree registry, not optree's) is a
    pytree like any other: stage 0 returns the model's output object, stage 1 reads
    ``.last_hidden_state`` from it; loss and gradients equal the unpipelined model's."""
    from torch.func import functional_call
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    body = tiny_gpt2()

    def encoder(p, ids):
        out = functional_call(body, p, (ids,), {"use_cache": False})
        assert isinstance(out, BaseModelOutputWithPastAndCrossAttentions)
        return out

    def head(p, out):
        assert isinstance(out, BaseModelOutputWithPastAndCrossAttentions)
        return out.last_hidden_state @ p["w"]

    params = [{k: v.detach() for k, v in body.named_parameters()},
              {"w": torch.randn(16, 3, dtype=torch.float64)}]
    ids, target = torch.randint(0, 50, (6, 5)), torch.randn(6, 5, 3, dtype=torch.float64)

    def mse(y, t):
        return ((y - t) ** 2).mean()

    with fpipe.pipeline([encoder, head], params, schedule=gpipe(chunks=3), loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(ids, target)
        torch.testing.assert_close(pipe(ids), head(params[1], encoder(params[0], ids)))
    with fpipe.pipeline([encoder], params[:1], schedule=gpipe(chunks=2)) as first:
        out = first(ids)  # micro-batches' outputs joined into one ModelOutput
        assert isinstance(out, BaseModelOutputWithPastAndCrossAttentions)
        torch.testing.assert_close(out.last_hidden_state, encoder(params[0], ids).last_hidden_state)

    leaves = [dict(p) for p in params]
    for p in leaves:
        for v in p.values():
            v.requires_grad_(True)
    expected = mse(head(leaves[1], encoder(leaves[0], ids)), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for part, part_grads in zip(leaves, grads):
        for name, value in part.items():
            torch.testing.assert_close(part_grads[name], value.grad)


def test_hf_gradient_checkpointing_inside_a_stage():
    """HF's activation checkpointing (``gradient_checkpointing_enable()`` before 5.x) on a
    model called in a stage: the default autodiff differentiates through its checkpoints;
    gradients equal the model's own."""
    from torch.func import functional_call

    body = tiny_gpt2()
    reentrant = {"use_reentrant": False}
    if hasattr(body, "activation_checkpointing_enable"):  # its name from transformers 5.x
        body.activation_checkpointing_enable(activation_checkpointing_kwargs=reentrant)
    else:
        body.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
    body.train()

    def encoder(p, ids):
        return functional_call(body, p, (ids,), {"use_cache": False}).last_hidden_state

    def head(p, h):
        return h @ p["w"]

    params = [{k: v.detach() for k, v in body.named_parameters()},
              {"w": torch.randn(16, 3, dtype=torch.float64)}]
    ids, target = torch.randint(0, 50, (6, 5)), torch.randn(6, 5, 3, dtype=torch.float64)

    def mse(y, t):
        return ((y - t) ** 2).mean()

    with fpipe.pipeline([encoder, head], params, schedule=gpipe(chunks=3, remat="never"),
                        loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(ids, target)
    body.zero_grad()
    w = params[1]["w"].clone().requires_grad_(True)
    expected = mse(body(ids, use_cache=False).last_hidden_state @ w, target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for name, value in body.named_parameters():
        torch.testing.assert_close(grads[0][name], value.grad)
    torch.testing.assert_close(grads[1]["w"], w.grad)
