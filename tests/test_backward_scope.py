"""What a step's backward reaches, and what a call leaves in the caller's thread.

A stage's accumulating backward names its leaves to autograd only where it must: when its
graph ends in the call's own leaves (checked once per input signature), naming them would
only make autograd walk the whole graph first, at every backward. Where the graph reaches
anything else (a tensor the call was given but does not differentiate, the caller's history),
the leaves are named, so that nothing of the caller's gets a gradient. And the entry check for
``torch.func`` transforms does not create functorch's per-thread state, which every autograd
node run in that thread would then copy.
"""

from __future__ import annotations

import pytest
import torch
from models import block, mlp_params, mse
from torch import nn

import fpipe
from fpipe._runtime import engine, vjp
from fpipe._runtime.given import closed_over
from fpipe.schedules import gpipe, one_f_one_b


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_closed_over_a_graph_of_the_given_leaves_alone():
    w, x = _leaf(3, 3), _leaf(2, 3)
    y = torch.tanh(x @ w).sum(0)
    assert closed_over([y], [w, x])


def test_not_closed_over_a_leaf_left_out():
    w, x, other = _leaf(3, 3), _leaf(2, 3), _leaf(3)
    y = torch.tanh(x @ w + other)
    assert not closed_over([y], [w, x])
    assert closed_over([y], [w, x, other])


def test_not_closed_over_a_given_tensor_with_a_history():
    w, source = _leaf(3, 3), _leaf(2, 3)
    x = source * 2.0  # given with a history of the caller's
    y = x @ w
    assert not closed_over([y], [w, x])


def test_a_constant_is_no_leaf():
    w = _leaf(3, 3)
    y = w @ torch.ones(3, dtype=torch.float64)
    assert closed_over([y], [w])


class _Backwards:
    """Records how many leaves each accumulating backward named."""

    def __init__(self, monkeypatch):
        self.named: list[int] = []
        real = vjp.run_backward

        def spy(outs, cotangents, inputs, accumulate=False, keep_graph=False):
            if accumulate:
                self.named.append(len(inputs))
            return real(outs, cotangents, inputs, accumulate, keep_graph)

        monkeypatch.setattr(vjp, "run_backward", spy)


@pytest.mark.parametrize("schedule", [gpipe(chunks=4), one_f_one_b(chunks=4, remat="always")])
def test_a_closed_graph_leaves_its_leaves_unnamed_with_the_same_gradients(monkeypatch, schedule):
    params = mlp_params(2)
    x, target = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    with fpipe.pipeline([block, block], params, schedule=schedule, loss_fn=mse) as pipe:
        _, before = pipe.value_and_grad(x, target)
        backwards = _Backwards(monkeypatch)
        loss, grads = pipe.value_and_grad(x, target)
    # Every backward of the second step runs on a signature found closed in the first.
    assert backwards.named and set(backwards.named) == {0}
    expected = torch.func.grad(lambda q: mse(block(q[1], block(q[0], x)), target))(params)
    for got, first, want in zip(grads, before, expected):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14)
            assert torch.equal(got[name], first[name])


def test_an_input_with_the_callers_history_keeps_its_gradient_to_itself(monkeypatch):
    """A loss step does not differentiate its input. Given one without history first, the
    first stage's graph is found closed; given the same shapes with the caller's history
    next, its backwards name their leaves again, and the caller's leaf gets no gradient."""
    params = mlp_params(2)
    source = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randn(12, 8, dtype=torch.float64)
    with fpipe.pipeline([block, block], params, schedule=gpipe(chunks=4), loss_fn=mse) as pipe:
        pipe.value_and_grad(source.detach(), target)
        backwards = _Backwards(monkeypatch)
        _, grads = pipe.value_and_grad(source * 1.0, target)
    assert source.grad is None
    # stage 1's backwards name nothing (closed); stage 0's name its two leaves, w and b
    assert sorted(backwards.named) == [0, 0, 0, 0, 2, 2, 2, 2]
    x = source.detach()
    expected = torch.func.grad(lambda q: mse(block(q[1], block(q[0], x)), target))(params)
    torch.testing.assert_close(grads[0]["w"], expected[0]["w"], rtol=1e-12, atol=1e-14)


def _scaled(p, state, x):
    """A block scaled by a state tensor that requires grad (given, never differentiated)."""
    return block(p, x) * state["scale"], state


def test_a_state_tensor_that_requires_grad_gets_no_gradient(monkeypatch):
    params = mlp_params(2)
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    x, target = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    with fpipe.pipeline([_scaled, _scaled], params, schedule=gpipe(chunks=4), loss_fn=mse,
                        state=[{"scale": scale}, {"scale": scale}]) as pipe:
        backwards = _Backwards(monkeypatch)
        for _ in range(2):
            pipe.value_and_grad(x, target)
    assert scale.grad is None
    assert backwards.named and 0 not in backwards.named


def test_gpipe_trains_as_plain_pytorch_with_unnamed_leaves(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()
    plain = nn.Sequential(*[layer for layer in _copied(model)])
    piped = fpipe.GPipe(model, balance=[2, 2], chunks=1)
    x = torch.randn(8, 6, dtype=torch.float64)
    backwards = _Backwards(monkeypatch)
    for _ in range(2):
        piped(x).square().sum().backward()
        plain(x).square().sum().backward()
    assert 0 in backwards.named
    for (name, p), q in zip(piped.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def _copied(module: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(module)


def test_the_transform_check_leaves_functorch_state_alone(monkeypatch):
    """Outside a transform the entry check never peeks at functorch's interpreter stack (the
    peek creates the thread's functorch state); under one it still refuses."""
    peeks: list[bool] = []
    real = engine._peek_interpreter

    def spy():
        peeks.append(True)
        return real()

    monkeypatch.setattr(engine, "_peek_interpreter", spy)
    params = mlp_params(2)
    x, target = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    with fpipe.pipeline([block, block], params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        pipe.value_and_grad(x, target)
        assert not peeks
        with pytest.raises(RuntimeError, match="under torch.func.grad"):
            torch.func.grad(lambda q: pipe.value_and_grad(x, target, params=q)[0])(params)
    assert peeks
