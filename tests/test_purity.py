"""A stage that writes in place into its parameters, its state or its input is caught at the
first call that does it, naming the stage and the leaf, before a second call changes the
caller's tensors again."""

from __future__ import annotations

import pytest
import torch
from models import block, mlp_params, mse

import fpipe
from fpipe.schedules import gpipe, one_f_one_b


def data():
    return torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)


def test_a_write_into_a_parameter_in_a_forward_without_graph():
    """Forwards that will be recomputed, and inference, run without autograd, which would let
    the write through unnoticed on every micro-batch."""
    def grows(p, x):
        p["b"].add_(1.0)
        return block(p, x)

    params = mlp_params(2)
    before = params[1]["b"].clone()
    with fpipe.pipeline([block, grows], params, schedule=gpipe(chunks=3, remat="always"),
                        loss_fn=mse) as pipe:
        with pytest.raises(fpipe.StageError,
                           match=r"stage 1 failed in the forward of micro-batch 0: .*wrote in "
                                 r"place into params\['b'\]") as info:
            pipe.value_and_grad(*data())
        assert (info.value.stage, info.value.microbatch) == (1, 0)
        torch.testing.assert_close(params[1]["b"], before + 1.0)  # once, not three times
        with pytest.raises(fpipe.StageError, match=r"params\['b'\]"):
            pipe(data()[0])


def test_a_write_into_a_parameter_under_autograd_is_named_as_a_write():
    def scales(p, x):
        p["w"].mul_(2.0)
        return block(p, x)

    with fpipe.pipeline([block, scales], mlp_params(2), schedule=gpipe(chunks=2, remat="never"),
                        loss_fn=mse) as pipe:
        with pytest.raises(fpipe.StageError, match="stage 1 .*writes in place into a tensor"):
            pipe.value_and_grad(*data())


@pytest.mark.parametrize("stage", [0, 1])
def test_a_write_into_the_input(stage):
    def relu_in_place(p, x):
        return block(p, x.relu_())

    stages = [block, block]
    stages[stage] = relu_in_place
    x, target = data()
    original = x.clone()
    with fpipe.pipeline(stages, mlp_params(2), schedule=one_f_one_b(chunks=3)) as pipe:
        with pytest.raises(fpipe.StageError,
                           match=rf"stage {stage} .*micro-batch 0.*its input x"):
            pipe(x)
    if stage == 0:  # the caller's batch: only the first micro-batch was written
        assert torch.equal(x[2:], original[2:])


def test_a_write_into_the_state():
    def counts(p, state, x):
        state["n"].add_(1)
        return block(p, x), state

    state = [{"n": torch.zeros((), dtype=torch.int64)}, {}]
    with fpipe.pipeline([counts, lambda p, s, x: (block(p, x), s)], mlp_params(2),
                        state=state, schedule=gpipe(chunks=3), loss_fn=mse) as pipe:
        with pytest.raises(fpipe.StageError, match=r"stage 0 .*state\['n'\]"):
            pipe.value_and_grad(*data())
    assert int(state[0]["n"]) == 1


def test_pure_stages_pass_every_step():
    x, target = data()
    with fpipe.pipeline([block] * 3, mlp_params(3), schedule=gpipe(chunks=3),
                        loss_fn=mse) as pipe:
        for _ in range(3):
            pipe.value_and_grad(x, target)
            pipe(x)
