"""Stages with state: threaded through the forwards in micro-batch order, untouched by
recomputes, returned once per mini-batch."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from models import TIGHT, assert_trees_close, block, mlp_params, mse
from torch.func import functional_call, grad_and_value

import fpipe
from fpipe import PlacementError
from fpipe.schedules import Program, gpipe, one_f_one_b


def counting(p, state, x):
    """A block that counts the samples it has seen and sums its inputs."""
    y = block(p, x)
    return y, {"seen": state["seen"] + x.shape[0], "total": state["total"] + x.sum(0),
               "recomputes": state["recomputes"] + int(fpipe.is_recomputing())}


def fresh_state(n_stages, width=8):
    return [{"seen": 0, "total": torch.zeros(width, dtype=torch.float64), "recomputes": 0}
            for _ in range(n_stages)]


@pytest.mark.parametrize("schedule", [gpipe(chunks=4), gpipe(chunks=4, remat="always"),
                                      one_f_one_b(chunks=3, remat="always")])
def test_state_threads_through_microbatches_once(schedule):
    params = mlp_params(3)
    x, target = torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64)
    with fpipe.pipeline([counting] * 3, params, schedule=schedule, loss_fn=mse,
                        state=fresh_state(3)) as pipe:
        assert pipe.stateful
        loss, grads, state = pipe.value_and_grad(x, target)
        _, _, twice = pipe.value_and_grad(x, target, state=state)
        y, after_inference = pipe(x, state=state)
    h = x
    for s in range(3):
        assert state[s]["seen"] == 10 and twice[s]["seen"] == 20
        assert state[s]["recomputes"] == 0  # a recompute's new state is dropped
        torch.testing.assert_close(state[s]["total"], h.sum(0))
        torch.testing.assert_close(twice[s]["total"], 2 * h.sum(0))
        torch.testing.assert_close(after_inference[s]["total"], 2 * h.sum(0))
        h = block(params[s], h)
    torch.testing.assert_close(y, h)


def test_is_recomputing_only_inside_a_recompute():
    seen = []

    def watching(p, x):
        seen.append(fpipe.is_recomputing())
        return block(p, x)

    with fpipe.pipeline([watching] * 2, mlp_params(2), schedule=gpipe(chunks=2, remat="always"),
                        loss_fn=mse) as pipe:
        pipe.value_and_grad(torch.randn(4, 8, dtype=torch.float64),
                            torch.randn(4, 8, dtype=torch.float64))
    assert sorted(seen) == [False] * 4 + [True] * 4
    assert not fpipe.is_recomputing()


def batchnorm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Tanh()).double()


def module_stage(module):
    def stage(p, state, x):
        new = {k: v.clone() for k, v in state.items()}
        return functional_call(module, (p, new), (x,)), new
    return stage


@pytest.mark.parametrize("remat", ["always", "never"])
def test_batchnorm_matches_the_plain_module_run_per_microbatch(remat):
    """Plain BatchNorm in a pipeline: normalised per micro-batch, one running-statistics update
    per micro-batch in order, the same as the plain module fed the micro-batches one by one."""
    modules = [batchnorm_model(), batchnorm_model()]
    params = [{k: v.detach() for k, v in m.named_parameters()} for m in modules]
    state = [{k: v.detach().clone() for k, v in m.named_buffers()} for m in modules]
    x, target = torch.randn(9, 8, dtype=torch.float64), torch.randn(9, 8, dtype=torch.float64)
    chunks = 3

    def reference(ps):
        bufs = [dict(s) for s in state]
        total = 0.0
        for xm, tm in zip(x.tensor_split(chunks), target.tensor_split(chunks)):
            h = xm
            for m, p, b in zip(modules, ps, bufs):
                b2 = {k: v.clone() for k, v in b.items()}
                h = functional_call(m, (p, b2), (h,))
                b.update(b2)
            total = total + mse(h, tm) * xm.shape[0] / x.shape[0]
        return total, bufs

    (expected_grads, (expected_loss, expected_state)) = grad_and_value(
        reference, has_aux=True)(params)
    with fpipe.pipeline([module_stage(m) for m in modules], params, state=state,
                        schedule=gpipe(chunks=chunks, remat=remat), loss_fn=mse) as pipe:
        loss, grads, new_state = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss)
    for a, e in zip(optree.tree_leaves(grads), optree.tree_leaves(expected_grads)):
        torch.testing.assert_close(a, e)
    for s in range(2):
        assert new_state[s]["1.num_batches_tracked"] == chunks
        for name in ("1.running_mean", "1.running_var"):
            torch.testing.assert_close(new_state[s][name], expected_state[s][name])
            assert not torch.equal(new_state[s][name], state[s][name])  # the input is unchanged


@pytest.mark.parametrize("schedule", [gpipe(chunks=3, remat="always"),
                                      gpipe(chunks=3, remat="except_last"),
                                      gpipe(chunks=3, remat="never"),
                                      one_f_one_b(chunks=3, remat="always")])
def test_module_stages_update_running_stats_as_plain_pytorch_and_leave_the_callers(schedule):
    """Stages cut from a model with BatchNorm (``from_sequential``): the step's own running
    statistics are updated where they are (no copy) once the step made them, never the
    caller's nor those a forward keeps for its recompute. The new state equals the plain
    model fed the micro-batches one by one; the caller's buffers are bitwise as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).double()
    s = fpipe.stages.from_sequential(model, [3, 2], stateful=True)
    given = [{k: v.clone() for k, v in st.items()} for st in s.state]
    x, target = torch.randn(9, 8, dtype=torch.float64), torch.randn(9, 8, dtype=torch.float64)
    plain = copy.deepcopy(model)
    for xm in x.tensor_split(3):
        plain(xm)
    expected = dict(plain.named_buffers())
    with fpipe.pipeline(s.stages, s.params, state=s.state, schedule=schedule,
                        loss_fn=mse) as pipe:
        _, _, new_state = pipe.value_and_grad(x, target)
    for before, now in zip(given, s.state):
        assert all(torch.equal(before[k], now[k]) for k in before)
    for stage, st in enumerate(s.state):  # (stages keep the model's names here)
        assert sorted(st) == sorted(f"{3 * stage + 1}.{b}" for b in (
            "running_mean", "running_var", "num_batches_tracked"))
        for name in st:
            torch.testing.assert_close(new_state[stage][name], expected[name], rtol=0,
                                       atol=1e-15)


