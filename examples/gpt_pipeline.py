"""Train a small GPT cut into pipeline stages, on the CPU, on synthetic token data.

    python examples/gpt_pipeline.py [--steps 60] [--schedule gpipe] [--chunks 4]

The GPT is an ordinary ``nn.Module`` whose forward is not an ``nn.Sequential``: token and
positional embeddings, pre-norm blocks of causal self-attention and MLP, a final norm and an LM
head. It is cut with ``fpipe.stages.from_modules`` into embeddings / blocks / blocks / head,
using two small adapter modules; the weights are random (nothing is downloaded). The data is
sequences of an affine rule ``next = (a * token + b) % vocab``, so the loss goes down as the
model learns it. Prints a progress bar (tqdm), then the loss of the trained module's own forward.
"""

from __future__ import annotations

import argparse

import optree
import torch
import torch.nn.functional as F
from tokens import next_token_loss, synthetic_batch
from torch import nn
from tqdm import tqdm
from workers import fit

import fpipe
from fpipe.schedules import gpipe, one_f_one_b
from fpipe.stages import from_modules, load_into


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (part.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int,
                 tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:  # GPT-2's way: the LM head is the token embedding (a tie across two stages)
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Embeddings(nn.Module):
    """Adapter: the GPT's first step as a module, over the GPT's own embedding layers."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class LMHead(nn.Module):
    """Adapter: the GPT's last step, final norm then logits."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.norm, self.head = gpt.norm, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def cut(gpt: GPT) -> list[nn.Module]:
    """Embeddings / first half of the blocks / second half / head: one module per stage."""
    half = len(gpt.blocks) // 2
    return [Embeddings(gpt), nn.Sequential(*gpt.blocks[:half]),
            nn.Sequential(*gpt.blocks[half:]), LMHead(gpt)]


def main(argv: list[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    vocab, length, batch = 64, 32, 32
    gpt = GPT(vocab, context=length, width=64, depth=4, heads=4)
    modules = cut(gpt)
    s = from_modules(modules, stateful=False)  # no buffers: stages are (params, x) -> y
    optimizer = torch.optim.Adam(optree.tree_leaves(s.params), lr=args.lr)
    make = gpipe if args.schedule == "gpipe" else one_f_one_b

    with fpipe.pipeline(s.stages, s.params, schedule=fit(make(chunks=args.chunks), len(s.stages)),
                        loss_fn=next_token_loss) as pipe:
        size = sum(t.numel() for t in optree.tree_leaves(s.params))
        print(f"a GPT of {size} parameters in {len(s.stages)} stages "
              f"(embeddings / blocks / blocks / head); the program each worker runs:")
        print(pipe.program)
        first = None
        for _ in (bar := tqdm(range(args.steps), desc="training")):
            ids, targets = synthetic_batch(batch, length, vocab)
            loss, grads = pipe.value_and_grad(ids, targets)
            fpipe.optim.bind_grads(s.params, grads)
            optimizer.step()
            first = loss.item() if first is None else first
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)

    load_into(modules, s.params)  # the adapters hold the GPT's own layers: this updates `gpt`
    ids, targets = synthetic_batch(batch, length, vocab)
    with torch.no_grad():
        trained = next_token_loss(gpt(ids), targets).item()
    print(f"loss {first:.4f} -> {loss.item():.4f}; the trained GPT's own forward: {trained:.4f}")
    return first, trained


if __name__ == "__main__":
    main()
