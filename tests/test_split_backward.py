"""The split backward: its two halves sum to the fused vjp, and split the arithmetic."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fpipe._runtime.split_backward import split_vjp

DOUBLE = {"dtype": torch.float64}


def mlp(params, inputs):
    h = inputs[0]
    for i in range(0, len(params), 2):
        h = h + torch.tanh(F.linear(h, params[i], params[i + 1]))
    return [h]


def tied(params, inputs):
    """One weight used by two matmuls: the parameter branch is shared."""
    h = torch.relu(inputs[0] @ params[0])
    return [h @ params[0] + params[1]]


def twice_transposed(params, inputs):
    """One weight used twice through separate transposes: each use has its own branch."""
    return [torch.relu(inputs[0] @ params[0].t()) @ params[0].t()]


def param_only_output(params, inputs):
    """A second output that depends on the parameters alone."""
    return [inputs[0] * params[0], (params[0] * params[1]).sum().expand(3).contiguous()]


def unused(params, inputs):
    """One parameter and one input reach nothing."""
    return [inputs[0] * 2 + params[0].sum()]


def conv_norm(params, inputs):
    y = F.conv2d(inputs[0], params[0], params[1], padding=1)
    y = F.batch_norm(y, None, None, params[2], params[3], training=True)
    return [F.layer_norm(y, y.shape[1:]) * 2]


def no_inputs(params, inputs):
    return [params[0].sum() * torch.ones(3, **DOUBLE)]


CASES = {
    "mlp": (mlp, [(8, 8), (8,), (8, 8), (8,)], [(5, 8)]),
    "tied": (tied, [(8, 8), (8,)], [(5, 8)]),
    "twice_transposed": (twice_transposed, [(8, 8)], [(5, 8)]),
    "param_only_output": (param_only_output, [(8,), (8,)], [(5, 8)]),
    "unused": (unused, [(8,), (3,)], [(5, 8), (2,)]),
    "conv_norm": (conv_norm, [(4, 3, 3, 3), (4,), (4,), (4,)], [(2, 3, 5, 5)]),
    "no_inputs": (no_inputs, [(4,)], []),
}


def fused(fn, params, inputs, cotangents):
    """One backward: ``None`` for a parameter no output uses (it gets no ``.grad``, as in
    PyTorch), zeros for such an input (its cotangent goes on to the stage before)."""
    params = [p.detach().requires_grad_() for p in params]
    inputs = [x.detach().requires_grad_() for x in inputs]
    grads = torch.autograd.grad(fn(params, inputs), params + inputs, cotangents,
                                allow_unused=True)
    n = len(params)
    return (*grads[:n], *(torch.zeros_like(x) if g is None else g
                          for g, x in zip(grads[n:], inputs)))


@pytest.mark.parametrize("name", sorted(CASES))
@given(seed=st.integers(0, 2**16))
def test_halves_equal_the_fused_vjp(name, seed):
    fn, param_shapes, input_shapes = CASES[name]
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator, **DOUBLE) for s in param_shapes]
    inputs = [torch.randn(s, generator=generator, **DOUBLE) for s in input_shapes]
    outs, backward = split_vjp(fn, params, inputs)
    cotangents = [torch.randn(o.shape, generator=generator, **DOUBLE) for o in outs]
    input_grads = backward.input_grads(cotangents)
    weight_grads = backward.weight_grads()
    expected = fused(fn, params, inputs, cotangents)
    assert len(weight_grads) == len(params) and len(input_grads) == len(inputs)
    for got, want in zip(weight_grads + input_grads, expected):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for out, want in zip(outs, fn(params, inputs)):
        assert not out.requires_grad
        torch.testing.assert_close(out, want, rtol=0, atol=0)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_each_matmul_of_the_backward_runs_once_across_the_halves():
    """A stack of L linear layers: the fused backward runs 2L matmuls; I runs the L input
    matmuls and W the L weight matmuls, so the split repeats no arithmetic."""
    layers = 4
    params = [t for _ in range(layers) for t in (torch.randn(8, 8), torch.randn(8))]
    calls = []

    def counted(params, inputs):
        calls.append(1)
        return mlp(params, inputs)

    outs, backward = split_vjp(counted, params, [torch.randn(5, 8)])
    with CountMatmuls() as during_input:
        backward.input_grads([torch.ones_like(outs[0])])
    with CountMatmuls() as during_weight:
        backward.weight_grads()
    assert (during_input.count, during_weight.count) == (layers, layers)
    assert len(calls) == 1


def test_weight_half_needs_the_input_half_first():
    outs, backward = split_vjp(mlp, [torch.randn(4, 4), torch.randn(4)], [torch.randn(2, 4)])
    with pytest.raises(RuntimeError, match="input_grads"):
        backward.weight_grads()
