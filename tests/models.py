"""Small models and a whole-batch reference for the pipeline tests."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import optree
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value

from fpipe.schedules import Program


def block(p, x):
    return torch.tanh(x @ p["w"] + p["b"])


class OnBackward(torch.autograd.Function):
    """The identity, whose backward first calls ``hook(grad)`` (to raise, record or sleep) and
    passes on what it returns, or the gradient itself when it returns ``None``:
    ``OnBackward.apply(x, hook)``."""

    @staticmethod
    def forward(x, hook):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.hook = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        out = ctx.hook(grad)
        return (grad if out is None else out), None


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
        return loss_fn(forward(stages, ps, x), target)
    grads, value = grad_and_value(loss)(params)
    return value, grads


def forward(stages, params, x):
    """The stages one after the other, skip connections passed by hand."""
    skips = {}
    h = x
    for stage, p in zip(stages, params):
        popped = getattr(stage, "pop", ())
        h = stage(p, h, {name: skips.pop(name) for name in popped}) if popped else stage(p, h)
        if getattr(stage, "stash", ()):
            h, stashed = h
            skips.update(stashed)
    return h


TIGHT = dict(rtol=1e-10, atol=1e-12)


def assert_trees_close(actual, expected, **tol):
    """Leaf by leaf; where a pipeline's gradient is None (a parameter no stage used), the
    reference (torch.func, which gives zeros there) must be zero."""
    spec = optree.tree_structure(expected, none_is_leaf=True)
    assert optree.tree_structure(actual, none_is_leaf=True).num_leaves == spec.num_leaves
    for a, e in zip(spec.flatten_up_to(actual), optree.tree_leaves(expected, none_is_leaf=True)):
        if a is None:
            assert e is None or not e.any(), "a gradient left None where the reference has one"
            continue
        assert e is not None
        assert a.device == e.device
        torch.testing.assert_close(a, e, **(tol or TIGHT))



def two_stages_per_worker(chunks: int) -> Program:
    """Four stages on two workers, looped: worker 0 holds stages 0 and 2, worker 1 holds 1, 3."""
    workers = []
    for first, second in ((0, 2), (1, 3)):
        actions = [f"{first}F{m}" for m in range(chunks)]
        actions += [f"{second}F{m}" for m in range(chunks)]
        actions += [f"{second}B{m}" for m in reversed(range(chunks))]
        actions += [f"{first}B{m}" for m in reversed(range(chunks))]
        workers.append(actions)
    return Program(workers, n_stages=4, n_microbatches=chunks)


def fpipe_workers() -> set[threading.Thread]:
    """fpipe's own live worker threads (named ``fpipe-worker-*``). Tests compare these sets,
    never the process's thread count, which other libraries and test runners change."""
    return {t for t in threading.enumerate() if t.name.startswith("fpipe-worker-")}


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """Import ``examples/<name>.py`` as running it would (``examples/`` on ``sys.path``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


class TiedEmbed(nn.Module):
    """A stage over ``model.wte`` (as ``embed``): the first half of a tied embedding/head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.embed = model.wte

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class TiedHead(nn.Module):
    """A stage over ``model.lm_head`` (as ``head``): the other half."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.head = model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)
