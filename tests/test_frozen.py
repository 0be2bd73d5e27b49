"""Frozen and unused parameters stay put, and torch.func transforms over a pipeline are refused.

PyTorch's convention: a parameter with ``requires_grad=False`` is frozen (no ``.grad``, the
optimiser leaves it alone) and one the forward does not use gets no ``.grad`` either. fpipe
keeps both for ``nn.Parameter`` leaves (what ``from_modules`` and ``fpipe.GPipe`` pass), while
plain tensors are differentiated whatever their flag, as ``torch.func`` does. Every reference
here is plain PyTorch or ``torch.func`` on the whole batch, in float64.
"""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.distributed as dist
from distributed_ranks import data, spawn
from models import block, mlp_params, mse
from torch import nn

import fpipe
import fpipe.distributed as fdist
from fpipe.optim import bind_grads, clip_grad_norm, global_norm, sgd
from fpipe.schedules import gpipe, one_f_one_b, zero_bubble
from fpipe.stages import from_sequential

SCHEDULES = {"gpipe": gpipe(chunks=4), "gpipe-remat": gpipe(chunks=4, remat="always"),
             "1f1b": one_f_one_b(chunks=4), "zero-bubble": zero_bubble(chunks=4)}


class Unused(nn.Module):
    """A layer holding a weight its forward never reads (an unused head, a branch not taken)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.used = nn.Linear(width, width)
        self.unused = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(x))


def model(width: int = 6) -> nn.Sequential:
    """Four layers: the first frozen, the third with an unused weight."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(width, width), nn.Tanh(), Unused(width),
                           nn.Linear(width, width)).double()
    for p in layers[0].parameters():
        p.requires_grad_(False)
    return layers


def batch(n: int = 8, width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, width, generator=g, dtype=torch.float64),
            torch.randn(n, width, generator=g, dtype=torch.float64))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)


def plain_step(module: nn.Module, x, target) -> nn.Module:
    """One AdamW step of plain PyTorch (weight decay would move a weight with a zero .grad)."""
    module = copy.deepcopy(module)
    optimizer = adamw([p for p in module.parameters()])
    mse(module(x), target).backward()
    optimizer.step()
    return module


def names_and_values(module: nn.Module) -> dict:
    return {name: p.detach() for name, p in module.named_parameters()}


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_readme_recipe_on_a_model_with_frozen_and_unused_weights_is_plain_pytorchs(
        autodiff, schedule):
    layers, (x, target) = model(), batch()
    expected = names_and_values(plain_step(layers, x, target))
    s = from_sequential(layers, [2, 2], stateful=False)
    before = {k: v.clone() for part in s.params for k, v in part.items()}
    with fpipe.pipeline(s.stages, s.params, schedule=SCHEDULES[schedule], loss_fn=mse,
                        autodiff=autodiff) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    for frozen_or_unused in ("0.weight", "0.bias", "2.unused.weight", "2.unused.bias"):
        stage = 0 if frozen_or_unused.startswith("0") else 1
        assert grads[stage][frozen_or_unused] is None
    optimizer = adamw(optree.tree_leaves(s.params))
    bind_grads(s.params, grads)
    assert s.params[0]["0.weight"].grad is None and s.params[1]["2.unused.weight"].grad is None
    optimizer.step()
    got = {k: v for part in s.params for k, v in part.items()}
    for name in ("0.weight", "0.bias", "2.unused.weight", "2.unused.bias"):
        assert torch.equal(got[name], before[name]), name  # bitwise unchanged
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


def test_from_sequential_keeps_frozen_layers_frozen_parameters():
    s = from_sequential(model(), [2, 2], stateful=False)
    assert isinstance(s.params[0]["0.weight"], nn.Parameter)
    assert not s.params[0]["0.weight"].requires_grad
    trainable = s.params[1]["3.weight"]  # trainable: a Parameter requiring grad, as the model's
    assert isinstance(trainable, nn.Parameter) and trainable.requires_grad


