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
