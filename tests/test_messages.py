"""The mistakes a newcomer makes first get a message that says what to do (issue 27): a schedule
constructor passed uncalled, parameters given as a dict, stages of different dtypes, a
distributed script started without torchrun; and ``help(fpipe.pipeline)`` names the default
it has."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from models import block, mlp_params, mse

import fpipe
import fpipe.distributed as fdist
from fpipe.schedules import gpipe, one_f_one_b


@pytest.mark.parametrize("constructor", [gpipe, one_f_one_b])
def test_a_schedule_constructor_passed_uncalled_says_to_call_it(constructor):
    name = constructor.__name__
    with pytest.raises(TypeError, match=rf"schedule={name} is a schedule's constructor, not a "
                                        rf"schedule: call it, e.g. schedule={name}\(chunks=8\)"):
        fpipe.pipeline([block] * 2, mlp_params(2), schedule=constructor, loss_fn=mse)


def test_a_function_returning_something_else_is_still_told_what_to_return():
    with pytest.raises(TypeError, match=r"must return a Program for 2 stages, got 'oops'"):
        fpipe.pipeline([block] * 2, mlp_params(2), schedule=lambda n: "oops")


@pytest.mark.parametrize("params", [
    dict(enumerate(mlp_params(2))),  # fpipe.distributed's {stage: pytree}
    {"w": torch.ones(8, 8, dtype=torch.float64)},  # one pytree for the whole model
])
def test_params_given_as_a_dict_says_a_list_per_stage_is_wanted(params):
    with pytest.raises(TypeError, match=r"params is a dict: fpipe.pipeline takes a list with one "
                                        r"parameter pytree per stage.*sorted\(params\)"):
        fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=2), loss_fn=mse)


def test_stages_of_different_dtypes_fail_with_torchs_error_and_a_note_saying_what_to_do():
    params = mlp_params(2)
    params[0] = {k: v.float() for k, v in params[0].items()}  # stage 0 float32, stage 1 float64
    x, target = torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64)
    with fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        with pytest.raises(RuntimeError, match="dtype") as info:
            pipe.value_and_grad(x, target)
    notes = "\n".join(info.value.__notes__)
    assert "stage 1's input is float32 but its parameters are float64" in notes
    assert "fpipe.amp.cast(params, dtype)" in notes and "torch.autocast" in notes


def test_no_dtype_note_where_the_dtypes_agree():
    params = mlp_params(3)
    params[1]["w"] = torch.randn(8, 5, dtype=torch.float64)  # a shape error, not a dtype one
    params[1]["b"] = torch.randn(5, dtype=torch.float64)
    with fpipe.pipeline([block] * 3, params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            pipe.value_and_grad(torch.randn(4, 8, dtype=torch.float64),
                                torch.randn(4, 8, dtype=torch.float64))
    assert "parameters are" not in "\n".join(info.value.__notes__)


def test_distributed_init_without_torchrun_names_the_command(monkeypatch):
    for name in fdist.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["train.py", "--steps", "5"])
    with pytest.raises(RuntimeError, match=r"torchrun starts, but RANK, WORLD_SIZE, MASTER_ADDR, "
                                           r"MASTER_PORT are not set") as info:
        fdist.init("cpu")
    assert "torchrun --standalone --nproc-per-node=2 train.py --steps 5" in str(info.value)
    assert not torch.distributed.is_initialized()


def test_help_names_the_autodiff_default_the_signature_has():
    """``help(fpipe.pipeline)``: of the autodiff options the docstring lists, only the
    signature's default is called the default."""
    default = inspect.signature(fpipe.pipeline).parameters["autodiff"].default
    text = re.search(r"autodiff: (.*?)\n        \w+:", fpipe.pipeline.__doc__, re.S).group(1)
    called_default = [re.search(r'``"(\w+)"``', option).group(1)
                      for option in re.split(r";\s+or\s+", text)
                      if re.search(r"(?<!not )the default", option)]
    assert called_default == [default] == ["autograd"]


# -- where an error was raised, said as a newcomer needs it (issue 34) ----------------------------

def test_an_error_inside_loss_fn_is_reported_as_raised_in_the_loss_with_its_arguments():
    def loss_fn(y, target):
        return {"mse": mse}["mae"](y, target)  # the user's own slip, inside the loss

    x, target = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    with fpipe.pipeline([block] * 3, mlp_params(3), schedule=gpipe(chunks=2),
                        loss_fn=loss_fn) as pipe:
        with pytest.raises(KeyError, match="mae") as info:
            pipe.value_and_grad(x, target)
    assert fpipe.errors.where(info.value) == fpipe.errors.Where(2, 0, "loss")
    notes = info.value.__notes__
    assert notes == ["fpipe: raised in loss_fn of micro-batch 0 (on stage 2's output)",
                     "fpipe: loss_fn(y, target) was given y Tensor(2, 8) float64 on cpu and "
                     "target Tensor(2, 5) float64 on cpu"]


def test_a_loss_that_is_not_a_scalar_is_reported_as_the_loss_s_failure():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=lambda y, t: (y - t).square().mean(0)) as pipe:
        with pytest.raises(fpipe.StageError) as info:
            pipe.value_and_grad(*[torch.randn(4, 8, dtype=torch.float64)] * 2)
    assert (info.value.stage, info.value.microbatch, info.value.op) == (1, 0, "loss")
    assert str(info.value) == (
        "loss_fn failed on micro-batch 0 (on stage 1's output): loss_fn must return a scalar "
        "(0-dim) tensor, got (8,)\n  loss_fn(y, target) was given y Tensor(2, 8) float64 on "
        "cpu and target Tensor(2, 8) float64 on cpu")


def test_a_loss_failure_reaches_other_ranks_named_as_the_loss_s():
    from fpipe._runtime.ranks.faults import _stage_failure
    assert _stage_failure("KeyError", "'mae'", fpipe.errors.Where(3, 1, "loss", 1)) == (
        "loss_fn failed on micro-batch 1 (on stage 3's output): KeyError: 'mae'")


def test_a_device_mismatch_notes_the_devices_of_the_input_and_of_the_parameters():
    def makes_a_tensor_elsewhere(p, x):  # torch.ones without device=x.device, on another device
        return torch.cat([block(p, x), torch.ones(x.shape, device="meta")], 1)

    with fpipe.pipeline([block, makes_a_tensor_elsewhere], mlp_params(2),
                        schedule=gpipe(chunks=2)) as pipe:
        with pytest.raises(RuntimeError, match="device") as info:
            pipe(torch.randn(4, 8, dtype=torch.float64))
    assert info.value.__notes__ == [
        "fpipe: raised in stage 1, forward of micro-batch 0",
        "fpipe: its input, from stage 0: Tensor(2, 8) float64 on cpu",
        "fpipe: stage 1's parameters are on cpu, where fpipe moves its input; a tensor the "
        "stage makes itself must be made there too (e.g. device=x.device)"]