def test_plain_tensors_follow_torch_func_and_a_frozen_parameter_is_explicit():
    """Raw pytrees: every floating-point leaf is differentiated whatever its requires_grad
    (torch.func's rule); nn.Parameter(t, requires_grad=False) is the way to freeze one."""
    params = mlp_params(2)
    x, target = data(8, 8, seed=3)
    reference = torch.func.grad(lambda ps: mse(block(ps[1], block(ps[0], x)), target))(params)
    params[0]["b"] = nn.Parameter(params[0]["b"], requires_grad=False)
    with fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        _, grads = pipe.value_and_grad(x, target)
    assert grads[0]["b"] is None
    torch.testing.assert_close(grads[0]["w"], reference[0]["w"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1]["b"], reference[1]["b"], rtol=1e-10, atol=1e-12)
    stepped = sgd(params, grads, 0.1)
    assert stepped[0]["b"] is params[0]["b"]  # the frozen leaf is kept, still frozen


def test_norm_and_clipping_skip_frozen_and_unused_leaves_as_torch_does():
    layers, (x, target) = model(), batch()
    plain = copy.deepcopy(layers)
    mse(plain(x), target).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    s = from_sequential(layers, [2, 2], stateful=False)
    with fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        _, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(global_norm(grads), expected, rtol=1e-10, atol=0)
    grads, norm = clip_grad_norm(grads, 0.05)
    torch.testing.assert_close(norm, expected, rtol=1e-10, atol=0)
    clipped = {k: g for part in grads for k, g in part.items()}
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert clipped[name] is None
        else:
            torch.testing.assert_close(clipped[name], p.grad, rtol=1e-10, atol=1e-14)


def test_a_tie_between_a_frozen_and_a_trained_copy_is_refused():
    w = torch.randn(4, 4, dtype=torch.float64)
    params = [{"w": nn.Parameter(w.clone(), requires_grad=False)}, {"w": w.clone()}]
    stage = lambda p, x: x @ p["w"]  # noqa: E731
    with pytest.raises(ValueError, match="one is frozen"):
        fpipe.pipeline([stage] * 2, params, schedule=gpipe(2), ties=[[(0, "w"), (1, "w")]])


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpipe_leaves_grad_none_for_frozen_and_unused_parameters_as_plain_pytorch(checkpoint):
    layers, (x, target) = model(), batch()
    expected = plain_step(layers, x, target)
    piped = fpipe.GPipe(copy.deepcopy(layers), balance=[2, 2], chunks=4, checkpoint=checkpoint)
    optimizer = adamw(piped.parameters())
    mse(piped(x), target).backward()
    plain = copy.deepcopy(layers)
    mse(plain(x), target).backward()
    for (name, p), (_, q) in zip(piped.named_parameters(), plain.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
    optimizer.step()
    for (name, p), q in zip(piped.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=name)


# -- torch.func transforms over a pipeline: the true result or an error, never zeros ----------

def _pipe() -> tuple:
    params = mlp_params(2)
    pipe = fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=2), loss_fn=mse)
    return pipe, params, data(4, 8, seed=5)


