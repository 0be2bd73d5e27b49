"""Normalisation layers in a pipeline train as the plain module fed the micro-batches in order.

A step updates the running statistics of torch's own normalisation layers without copying
them, and its recomputes write scratch ones (``fpipe.stages.running``). Each case here is a
way that would go wrong if a layer were treated so where it must not be: a layer in
evaluation (its recompute reads its statistics), a hook or a subclass whose output reads them
(its recompute must see what its forward saw), a model whose dtype changes between steps (the
scratch must follow). Every case is compared with the plain module, gradients and buffers,
over two steps, under each checkpoint mode, through ``fpipe.GPipe`` and ``fpipe.pipeline``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fpipe
from fpipe import gpipe, one_f_one_b


class _Renorm(nn.BatchNorm1d):
    """A BatchNorm whose training output reads its running mean (as batch renormalisation
    does): a forward of its own, so a step must copy its statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = self.running_mean.clone()
        return super().forward(x) + before


def _add_running_mean(module: nn.Module, args: tuple, output: torch.Tensor):
    if isinstance(module, nn.BatchNorm1d):
        return output + module.running_mean  # read after the layer updated it
    return None


def _model(case: str) -> nn.Sequential:
    torch.manual_seed(0)
    norm = _Renorm if case == "subclass" else nn.BatchNorm1d
    model = nn.Sequential(nn.Linear(6, 8), norm(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Tanh(), nn.Linear(8, 3)).double()
    for m in model:
        if isinstance(m, nn.BatchNorm1d):  # statistics that differ from their defaults
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    if case == "frozen":
        model[1].eval()  # a frozen layer in a model in training
    if case == "hooked":
        model[4].register_forward_hook(_add_running_mean)
    return model


def _plain_step(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """The plain module fed the micro-batches one by one, one loss over the whole output."""
    y = torch.cat([model(xm) for xm in x.chunk(chunks)])
    (y.sin() * y).sum().backward()
    return y


def _batch(step: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(9, 6, dtype=dtype, generator=torch.Generator().manual_seed(step))


def _step_both(plain: nn.Module, piped: nn.Module, x: torch.Tensor,
               tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step of each on ``x`` (the plain module micro-batch by micro-batch),
    their gradients and buffers then compared; returns both outputs (piped's first)."""
    for m in (plain, piped):
        m.zero_grad()
    expected = _plain_step(plain, x, 3)
    y = piped(x)
    (y.sin() * y).sum().backward()
    _assert_same(plain, piped, tol)
    return y, expected


def _assert_same(plain: nn.Module, piped: nn.Module, tol: float) -> None:
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=tol, atol=tol, msg=name)
    for (name, b), c in zip(plain.named_buffers(), piped.buffers()):
        torch.testing.assert_close(c, b, rtol=tol, atol=tol, msg=name)


CASES = ["plain", "frozen", "hooked", "global hook", "subclass"]


@pytest.fixture
def case(request):
    handle = None
    if request.param == "global hook":
        handle = nn.modules.module.register_module_forward_hook(_add_running_mean)
    yield request.param
    if handle is not None:
        handle.remove()


@pytest.mark.parametrize("case", CASES, indirect=True)
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpipe_trains_normalisation_layers_as_the_plain_module(case, checkpoint):
    plain = _model(case)
    piped = fpipe.GPipe(copy.deepcopy(plain), [3, 4], chunks=3, checkpoint=checkpoint)
    for step in range(2):
        y, expected = _step_both(plain, piped, _batch(step), 1e-10)
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, indirect=True)
@pytest.mark.parametrize("schedule", [gpipe(chunks=3, remat="always"),
                                      gpipe(chunks=3, remat="except_last"),
                                      one_f_one_b(chunks=3, remat="always")])
def test_module_stages_train_normalisation_layers_as_the_plain_module(case, schedule):
    plain = _model(case)
    s = fpipe.stages.from_sequential(copy.deepcopy(plain), [3, 4], stateful=True)
    params, state = s.params, s.state

    def loss_fn(y, target):
        return (y.sin() * y).sum() * 9 / len(y)  # a step weighs it by len(y) / 9

    with fpipe.pipeline(s.stages, params, state=state, schedule=schedule,
                        loss_fn=loss_fn) as pipe:
        for step in range(2):
            x = _batch(step)
            plain.zero_grad()
            _plain_step(plain, x, 3)
            given = [{k: v.clone() for k, v in st.items()} for st in state]
            _, grads, new_state = pipe.value_and_grad(x, torch.zeros(9), state=state)
            for before, now in zip(given, state):  # the caller's state is left as it was
                assert all(torch.equal(before[k], now[k]) for k in before)
            got = {k: v for tree in grads for k, v in tree.items()}
            for name, p in plain.named_parameters():
                torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-10, msg=name)
            buffers = {k: v for tree in new_state for k, v in tree.items()}
            for name, b in plain.named_buffers():
                torch.testing.assert_close(buffers[name], b, rtol=1e-12, atol=1e-12, msg=name)
            state = new_state


def test_a_dtype_change_between_steps_trains_as_the_plain_module():
    """The recompute's scratch statistics follow the layer's dtype from step to step."""
    plain = _model("plain").float()
    piped = fpipe.GPipe(copy.deepcopy(plain), [3, 4], chunks=3, checkpoint="always")
    for step, dtype in enumerate((torch.float32, torch.float64, torch.float32)):
        plain.to(dtype)
        piped.to(dtype)
        _step_both(plain, piped, _batch(step, dtype), 1e-4)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_layer_replaced_between_steps_is_seen(checkpoint):
    """A BatchNorm replaced after a step by a layer whose output reads its statistics, under
    the same names, then another made such a layer in place: each next step copies them as
    that layer needs, as if the face were built after the change."""
    plain = _model("plain")
    piped = fpipe.GPipe(copy.deepcopy(plain), [3, 4], chunks=3, checkpoint=checkpoint)
    for step in range(3):
        if step == 1:
            for partition in (plain, piped.partitions[0]):
                old = partition[1]
                new = _Renorm(8).double()
                new.load_state_dict(old.state_dict())
                new.weight, new.bias = old.weight, old.bias  # the same parameters
                partition[1] = new
        if step == 2:  # a layer made a subclass in place: the structure is unchanged
            plain[4].__class__ = piped.partitions[1][1].__class__ = _Renorm
        _step_both(plain, piped, _batch(step), 1e-10)


def test_changes_between_steps_are_seen_and_a_step_checks_each_structure_once_a_run(
        monkeypatch):
    """Within one run (see ``fpipe.recompute.run``) only fpipe's code and stage calls run,
    so each partition's structure and its layers' hooks are looked at once in it, not at every
    micro-batch: here 2 looks a step per partition (3 micro-batches, recomputed): the face's
    call, whose forwards are part of its run, and the backwards' run. What changes between
    steps is seen at the next one, also where torch's registration hooks see nothing (a
    ``_modules`` entry written directly), and a forward hook registered between steps, then
    removed, is honoured exactly while it is there."""
    from fpipe.stages.swap import Swap
    looks = []
    current = Swap._current
    monkeypatch.setattr(Swap, "_current", lambda self: looks.append(self) or current(self))
    plain = _model("plain")
    piped = fpipe.GPipe(copy.deepcopy(plain), [3, 4], chunks=3, checkpoint="always")
    for step in range(4):
        if step == 1:  # a layer replaced under the same name, past Module.__setattr__
            for partition in (plain, piped.partitions[0]):
                new = _Renorm(8).double()
                new.load_state_dict(partition[1].state_dict())
                partition._modules["1"] = new
        if step == 2:
            handles = [m.register_forward_hook(_add_running_mean)
                       for m in (plain[4], piped.partitions[1][1])]
        if step == 3:
            for handle in handles:
                handle.remove()
        looks.clear()
        _step_both(plain, piped, _batch(step), 1e-10)
        stages = [p.stage.swap for p in piped._pipelines.partitions]
        assert [sum(look is s for look in looks) for s in stages] == [2, 2]


def test_module_stages_honour_a_hook_registered_between_steps():
    """The stages' own look at their layers' hooks, once a run: a forward hook that reads
    the statistics, registered after a step and removed after the next, is honoured exactly
    in the step it is there (the recompute then copies the statistics its forward saw)."""
    plain = _model("plain")
    s = fpipe.stages.from_sequential(copy.deepcopy(plain), [3, 4], stateful=True)
    state = s.state

    def loss_fn(y, target):
        return (y.sin() * y).sum() * 9 / len(y)

    with fpipe.pipeline(s.stages, s.params, state=state, schedule=gpipe(chunks=3, remat="always"),
                        loss_fn=loss_fn) as pipe:
        for step in range(3):
            if step == 1:
                handles = [m.register_forward_hook(_add_running_mean)
                           for m in (plain[4], s.stages[1].module[1])]
            if step == 2:
                for handle in handles:
                    handle.remove()
            plain.zero_grad()
            _plain_step(plain, _batch(step), 3)
            _, grads, state = pipe.value_and_grad(_batch(step), torch.zeros(9), state=state)
            got = {k: v for tree in grads for k, v in tree.items()}
            for name, p in plain.named_parameters():
                torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-10, msg=name)