class _Scaled(torch.nn.Module):
    """A buffer the forward multiplies in place, then uses where autograd saves it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(1.5)
        return x * self.scale


@pytest.mark.parametrize("remat", ["never", "except_last"])
def test_a_buffer_other_than_running_stats_is_copied_for_every_micro_batch(remat):
    """Only normalisation statistics are updated where they are: another buffer that a call
    saves for its backward and the next call writes is copied for each micro-batch (updated in
    place, the first micro-batch's backward would read the third's value, or fail)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Scaled()).double()
    s = fpipe.stages.from_sequential(model, [1, 1], stateful=True)
    x, target = torch.randn(9, 8, dtype=torch.float64), torch.randn(9, 8, dtype=torch.float64)

    def reference(p):
        total, scale = 0.0, torch.ones(8, dtype=torch.float64)
        for xm, tm in zip(x.tensor_split(3), target.tensor_split(3)):
            scale = scale * 1.5
            local = {name.split(".", 1)[1]: t for name, t in p.items()}  # "0.weight" ->
            total = total + mse(functional_call(model[0], local, (xm,)) * scale, tm) * len(xm) / 9
        return total

    expected_loss = reference(s.params[0])
    expected = torch.func.grad(reference)(s.params[0])
    with fpipe.pipeline(s.stages, s.params, state=s.state, schedule=gpipe(chunks=3, remat=remat),
                        loss_fn=mse) as pipe:
        loss, grads, new_state = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=0)
    assert_trees_close(grads[0], expected)
    torch.testing.assert_close(new_state[1]["1.scale"],
                               torch.full((8,), 1.5 ** 3, dtype=torch.float64))


