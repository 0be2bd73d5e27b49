"""A module stage's call on given tensors (``fpipe.stages.swap``) does what
``torch.func.functional_call`` does, bit for bit, whatever became of the module since the last
call, and leaves the module as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fpipe.recompute import flags
from fpipe.stages.sequential import ModuleStage, StatefulModuleStage
from fpipe.stages.swap import Swap


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Sequential(nn.Linear(8, 3, bias=False)))


def others(module: nn.Module) -> dict[str, torch.Tensor]:
    """New values for every parameter and buffer, requiring grad like the module's."""
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    return {name: (t + 1).detach().requires_grad_(t.requires_grad) if t.is_floating_point()
            else t + 1 for name, t in tensors.items()}


def own(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def test_the_same_as_functional_call_and_the_module_left_alone():
    module, x = model(), torch.randn(5, 4)
    tensors, before = others(module), own(module)
    swap = Swap(module)
    for _ in range(2):  # the first call reads the structure, the second uses what it read
        y = swap(tensors, (x,))
        assert torch.equal(y, functional_call(module, tensors, (x,), strict=True))
        assert all(a is b for a, b in zip(own(module), before))
    # the gradient reaches the given tensors, not the module's
    swap(tensors, (x,)).sum().backward()
    assert tensors["0.weight"].grad is not None and module[0].weight.grad is None


def test_a_failing_call_puts_the_modules_tensors_back():
    module = model()
    before = own(module)
    with pytest.raises(RuntimeError):
        Swap(module)(others(module), (torch.randn(5, 7),))  # 7 features, not 4
    assert all(a is b for a, b in zip(own(module), before))


def test_a_module_changed_since_the_last_call_is_read_again():
    module, x = model(), torch.randn(5, 4)
    swap = Swap(module)
    swap(others(module), (x,))
    module[3][0] = nn.Linear(8, 3, bias=False)  # a new submodule under the same name
    tensors = others(module)
    assert torch.equal(swap(tensors, (x,)), functional_call(module, tensors, (x,)))
    module[0].register_buffer("scale", torch.ones(8))  # a new name: not given, so an error
    with pytest.raises(RuntimeError, match="Missing key"):
        swap(tensors, (x,))


def test_a_module_whose_tables_were_replaced_is_read_again():
    """Same names in a new dict (a library rebuilding ``_parameters`` or ``_buffers``): the
    given tensors must reach the new dict, not the one first read, which the module no longer
    uses (the module's own tensors would then be used, silently)."""
    module, x = model(), torch.randn(5, 4)
    swap = Swap(module)
    swap(others(module), (x,))
    module[0]._parameters = dict(module[0]._parameters)
    tensors = others(module)
    assert torch.equal(swap(tensors, (x,)), functional_call(module, tensors, (x,)))
    assert not torch.equal(swap(tensors, (x,)), module(x))


class _Shifted(nn.Module):
    """``x @ weight.T`` plus a parameter named ``bias``, or, once renamed, ``shift``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.bias = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = self.bias if "bias" in self._parameters else self.shift
        return x @ self.weight.T + offset


def test_a_name_replaced_by_another_is_read_again():
    """A parameter renamed after a call (as many names as before, one of them new): the old
    names are refused as functional_call refuses them, and the new ones reach the module, not
    its own tensor under the new name."""
    module, x = _Shifted(), torch.randn(5, 4)
    swap = Swap(module)
    swap(others(module), (x,))
    old = others(module)
    shift = module.bias
    del module.bias
    module.register_parameter("shift", shift)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        swap(old, (x,))
    tensors = others(module)
    assert torch.equal(swap(tensors, (x,)), functional_call(module, tensors, (x,)))
    assert not torch.equal(swap(tensors, (x,)), module(x))


def test_what_only_functional_call_does_goes_through_it():
    module, x = model(), torch.randn(5, 4)
    tensors = others(module)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        Swap(module)({**tensors, "extra": torch.ones(1)}, (x,))
    swap = Swap(module)
    swap(tensors, (x,))  # (its structure read: the fast path from now on)
    misnamed = dict(tensors)  # as many names as the module's, one of them not its
    misnamed["0.bias2"] = misnamed.pop("0.bias")
    with pytest.raises(RuntimeError, match=r"(?s)Unexpected key\(s\): '0.bias2'.*Missing "
                                           r"key\(s\): '0.bias'"):
        swap(misnamed, (x,))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight  # one tensor under two names: given once
    tensors = {"0.weight": torch.randn(4, 4), "0.bias": torch.randn(4),
               "1.bias": torch.randn(4)}
    assert torch.equal(Swap(tied)(tensors, (x,)), functional_call(tied, tensors, (x,)))


class _Reassigns(nn.Module):
    """A buffer reassigned by the forward (not updated in place), no ties: the fast path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("last", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x.mean(0)
        return self.lin(x)


def test_a_buffer_the_module_reassigns_comes_back_in_the_callers_dict_as_functional_call():
    module, x = _Reassigns(), torch.randn(4, 3)
    swapped, called = others(module), others(module)
    Swap(module)(swapped, (x,))
    functional_call(module, called, (x,), strict=True)
    assert torch.equal(swapped["last"], x.mean(0)) and torch.equal(called["last"], x.mean(0))
    assert torch.equal(module.last, torch.zeros(3))  # the module's own is put back


def test_within_one_run_of_the_runtime_the_structure_is_checked_once(monkeypatch):
    """``structure(serial)``: one check per run serial (in a run only stage calls run), one per
    call outside a run (``None``), and a change made between two runs is seen by the next."""
    module, x = model(), torch.randn(5, 4)
    swap, checks = Swap(module), []
    current = Swap._current
    monkeypatch.setattr(Swap, "_current", lambda self: checks.append(1) or current(self))
    for serial in (1, 1, 1, 2, 2):
        swap(others(module), (x,), swap.structure(serial))
    assert len(checks) == 2
    for _ in range(3):
        swap(others(module), (x,), swap.structure(None))
    assert len(checks) == 5
    module[3]._modules["0"] = nn.Linear(8, 3, bias=False)  # no setattr: no hook of torch's
    tensors = others(module)
    y = swap(tensors, (x,), swap.structure(3))
    assert len(checks) == 6 and swap.reads == 2
    assert torch.equal(y, functional_call(module, tensors, (x,)))


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("order", ["the module's", "reversed"])
def test_a_stage_given_its_names_in_any_order_calls_as_functional_call(order, owned):
    """A module stage's call takes its tensors in the module's order without looking a name
    up, and any other order by name: both as functional_call, the caller's dicts left as
    they were, a reassigned buffer in the new state (a new dict either way)."""
    module = nn.Sequential(model(), _Reassigns())
    stage, x = StatefulModuleStage(module), torch.randn(5, 4)
    tensors = others(module)
    names = [n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()]
    if order == "reversed":
        names = names[0][::-1], names[1][::-1]
    params, state = ({n: tensors[n] for n in group} for group in names)
    expected_state = {**params, **{n: t.clone() for n, t in state.items()}}
    expected = functional_call(module, expected_state, (x,), strict=True)  # writes 1.last
    given, before = dict(state), own(module)
    with flags(owned=owned):
        y, new_state = stage(params, state, x)
    assert torch.equal(y, expected)
    assert new_state is not state and state == given  # the same tensors under the same names
    assert list(new_state) == list(state)
    for name, t in new_state.items():
        assert torch.equal(t, expected_state[name]), name
    assert new_state["1.last"] is not state["1.last"]  # reassigned by the forward
    assert (new_state["0.1.running_mean"] is state["0.1.running_mean"]) == owned
    assert all(a is b for a, b in zip(own(module), before))  # the module's own put back


def test_a_stage_without_buffers_calls_as_functional_call_in_any_order():
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    stage, x = ModuleStage(module), torch.randn(5, 4)
    tensors = others(module)
    for names in (list(tensors), list(tensors)[::-1]):
        params = {n: tensors[n] for n in names}
        assert torch.equal(stage(params, x), functional_call(module, params, (x,)))
