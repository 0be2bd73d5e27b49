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
from fpipe.stages import from_modules  # noqa: E402


def load_example():
    return load("hf_gpt2")


def test_hf_gpt2_pipeline_trains_as_the_plain_model():
    example = load_example()
    torch.manual_seed(0)
    reference = example.tiny_gpt2(layers=4).double()
    torch.manual_seed(0)
    model = example.tiny_gpt2(layers=4).double()
    s = from_modules(example.cut(model), stateful=False)
    assert sum(map(len, s.params)) == len(list(reference.parameters()))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = torch.optim.SGD([t for part in s.params for t in part.values()], lr=0.1)
    with fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=3),
                        loss_fn=example.next_token_loss) as pipe:
        for _ in range(2):
            ids, targets = example.synthetic_batch(6, 12, vocab=100)
            reference_optimizer.zero_grad()
            expected = example.next_token_loss(reference(ids).logits, targets)
            expected.backward()
            loss, grads = pipe.value_and_grad(ids, targets)
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-10)
            # The adapters hold the model's own layers: match gradients by the tensors' names
            # in the model.
            where = {id(p): n for n, p in model.named_parameters()}
            modules = example.cut(model)
            for module, part, part_grads in zip(modules, s.params, grads):
                for name in part:
                    full = where[id(module.get_parameter(name))]
                    torch.testing.assert_close(part_grads[name],
                                               reference.get_parameter(full).grad,
                                               rtol=1e-8, atol=1e-10)
            bind_grads(s.params, grads)
            optimizer.step()
            reference_optimizer.step()


def test_hf_example_learns(capsys):
    first, trained = load_example().main(["--steps", "10"])
    assert trained < 0.7 * first


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
    """``gradient_checkpointing_enable()`` on an HF model called in a stage: the default
    autodiff differentiates through its checkpoints; gradients equal the model's own."""
    from torch.func import functional_call

    body = tiny_gpt2()
    body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