def test_state_needs_forwards_in_microbatch_order():
    program = Program([["0F1", "0F0", "0B0", "0B1"]], n_stages=1, n_microbatches=2)
    with pytest.raises(ValueError, match="micro-batch order.*runs 0F0 after 0F1"):
        fpipe.pipeline([counting], mlp_params(1), schedule=program, state=fresh_state(1))


def test_state_errors():
    with pytest.raises(ValueError, match="2 stages but 1 state pytrees"):
        fpipe.pipeline([counting] * 2, mlp_params(2), schedule=gpipe(chunks=1),
                       state=fresh_state(1))
    state = fresh_state(2)
    state[1]["total"] = torch.zeros(8, device="meta")
    with pytest.raises(PlacementError, match=r"state tensor state\[1\]\['total'\] is on meta"):
        fpipe.pipeline([counting] * 2, mlp_params(2), schedule=gpipe(chunks=1), state=state)
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=1)) as pipe:
        with pytest.raises(ValueError, match="this pipeline has no state"):
            pipe(torch.randn(2, 8, dtype=torch.float64), state=fresh_state(2))

    def stateless_shape(p, state, x):
        return block(p, x)
    with fpipe.pipeline([stateless_shape], mlp_params(1), schedule=gpipe(chunks=1),
                        state=fresh_state(1)) as pipe:
        with pytest.raises(fpipe.StageError, match=r"must return \(y, new_state\)"):
            pipe(torch.randn(2, 8, dtype=torch.float64))


# --- A state the output depends on, against a hand-written loop -------------------------------


def shifted(p, state, x):
    """A block whose pre-activation is shifted by its state, a running mean of its inputs:
    the output, and so a recompute's vjp, depends on which state the call is given."""
    y = torch.tanh(x @ p["w"] + p["b"] + state["c"])
    return y, {"c": 0.5 * state["c"] + 0.5 * x.detach().mean(0), "calls": state["calls"] + 1}


def shifted_reference(params, state, x, target, chunks):
    """One step in plain autograd, micro-batch by micro-batch: (loss, grads, new state)."""
    leaves = [{k: v.detach().clone().requires_grad_() for k, v in p.items()} for p in params]
    state = [dict(s) for s in state]
    loss = 0.0
    for xm, tm in zip(x.tensor_split(chunks), target.tensor_split(chunks)):
        h = xm
        for p, s in zip(leaves, state):
            h_in = h
            h = torch.tanh(h_in @ p["w"] + p["b"] + s["c"])
            s["c"], s["calls"] = 0.5 * s["c"] + 0.5 * h_in.detach().mean(0), s["calls"] + 1
        loss = loss + mse(h, tm) * xm.shape[0] / x.shape[0]
    loss.backward()
    return loss.detach(), [{k: v.grad for k, v in p.items()} for p in leaves], state


@pytest.mark.parametrize("remat", ["always", "except_last", "never"])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_a_state_the_output_uses_matches_a_hand_written_loop(make, remat):
    """A recompute must see the state its forward saw (not the state after it): checked under
    every remat policy, for two steps, against plain autograd looping over micro-batches."""
    n_stages, chunks = 3, 4
    params = mlp_params(n_stages)
    gen = torch.Generator().manual_seed(2)
    state = [{"c": torch.randn(8, dtype=torch.float64, generator=gen), "calls": 0}
             for _ in range(n_stages)]
    x = torch.randn(10, 8, dtype=torch.float64, generator=gen)  # uneven: 3, 3, 2, 2
    target = torch.randn(10, 8, dtype=torch.float64, generator=gen)
    expected_state = state
    with fpipe.pipeline([shifted] * n_stages, params, schedule=make(chunks, remat=remat),
                        loss_fn=mse, state=state) as pipe:
        for _ in range(2):
            expected_loss, expected_grads, expected_state = shifted_reference(
                params, expected_state, x, target, chunks)
            loss, grads, state = pipe.value_and_grad(x, target, state=state)
            torch.testing.assert_close(loss, expected_loss, **TIGHT)
            assert_trees_close(grads, expected_grads)
            for got, want in zip(state, expected_state):
                assert got["calls"] == want["calls"]
                torch.testing.assert_close(got["c"], want["c"], **TIGHT)
    assert state[0]["calls"] == 2 * chunks
