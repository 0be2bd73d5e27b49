"""Synthetic token data and the next-token loss, shared by the language-model examples."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_batch(batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences that follow ``next = (5 * token + 3) % vocab`` from a random start:
    inputs and the targets one token later."""
    tokens = [torch.randint(0, vocab, (batch,))]
    for _ in range(length):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    seq = torch.stack(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]
