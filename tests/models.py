"""Small models and a whole-batch reference for the pipeline tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import grad_and_value


def block(p, x):
    return torch.tanh(x @ p["w"] + p["b"])


def mlp_params(n_stages: int, width: int = 8, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(width, width, generator=g, dtype=dtype) * 0.5,
             "b": torch.randn(width, generator=g, dtype=dtype) * 0.1}
            for _ in range(n_stages)]


def mse(y, t):
    return F.mse_loss(y, t)


def whole_batch(stages, params, x, target, loss_fn):
    """Loss and gradients of the unpipelined model on the whole batch (``torch.func``)."""
    def loss(ps):
        h = x
        for stage, p in zip(stages, ps):
            h = stage(p, h)
        return loss_fn(h, target)
    grads, value = grad_and_value(loss)(params)
    return value, grads


def forward(stages, params, x):
    h = x
    for stage, p in zip(stages, params):
        h = stage(p, h)
    return h
