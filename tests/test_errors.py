"""Bad input and failing stages give errors that name the problem; nothing is left hanging."""

from __future__ import annotations

import pytest
import torch
from models import block, fpipe_workers, mlp_params, mse

import fpipe
from fpipe import BatchError, PlacementError, ScheduleError, StageError
from fpipe.schedules import Program, gpipe


def data(n=6, width=8):
    return torch.randn(n, width, dtype=torch.float64), torch.randn(n, width, dtype=torch.float64)


def test_empty_stage_list():
    with pytest.raises(ValueError, match="at least one stage"):
        fpipe.pipeline([], [], schedule=gpipe(chunks=1))


def test_stage_and_params_counts_differ():
    with pytest.raises(ValueError, match="3 stages but 2 parameter pytrees"):
        fpipe.pipeline([block] * 3, mlp_params(2), schedule=gpipe(chunks=1))


def test_stage_not_callable():
    with pytest.raises(TypeError, match="stage 1 is a int"):
        fpipe.pipeline([block, 3], mlp_params(2), schedule=gpipe(chunks=1))


def test_param_leaf_not_a_tensor():
    params = mlp_params(2)
    params[1]["b"] = 0.5
    with pytest.raises(TypeError, match=r"params\[1\]\['b'\] is a float"):
        fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=1))


def test_params_on_several_devices_in_one_stage():
    params = mlp_params(2)
    params[1]["b"] = torch.empty(8, device="meta")
    with pytest.raises(PlacementError, match=r"stage 1's parameters are on several devices"):
        fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=1))


def test_params_not_on_the_named_device():
    params = mlp_params(2)
    expected = r"stage 1 runs on meta .*params\[1\]\['b'\] is on cpu"
    with pytest.raises(PlacementError, match=expected):
        fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=1), devices=["cpu", "meta"])


def test_new_params_of_another_structure():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=mse) as pipe:
        other = mlp_params(2)
        del other[0]["b"]
        with pytest.raises(ValueError, match=r"params\[0\] has structure"):
            pipe.value_and_grad(*data(), params=other)


def test_schedule_that_is_not_one():
    with pytest.raises(TypeError, match="schedule must be a schedule value"):
        fpipe.pipeline([block] * 2, mlp_params(2), schedule=8)


def test_invalid_custom_program_is_rejected_before_running():
    program = Program([["0F0"], ["1F0", "1B0"]], n_stages=2, n_microbatches=1)
    with pytest.raises(ScheduleError, match="exactly-once"):
        fpipe.pipeline([block] * 2, mlp_params(2), schedule=program)


def test_program_referencing_a_missing_stage():
    program = Program([["0F0", "0B0"], ["1F0", "1B0"]], n_stages=2, n_microbatches=1)
    with pytest.raises(ValueError, match="for 2 stages but the pipeline has 3"):
        fpipe.pipeline([block] * 3, mlp_params(3), schedule=program)


def test_batch_smaller_than_chunks():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=8),
                        loss_fn=mse) as pipe:
        with pytest.raises(BatchError, match="5 samples, fewer than chunks=8"):
            pipe.value_and_grad(*data(5))
        with pytest.raises(BatchError, match="fewer than chunks=8"):
            pipe(data(5)[0])


def test_input_leaves_disagree_on_batch_size():
    def first(p, x):
        return block(p, x["a"] + x["b"][:1])
    with fpipe.pipeline([first, block], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        expected = r"disagree on the batch size.*\['a'\] has 4.*\['b'\] has 3"
        with pytest.raises(BatchError, match=expected):
            pipe({"a": torch.randn(4, 8, dtype=torch.float64),
                  "b": torch.randn(3, 8, dtype=torch.float64)})


def test_target_of_another_batch_size():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=mse) as pipe:
        x, _ = data(6)
        with pytest.raises(BatchError, match="6 samples but the target has 4"):
            pipe.value_and_grad(x, torch.zeros(4, 8, dtype=torch.float64))


def test_value_and_grad_without_loss():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        with pytest.raises(ValueError, match="loss_fn"):
            pipe.value_and_grad(*data())