TRANSFORMS = {
    "grad over params": lambda pipe, p, x, t: torch.func.grad(
        lambda q: pipe(x, params=q).sum())(p),
    "vjp": lambda pipe, p, x, t: torch.func.vjp(pipe, x),
    "jvp": lambda pipe, p, x, t: torch.func.jvp(pipe, (x,), (torch.ones_like(x),)),
    "jacrev": lambda pipe, p, x, t: torch.func.jacrev(pipe)(x),
    "jacfwd": lambda pipe, p, x, t: torch.func.jacfwd(pipe)(x),
    "vmap": lambda pipe, p, x, t: torch.func.vmap(pipe)(x[:, None]),
    "grad of value_and_grad": lambda pipe, p, x, t: torch.func.grad(
        lambda q: pipe.value_and_grad(x, t, params=q)[0])(p),
    "vjp of pipe.vjp": lambda pipe, p, x, t: torch.func.vjp(lambda y: pipe.vjp(y)[0], x),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_torch_func_transform_over_a_pipeline_is_refused_naming_what_to_call(transform):
    pipe, params, (x, target) = _pipe()
    with pipe, pytest.raises(RuntimeError, match=r"value_and_grad.*vjp"):
        TRANSFORMS[transform](pipe, params, x, target)
    # and the pipeline still works afterwards, with torch.func's own answer
    loss, grads = pipe.value_and_grad(x, target)
    expected = torch.func.grad(lambda q: mse(block(q[1], block(q[0], x)), target))(params)
    torch.testing.assert_close(grads[0]["w"], expected[0]["w"], rtol=1e-10, atol=1e-12)


def test_forward_mode_dual_inputs_are_refused():
    pipe, _, (x, _) = _pipe()
    import torch.autograd.forward_ad as fwAD
    with pipe, fwAD.dual_level(), pytest.raises(RuntimeError, match="forward_ad"):
        pipe(fwAD.make_dual(x, torch.ones_like(x)))


def test_gpipe_under_torch_func_is_refused():
    piped = fpipe.GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double(), balance=[1, 1],
                        chunks=2)
    params = {k: v.detach() for k, v in piped.named_parameters()}
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="GPipe's forward was called under torch.func.grad"):
        torch.func.grad(lambda p: torch.func.functional_call(piped, p, (x,)).sum())(params)


def test_gpipe_backward_twice_double_backward_and_jacobian_are_clear_errors():
    piped = fpipe.GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double(), balance=[1, 1],
                        chunks=2, checkpoint="never")
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    loss = piped(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward has run already"):
        loss.backward()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(piped(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="backward has run already"):
        torch.autograd.functional.jacobian(piped, x)


# -- distributed: frozen leaves across ranks and replicas ---------------------------------------

def frozen_ranks(rank: int, world: int) -> dict:
    """(dp=2, pp=2) mesh, 1F1B: stage 0's bias frozen; one AdamW step per replica shard."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, worker = mesh.get_coordinate()
    schedule = one_f_one_b(chunks=2)
    held = fdist.my_stages(schedule, 2, mesh=mesh)
    full = _frozen_params()
    params = {s: full[s] for s in held}
    x, target = data(8, 8, seed=7)
    rows = slice(4 * replica, 4 * replica + 4)
    with fdist.pipeline([block] * 2, params, schedule=schedule, loss_fn=mse, mesh=mesh,
                        timeout=60) as pipe:
        loss, grads = pipe.value_and_grad(x[rows] if worker == 0 else None,
                                          target[rows] if worker == 1 else None)
        optimizer = adamw(optree.tree_leaves(params))
        bind_grads(params, grads)
        optimizer.step()
    dist.barrier()
    return {"loss": loss, "grads": grads, "params": params}


def _frozen_params() -> list:
    params = mlp_params(2)
    params[0]["b"] = nn.Parameter(params[0]["b"], requires_grad=False)
    return params


def test_frozen_leaves_stay_put_on_every_rank_of_a_dp_pp_mesh():
    results, codes = spawn("test_frozen:frozen_ranks", 4, timeout=240)
    assert codes == [0] * 4, results
    x, target = data(8, 8, seed=7)
    full = _frozen_params()
    reference = [{k: nn.Parameter(v.detach().clone(),
                                  requires_grad=not isinstance(v, nn.Parameter))
                  for k, v in part.items()} for part in full]
    mse(block(reference[1], block(reference[0], x)), target).backward()
    adamw([p for part in reference for p in part.values()]).step()
    for rank, result in enumerate(results):
        assert "crash" not in result, result["crash"]
        stage = rank % 2
        if stage == 0:
            assert result["grads"][0]["b"] is None
            assert torch.equal(result["params"][0]["b"], full[0]["b"])
        for name, value in result["params"][stage].items():
            torch.testing.assert_close(value.detach(), reference[stage][name].detach(),
                                       rtol=1e-10, atol=1e-12)
