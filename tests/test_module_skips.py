"""torchgpipe-style skip connections on nn.Modules (``@skippable`` classes that yield ``stash`` and
``pop``): unpipelined they run as plain modules; cut into stages, the skips that cross stages
ride on fpipe's skip routing and gradients come back exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpipe
from fpipe.schedules import gpipe, one_f_one_b
from fpipe.stages import (
    Namespace,
    balance_by_size,
    balance_by_time,
    from_sequential,
    pop,
    skippable,
    stash,
    verify_skippables,
)


@skippable(stash=["skip"])
class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        yield stash("skip", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        skip = yield pop("skip")
        return self.linear(x) * skip


def unet(seed=0):
    """Skips nested in two namespaces, one of them within a single layer's reach."""
    outer, inner = Namespace(), Namespace()
    torch.manual_seed(seed)
    return nn.Sequential(Down().isolate(outer), Down().isolate(inner), nn.Linear(6, 6),
                         Up().isolate(inner), nn.ReLU(), Up().isolate(outer)).double()


@pytest.mark.parametrize("stateful", [True, None])  # None: the default, stateless here
@pytest.mark.parametrize("balance", [[1, 2, 3], [2, 2, 2], [3, 3], [1, 1, 1, 1, 1, 1], [6]])
@pytest.mark.parametrize("schedule", [gpipe(chunks=3, remat="always"), gpipe(chunks=2),
                                      one_f_one_b(chunks=3)])
def test_skips_across_stages_give_the_plain_modules_gradients(balance, schedule, stateful):
    model = unet()
    x, target = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    F.mse_loss(model(x), target).backward()
    s = from_sequential(model, balance, stateful=stateful)
    assert (s.state is None) == (stateful is None)  # the model has no buffers
    with fpipe.pipeline(s.stages, s.params, state=s.state, schedule=schedule,
                        loss_fn=F.mse_loss) as pipe:
        loss, grads = pipe.value_and_grad(x, target)[:2]
        y = pipe(x)[0] if stateful else pipe(x)
    torch.testing.assert_close(loss, F.mse_loss(model(x), target))
    torch.testing.assert_close(y, model(x).detach())
    expected = dict(model.named_parameters())
    for stage_grads in grads:
        for name, grad in stage_grads.items():
            torch.testing.assert_close(grad, expected[name].grad, msg=name)


def test_only_skips_that_cross_stages_are_routed():
    stages = from_sequential(unet(), [1, 2, 3]).stages
    declared = [(getattr(s, "stash", ()), getattr(s, "pop", ())) for s in stages]
    assert [len(stashed) for stashed, _ in declared] == [1, 1, 0]
    assert [len(popped) for _, popped in declared] == [0, 0, 2]
    assert from_sequential(unet(), [2, 2, 2]).stages[1].pop[0].startswith("skip (namespace ")
    assert not isinstance(from_sequential(unet(), [6]).stages[0], fpipe.stages.Skippable)


def test_the_gpipe_face_trains_a_module_with_skips():
    plain, piped = unet(), fpipe.GPipe(unet(), [2, 2, 2], chunks=3, checkpoint="always")
    x = torch.randn(6, 6, dtype=torch.float64)
    plain(x).pow(2).sum().backward()
    piped(x).pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_a_plain_run_passes_the_skips_through_the_thread():
    model = unet()
    x = torch.randn(4, 6, dtype=torch.float64)
    first = model(x)
    torch.testing.assert_close(model(x), first)  # nothing left over from the first run
    down, up = Down().double(), Up().double()
    h = down.module.linear(x).tanh()
    torch.testing.assert_close(up(down(x)), up.module.linear(h) * x)


def test_balancing_runs_each_layer_on_the_skips_stashed_before_it():
    x = torch.randn(8, 6, dtype=torch.float64)
    assert balance_by_time(unet(), x, partitions=6, repeat=2) == [1] * 6
    assert len(balance_by_size(3, unet(), x, chunks=2)) == 3


def test_isolate_only_some_names():
    @skippable(stash=["a", "b"])
    class Two(nn.Module):
        def forward(self, x):
            yield stash("a", x)
            yield stash("b", x * 2)
            return x

    ns = Namespace()
    layer = Two().isolate(ns, only=["a"])
    assert dict(layer.stashable()) == {ns: "a", None: "b"}
    assert layer.namespaced("a") == (ns, "a") and repr(layer).startswith("@skippable(Two(")


def test_torchgpipes_positional_stash_names():
    @skippable(["a"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("a", x)
            return x

    assert Stash.stashable_names == frozenset({"a"}) and Stash.poppable_names == frozenset()


def misuse(body):
    @skippable(stash=["a"], pop=["b"])
    class Layer(nn.Module):
        forward = body
    return Layer


@pytest.mark.parametrize("forward, error, message", [
    (lambda self, x: (yield stash("c", x)), RuntimeError,
     "'c' has not been declared as stashable"),
    (lambda self, x: (yield pop("c")), RuntimeError, "'c' has not been declared as poppable"),
    (lambda self, x: x, RuntimeError, "'a' must be stashed but have not"),
    (lambda self, x: (yield stash("a", x)), RuntimeError, "'b' must be popped but have not"),
    (lambda self, x: ((yield pop("b")), (yield pop("b"))), RuntimeError, "'b' was popped twice"),
    (lambda self, x: (yield 3), TypeError, "3 is not a command from @skippable"),
])
def test_commands_misused_in_forward(forward, error, message):
    @skippable(stash=["b"])
    class Give(nn.Module):
        def forward(self, x):
            yield stash("b", x)
            return x

    model = nn.Sequential(Give(), misuse(forward)())
    with pytest.raises(error, match=message):
        model(torch.ones(2))
    with pytest.raises(RuntimeError, match="'b' has not been stashed"):
        misuse(lambda self, x: x)()(torch.ones(2))


@pytest.mark.parametrize("layout, problem", [
    ("D", "'skip' is stashed but no later layer pops it"),
    ("U", "'0' pops 'skip', which no earlier layer stashes"),
    ("DDUU", "'1' stashes 'skip' again: isolate the two"),
    ("DUU", "'2' pops 'skip' again"),
])
def test_skips_that_do_not_pair_up(layout, problem):
    model = nn.Sequential(*(Down() if c == "D" else Up() for c in layout))
    with pytest.raises(TypeError, match=problem):
        verify_skippables(model)
    with pytest.raises(TypeError, match=problem):
        fpipe.GPipe(copy.deepcopy(model), [len(layout)])
    outer = Namespace()
    verify_skippables(nn.Sequential(Down(), Down().isolate(outer), Up().isolate(outer), Up()))


def test_a_layer_stashing_and_popping_one_name():
    @skippable(stash=["a"], pop=["a"])
    class Both(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="'0' declared 'a' both as stashable and as poppable"):
        verify_skippables(nn.Sequential(Both()))
    with pytest.raises(fpipe.stages.SkipError, match="stash names a skip twice"):
        skippable(stash=["a", "a"])(Both.module_cls)


def test_a_stashed_none_crosses_stages():
    @skippable(stash=["maybe"])
    class Maybe(nn.Module):
        def forward(self, x):
            yield stash("maybe", None)
            return x * 2

    @skippable(pop=["maybe"])
    class Use(nn.Module):
        def forward(self, x):
            maybe = yield pop("maybe")
            assert maybe is None
            return x + 1

    model = fpipe.GPipe(nn.Sequential(Maybe(), nn.Linear(2, 2), Use()), [1, 2], chunks=2)
    torch.testing.assert_close(model(torch.ones(4, 2)), model[1](torch.ones(4, 2) * 2) + 1)
