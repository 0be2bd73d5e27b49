"""Forward-mode dual tensors (``torch.autograd.forward_ad``) are refused wherever a call is given
one: in the input, the target, the parameters, the state or a vjp's cotangent, at any depth of
a dict or a tuple, in every face. A tangent would reach only what it touches on the caller's
side (a dual target gives the loss a tangent that misses every stage) and is lost between
ranks: a silently wrong result. Each refusal names where the dual tensor is; the pipeline works
afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from distributed_ranks import spawn
from models import block, mlp_params, mse
from torch import nn

import fpipe
import fpipe.distributed as fdist
from fpipe.schedules import colocate, gpipe

#: How a tensor is put in a container, and taken out.
BOXES = {"dict": (lambda t: {"a": t}, lambda v: v["a"]),
         "tuple": (lambda t: (t,), lambda v: v[0])}


def boxed(kind: str) -> tuple:
    """A stage, a loss and parameters whose every value is in a ``kind`` container."""
    box, unbox = BOXES[kind]

    def stage(p, x):
        return box(block(unbox(p), unbox(x)))

    def loss_fn(y, t):
        return mse(unbox(y), unbox(t))

    return stage, loss_fn, [box(p) for p in mlp_params(2)]


def dual(t: torch.Tensor) -> torch.Tensor:
    return fwAD.make_dual(t, torch.ones_like(t))


def with_dual_weight(params: list, kind: str) -> list:
    box, unbox = BOXES[kind]
    first = dict(unbox(params[0]))
    first["w"] = dual(first["w"])
    return [box(first), *params[1:]]


#: Each call, given ``(pipe, params, kind, x, target)`` under a dual level, and where its dual
#: tensor is.
CALLS = {
    "pipe(x), input": ("input", lambda pipe, ps, k, x, t: pipe(BOXES[k][0](dual(x)))),
    "pipe(x), params": ("params", lambda pipe, ps, k, x, t: pipe(
        BOXES[k][0](x), params=with_dual_weight(ps, k))),
    "value_and_grad, input": ("input", lambda pipe, ps, k, x, t: pipe.value_and_grad(
        BOXES[k][0](dual(x)), BOXES[k][0](t))),
    "value_and_grad, target": ("target", lambda pipe, ps, k, x, t: pipe.value_and_grad(
        BOXES[k][0](x), BOXES[k][0](dual(t)))),
    "value_and_grad, params": ("params", lambda pipe, ps, k, x, t: pipe.value_and_grad(
        BOXES[k][0](x), BOXES[k][0](t), params=with_dual_weight(ps, k))),
    "vjp, input": ("input", lambda pipe, ps, k, x, t: pipe.vjp(BOXES[k][0](dual(x)))),
    "vjp_fn, cotangent": ("cotangent", lambda pipe, ps, k, x, t: pipe.vjp(BOXES[k][0](x))[1](
        BOXES[k][0](dual(torch.ones_like(x))))),
}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(4, 8, generator=g, dtype=torch.float64),
            torch.randn(4, 8, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("kind", list(BOXES))
@pytest.mark.parametrize("call", list(CALLS))
def test_a_dual_tensor_anywhere_in_a_call_is_refused_naming_where(call, kind):
    stage, loss_fn, params = boxed(kind)
    x, target = data()
    where, run = CALLS[call]
    with fpipe.pipeline([stage] * 2, params, schedule=gpipe(chunks=2), loss_fn=loss_fn) as pipe:
        with fwAD.dual_level(), pytest.raises(
                RuntimeError, match=rf"under torch.autograd.forward_ad \(a dual tensor in its "
                                    rf"{where}\)"):
            run(pipe, params, kind, x, target)
        # nothing was kept: the pipeline gives torch.func's gradients afterwards
        box, unbox = BOXES[kind]
        loss, grads = pipe.value_and_grad(box(x), box(target))
    expected = torch.func.grad(lambda ps: loss_fn(stage(ps[1], stage(ps[0], box(x))),
                                                  box(target)))(params)
    torch.testing.assert_close(unbox(grads[0])["w"], unbox(expected[0])["w"], rtol=1e-12,
                               atol=1e-12)


def test_a_dual_target_would_give_the_loss_a_wrong_tangent():
    """Why a dual target is refused: the true tangent of the loss with respect to the target,
    against what the pipeline's loss would carry (the tangent of its last micro-batch's term
    alone, seen through ``loss_fn``'s own weighting)."""
    stage, loss_fn, params = boxed("dict")
    x, target = data()
    with fwAD.dual_level():
        t = dual(target)
        y = stage(params[1], stage(params[0], {"a": x}))
        true = fwAD.unpack_dual(loss_fn(y, {"a": t})).tangent
        assert true is not None and true.item() != 0
        with fpipe.pipeline([stage] * 2, params, schedule=gpipe(chunks=2),
                            loss_fn=loss_fn) as pipe, pytest.raises(RuntimeError,
                                                                    match="in its target"):
            pipe.value_and_grad({"a": x}, {"a": t})


