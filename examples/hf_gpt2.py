"""Train a Hugging Face ``transformers`` GPT-2, cut into pipeline stages, on the CPU.

    pip install -e '.[hf]'   # in fpipe's clone: transformers and safetensors
    python examples/hf_gpt2.py [--steps 30] [--chunks 4]

The model is ``GPT2LMHeadModel`` built from a tiny config with random weights (nothing is
downloaded), its output layer tied to the input embedding as GPT-2's is. Three kinds of adapter
module hold the model's own layers: embeddings (``wte + wpe``, dropout), a run of blocks (which
builds the causal mask the blocks expect), and the head (``ln_f``, ``lm_head``); four stages in
all. ``fpipe.stages.from_modules(..., root=model)`` turns them into stages: the tied weight is
in the first stage and the last, so each gets a copy and ``s.ties`` names the pair; the
pipeline, given the Stages value ``s`` itself (which brings ``s.ties``), sums the two copies'
gradients, so the same optimiser step keeps them equal. The data follows the rule
``next = (5 * token + 3) % vocab``, so the loss falls as the model learns it. At the end the
trained weights are handed back to the model (both names of the tied weight), whose own
forward gives the final loss.
"""

from __future__ import annotations

import argparse

import optree
import torch
from tokens import next_token_loss, synthetic_batch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from workers import fit

import fpipe
from fpipe.optim import bind_grads, clip_grad_norm
from fpipe.schedules import one_f_one_b
from fpipe.stages import from_modules, load_into


def tiny_gpt2(vocab: int = 100, layers: int = 4, width: int = 32, context: int = 32,
              dropout: float = 0.0) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers,
                        n_head=4, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                        attn_implementation="eager")
    return GPT2LMHeadModel(config)


class Embeddings(nn.Module):
    """Token and position embeddings, then dropout, as ``GPT2Model.forward`` begins."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = (model.transformer.wte, model.transformer.wpe,
                                         model.transformer.drop)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class Blocks(nn.Module):
    """A run of the model's blocks. ``GPT2Model`` builds the causal mask once and hands it to
    every block; a stage builds its own: an additive mask, ``-inf`` above the diagonal."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        future = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        mask = torch.zeros(t, t, dtype=h.dtype, device=h.device).masked_fill(
            future, torch.finfo(h.dtype).min)[None, None]
        for block in self.blocks:
            h = block(h, attention_mask=mask)
            h = h[0] if isinstance(h, tuple) else h
        return h


class Head(nn.Module):
    """The final layer norm and the LM head: logits."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))


def cut(model: GPT2LMHeadModel, blocks_per_stage: int = 2) -> list[nn.Module]:
    """Embeddings / blocks / ... / head: one module per stage, over the model's own layers."""
    h = list(model.transformer.h)
    runs = [Blocks(h[i:i + blocks_per_stage]) for i in range(0, len(h), blocks_per_stage)]
    return [Embeddings(model), *runs, Head(model)]


def main(argv: list[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    vocab, length, batch = 100, 16, 16
    model = tiny_gpt2(vocab)
    modules = cut(model)
    s = from_modules(modules, root=model, stateful=False)
    print(f"tied across stages: {s.ties}")
    optimizer = torch.optim.AdamW(optree.tree_leaves(s.params), lr=args.lr)
    schedule = fit(one_f_one_b(chunks=args.chunks), len(s.stages))  # a worker per core at most
    with fpipe.pipeline(s, schedule=schedule, loss_fn=next_token_loss) as pipe:
        print(f"GPT-2 from transformers in {len(s.stages)} stages:\n{pipe.program}")
        first = None
        for step in range(1, args.steps + 1):
            loss, grads = pipe.value_and_grad(*synthetic_batch(batch, length, vocab))
            grads, norm = clip_grad_norm(grads, max_norm=1.0, ties=s.ties)  # tie counted once
            bind_grads(s.params, grads)
            optimizer.step()
            first = loss.item() if first is None else first
            print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}")

    load_into(model, s.params, names=s.names)  # to the model's own names, both tied ones
    ids, targets = synthetic_batch(batch, length, vocab)
    with torch.no_grad():
        trained = next_token_loss(model(ids).logits, targets).item()
    print(f"loss {first:.4f} -> {loss.item():.4f}; the trained model's own forward: "
          f"{trained:.4f}")
    return first, trained


if __name__ == "__main__":
    main()
