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