def test_loss_not_a_scalar():
    def per_sample(y, t):
        return ((y - t) ** 2).mean(dim=1)
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=per_sample) as pipe:
        with pytest.raises(StageError, match=r"loss_fn failed on micro-batch 0 \(on stage 1's "
                                             r"output\): .*scalar \(0-dim\) tensor, got \(3,\)"):
            pipe.value_and_grad(*data())


def test_stage_output_changes_batch_size():
    def drops_a_row(p, x):
        return block(p, x)[1:]
    with fpipe.pipeline([drops_a_row, block], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        with pytest.raises(StageError, match=r"stage 0 .*micro-batch 0.*micro-batch size 3"):
            pipe(data()[0])


def test_stage_returns_no_tensor():
    def nothing(p, x):
        return None
    with fpipe.pipeline([nothing, block], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        with pytest.raises(StageError, match=r"stage 0 .*returned no tensor"):
            pipe(data()[0])


def test_output_does_not_fit_next_stage_names_both_stages_and_shapes():
    """The stage's own error (torch's RuntimeError) arrives as itself, located and noted."""
    params = mlp_params(3)
    params[1]["w"] = torch.randn(8, 5, dtype=torch.float64)
    params[1]["b"] = torch.randn(5, dtype=torch.float64)
    with fpipe.pipeline([block] * 3, params, schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            pipe.value_and_grad(*data())
    assert not isinstance(info.value, StageError)
    notes = "\n".join(info.value.__notes__)
    assert "raised in stage 2, forward of micro-batch" in notes
    assert "from stage 1: Tensor(3, 5) float64" in notes
    at = fpipe.errors.where(info.value)
    assert (at.stage, at.op) == (2, "forward")


def test_keyboard_interrupt_in_the_caller_stops_every_worker():
    interrupt = {"on": True}

    def stage0(p, x):
        if interrupt["on"]:
            raise KeyboardInterrupt
        return block(p, x)

    threads_before = fpipe_workers()
    pipe = fpipe.pipeline([stage0, block, block], mlp_params(3), schedule=gpipe(chunks=2),
                          loss_fn=mse)
    with pytest.raises(KeyboardInterrupt):
        pipe.value_and_grad(*data())
    interrupt["on"] = False
    pipe.value_and_grad(*data())  # workers are idle again, not stuck in the aborted step
    pipe.close()
    assert not fpipe_workers() - threads_before  # every worker the pipeline started stopped


def test_base_exception_in_a_worker_thread_reaches_the_caller_as_itself():
    def exits(p, x):
        raise SystemExit("stage asked to exit")
    with fpipe.pipeline([block, exits], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        for _ in range(2):  # the pipeline stays usable
            with pytest.raises(SystemExit, match="stage asked to exit") as info:
                pipe(data()[0])
            assert fpipe.errors.where(info.value).stage == 1


def test_last_stage_changing_the_batch_size_is_a_stage_error():
    """Before, the loss was computed on the wrong rows (0.699 against 0.833)."""
    def drops_a_row(p, x):
        return block(p, x)[1:]
    with fpipe.pipeline([block, drops_a_row], mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=lambda y, t: mse(y, t[: len(y)])) as pipe:
        with pytest.raises(StageError, match=r"stage 1 .*micro-batch size 3"):
            pipe.value_and_grad(*data())
        with pytest.raises(StageError, match=r"stage 1 .*micro-batch size 3"):
            pipe(data()[0])
        with pytest.raises(StageError, match=r"stage 1 .*micro-batch size 3"):
            pipe.vjp(data()[0])


class Cursed(Exception):
    pass


@pytest.mark.parametrize("make", [lambda: Cursed("sample 3"),
                                  lambda: torch.OutOfMemoryError("CUDA OOM"), KeyboardInterrupt])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_stage_exception_keeps_its_type(make, stage):
    """``except torch.OutOfMemoryError`` (or a user's type) still catches it, as with
    torchgpipe; the stage, micro-batch and op are attached and noted. KeyboardInterrupt too,
    in the caller's thread (stage 0) as in a worker's."""
    error = make()
    armed = {"on": True}

    def raising(p, x):
        if armed["on"] and x.shape[0] == 2:  # micro-batch 1 of 5, 3
            raise error
        return block(p, x)

    stages = [block, block, block]
    stages[stage] = raising
    with fpipe.pipeline(stages, mlp_params(3), schedule=gpipe(chunks=2), loss_fn=mse) as pipe:
        with pytest.raises(type(error)) as info:
            pipe.value_and_grad(*data(5))
        assert info.value is error
        assert fpipe.errors.where(error) == fpipe.errors.Where(stage, 1, "forward")
        assert f"fpipe: raised in stage {stage}, forward of micro-batch 1" in error.__notes__
        armed["on"] = False
        pipe.value_and_grad(*data(5))


def test_empty_batch_says_so():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        with pytest.raises(BatchError, match="batch is empty"):
            pipe(torch.empty(0, 8, dtype=torch.float64))


def test_a_loss_that_needs_a_target_called_without_one_says_no_target_was_given():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=lambda y, t: ((y - t) ** 2).mean()) as pipe:
        with pytest.raises(TypeError) as info:
            pipe.value_and_grad(data()[0])
    assert any("no target was given" in note for note in info.value.__notes__)


def test_integer_parameters_are_refused_at_construction():
    params = mlp_params(2)
    params[1]["n"] = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"params\[1\]\['n'\] is a int64 tensor.*floating"):
        fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=1))