def gpipe_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()


class First(nn.Module):
    """Takes the first tensor of a tuple (GPipe takes tensors and tuples of them)."""

    def forward(self, x):
        return x[0] if isinstance(x, tuple) else x


@pytest.mark.parametrize("where", ["input", "params"])
def test_gpipe_refuses_a_dual_tensor_in_a_tuple_input_or_in_its_parameters(where):
    piped = fpipe.GPipe(nn.Sequential(First(), *gpipe_model()), balance=[2, 2], chunks=2)
    x = data()[0]
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=rf"fpipe.GPipe's forward was called "
                                                              rf"under .*forward_ad \(a dual "
                                                              rf"tensor in its {where}\)"):
        if where == "input":
            piped((x, dual(x)))
        else:  # the module's parameters swapped for duals, as torch.func.functional_call does
            params = {k: v.detach() for k, v in piped.named_parameters()}
            params["partitions.0.1.weight"] = dual(params["partitions.0.1.weight"])
            torch.func.functional_call(piped, params, ((x, x),))


# -- a distributed pipeline -------------------------------------------------------------------

def dual_ranks(rank: int, world: int) -> dict:
    """One rank holding both stages: each call of :data:`CALLS` with a dual tensor in a dict
    and in a tuple; what each raised, then a training step that runs."""
    refused: dict = {}
    for kind in BOXES:
        stage, loss_fn, params = boxed(kind)
        x, target = data()
        schedule = colocate(gpipe(chunks=2), [0, 0])
        with fdist.pipeline([stage] * 2, dict(enumerate(params)), schedule=schedule,
                            loss_fn=loss_fn, timeout=60) as pipe:
            box = BOXES[kind][0]
            for call, (_, run) in CALLS.items():
                vjp_fn = None
                with fwAD.dual_level():
                    try:
                        if call == "vjp_fn, cotangent":  # kept, to finish the step below
                            _, vjp_fn = pipe.vjp(box(x))
                            vjp_fn(box(dual(torch.ones_like(x))))
                        else:
                            run(_Keyed(pipe), params, kind, x, target)
                        refused[call, kind] = None
                    except RuntimeError as exc:
                        refused[call, kind] = str(exc)
                if vjp_fn is not None:  # refused before it ran: it takes a plain cotangent
                    vjp_fn(box(torch.ones_like(x)))
            loss, _ = pipe.value_and_grad(BOXES[kind][0](x), BOXES[kind][0](target))
            refused["loss", kind] = float(loss)
    return refused


class _Keyed:
    """A distributed pipeline called as :data:`CALLS` calls a local one (``params=`` a list)."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe

    def __call__(self, x, params=None):
        return self.pipe(x, params=None if params is None else dict(enumerate(params)))

    def value_and_grad(self, x, target, params=None):
        return self.pipe.value_and_grad(
            x, target, params=None if params is None else dict(enumerate(params)))

    def vjp(self, x):
        return self.pipe.vjp(x)


def test_a_distributed_pipeline_refuses_a_dual_tensor_anywhere_naming_where():
    results, codes = spawn("test_dual:dual_ranks", 1, timeout=120)
    assert codes == [0], results
    result = results[0]
    assert "crash" not in result, result.get("crash")
    for kind in BOXES:
        for call, (where, _) in CALLS.items():
            message = result[call, kind]
            assert message is not None, (call, kind)
            assert f"under torch.autograd.forward_ad (a dual tensor in its {where})" in message
        stage, loss_fn, params = boxed(kind)
        x, target = data()
        box, _ = BOXES[kind]
        expected = loss_fn(stage(params[1], stage(params[0], box(x))), box(target))
        assert result["loss", kind] == pytest.approx(expected.item(), rel=1e-12, abs=1e-12)
