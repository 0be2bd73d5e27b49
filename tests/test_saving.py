"""Checkpoints written by a 3-stage pipeline load into a 2-stage one and into the plain model,
with the optimiser's state: training goes on as if it had never stopped."""

from __future__ import annotations

import importlib.util

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpipe
from fpipe import saving
from fpipe.optim import bind_grads
from fpipe.schedules import gpipe
from fpipe.stages import from_sequential

FORMATS = ["torch", pytest.param("safetensors", marks=[pytest.mark.needs_extra, pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason="safetensors is not installed")])]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 12),
                         nn.Tanh(), nn.Linear(12, 3))


def train(s, optimizer, state, steps, seed):
    g = torch.Generator().manual_seed(seed)
    with fpipe.pipeline(s.stages, s.params, state=state, schedule=gpipe(chunks=2),
                        loss_fn=F.mse_loss) as pipe:
        for _ in range(steps):
            x, t = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            _, grads, state = pipe.value_and_grad(x, t, state=state)
            bind_grads(s.params, grads)
            optimizer.step()
    return state


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_loads_into_another_balance_and_the_plain_model(tmp_path, fmt):
    three = from_sequential(model(), [2, 2, 2])
    adam3 = torch.optim.Adam(optree.tree_leaves(three.params), lr=1e-2)
    state3 = train(three, adam3, three.state, steps=2, seed=1)
    saving.save(tmp_path, three.params, state3, optimizer=adam3, format=fmt)
    assert len(list(tmp_path.glob("stage-*"))) == len(list(tmp_path.glob("optimizer-*"))) == 3

    # Another balance: parameters, state and Adam's moments, found by name.
    two = from_sequential(model(), [3, 3])
    two = two._replace(params=saving.load(tmp_path, like=two.params),
                       state=saving.load(tmp_path, like=two.state))
    adam2 = torch.optim.Adam(optree.tree_leaves(two.params), lr=1e-2)
    saving.load_optimizer(tmp_path, adam2, two.params)

    # The plain model takes the flat dict as its state_dict, and computes what the 2-stage
    # pipeline computes (in one micro-batch, as BatchNorm sees the whole batch).
    plain = model()
    plain.load_state_dict(saving.load(tmp_path))
    x, t = torch.randn(8, 6), torch.randn(8, 3)
    expected = F.mse_loss(plain(x), t)
    expected.backward()
    with fpipe.pipeline(two.stages, two.params, state=two.state, schedule=gpipe(chunks=1),
                        loss_fn=F.mse_loss) as pipe:
        loss, grads, _ = pipe.value_and_grad(x, t)
    torch.testing.assert_close(loss, expected.detach())
    for part in grads:
        for name, grad in part.items():
            torch.testing.assert_close(grad, plain.get_parameter(name).grad)

    # One more step on each pipeline: the same parameters and statistics after it.
    state3 = train(three, adam3, state3, steps=1, seed=2)
    state2 = train(two, adam2, two.state, steps=1, seed=2)
    flat3 = {k: v for part in [*three.params, *state3] for k, v in part.items()}
    flat2 = {k: v for part in [*two.params, *state2] for k, v in part.items()}
    assert flat2.keys() == flat3.keys() == plain.state_dict().keys()
    for name, value in flat3.items():
        torch.testing.assert_close(flat2[name], value)


def test_names_clashing_across_stages_are_refused(tmp_path):
    params = [{"w": torch.zeros(2)}, {"w": torch.zeros(2)}]
    with pytest.raises(ValueError, match="'w'"):
        saving.save(tmp_path, params)