def test_costs_given_as_a_dict():
    from fpipe.schedules import simulate
    with pytest.raises(TypeError, match=r"costs must be a Costs value, got a dict.*Costs\(\*\*"):
        simulate(gpipe(chunks=2).program(2), {"forward": 1.0})


def test_a_training_step_under_inference_mode_says_why_it_cannot_run():
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2),
                        loss_fn=mse) as pipe:
        with torch.inference_mode():
            with pytest.raises(RuntimeError, match="inference_mode"):
                pipe.value_and_grad(*data())
            y = pipe(data()[0])  # forward-only runs, in inference mode on every worker
        assert y.is_inference()


@pytest.mark.parametrize("stage", [torch.nn.Linear(4, 4), torch.compile(torch.nn.Linear(4, 4)),
                                   torch.nn.ReLU()], ids=["Linear", "compiled", "ReLU"])
def test_an_nn_module_as_a_stage_is_refused_at_build(stage):
    """A module keeps its own parameters, which fpipe would neither train nor return: refused
    when the pipeline is built, pointing to from_modules."""
    with pytest.raises(TypeError, match=r"stage 1 is an nn.Module .*from_modules"):
        fpipe.pipeline([lambda p, x: x, stage], [{}, {}], schedule=fpipe.gpipe(chunks=2))


def test_a_module_whose_forward_is_a_pure_stage_is_accepted():
    class Scale(torch.nn.Module):
        def forward(self, p, x):
            return x * p["s"]

    p = {"s": torch.tensor(2.0, dtype=torch.float64)}
    x = torch.ones(4, 2, dtype=torch.float64)
    with fpipe.pipeline([Scale()], [p], schedule=fpipe.gpipe(chunks=2)) as pipe:
        torch.testing.assert_close(pipe(x), 2 * x)


def test_backward_on_a_returned_loss_says_the_gradients_were_returned():
    p = {"w": torch.ones(2, 2, dtype=torch.float64)}
    x = torch.ones(4, 2, dtype=torch.float64)

    def mean(y, t):
        return y.mean()

    with fpipe.pipeline([lambda p, x: x @ p["w"]], [p], schedule=fpipe.gpipe(chunks=2),
                        loss_fn=mean) as pipe:
        loss, grads = pipe.value_and_grad(x)
        torch.testing.assert_close(loss, torch.tensor(2.0, dtype=torch.float64))
        assert not loss.requires_grad and loss.tolist() == 2.0  # a plain tensor otherwise
        assert repr(loss) == "tensor(2., dtype=torch.float64)"
        for tensor in (loss, loss * 2):
            with pytest.raises(RuntimeError, match=r"already computed the gradients.*bind_gr"):
                tensor.backward()
