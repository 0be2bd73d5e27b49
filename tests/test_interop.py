"""The default autodiff works with the rest of PyTorch inside a stage: activation
checkpointing (``torch.utils.checkpoint``) and a compiled function the stage calls (the
Hugging Face case is in test_hf.py). Under ``autodiff="func"`` the first fails ("don't yet
support saved tensor hooks") and the second runs uncompiled."""

from __future__ import annotations

import pytest
import torch
from models import assert_trees_close, block, mlp_params, mse, whole_batch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import checkpoint

import fpipe
from fpipe.schedules import gpipe, one_f_one_b


def data():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(12, 8, generator=g, dtype=torch.float64),
            torch.randn(12, 8, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("schedule", [gpipe(chunks=3, remat="never"), one_f_one_b(chunks=4)],
                         ids=str)
def test_activation_checkpointing_inside_a_stage(schedule):
    def checkpointed(p, x):
        return checkpoint(block, p, x, use_reentrant=False)

    params = mlp_params(3)
    x, t = data()
    expected = whole_batch([block] * 3, params, x, t, mse)
    with fpipe.pipeline([block, checkpointed, checkpointed], params, schedule=schedule,
                        loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, t)
    torch.testing.assert_close(loss, expected[0])
    assert_trees_close(grads, expected[1])


def test_a_compiled_function_called_by_a_stage_runs_compiled():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    inner = torch.compile(block, backend=counter)

    def calls_compiled(p, x):  # the stage itself is not what torch.compile returned
        return inner(p, x) + 0

    params = mlp_params(2)
    x, t = data()
    expected = whole_batch([block] * 2, params, x, t, mse)
    with fpipe.pipeline([calls_compiled, block], params,
                        schedule=gpipe(chunks=3, remat="never"), loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, t)
    assert counter.frame_count > 0
    torch.testing.assert_close(loss, expected[0])
    assert_trees_close(grads, expected[1])
    torch._dynamo.reset()


class _Reentrant(torch.nn.Module):
    """A layer checkpointed as torch does where use_reentrant is left out."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return checkpoint(self.linear, x, use_reentrant=True)


def test_a_reentrant_checkpoint_is_refused_at_the_first_forward():
    """Its backward cannot run under a vjp (torch refuses it in the backward, and the
    parameters it closes over would get no gradient): refused at the forward, naming the fix,
    on both faces; nothing of the step ran a backward."""
    def reentrant(p, x):
        return checkpoint(lambda x: block(p, x), x, use_reentrant=True)

    params = mlp_params(2)
    x, t = data()
    with fpipe.pipeline([block, reentrant], params, schedule=gpipe(chunks=3),
                        loss_fn=mse) as pipe:
        with pytest.raises(fpipe.StageError, match="use_reentrant=False") as caught:
            pipe.value_and_grad(x, t)
        assert caught.value.stage == 1 and caught.value.op == "forward"
    torch.manual_seed(0)
    model = fpipe.GPipe(torch.nn.Sequential(torch.nn.Linear(8, 8), _Reentrant()).double(),
                        [1, 1], devices=["cpu"] * 2, chunks=3, checkpoint="never")
    with pytest.raises(fpipe.StageError, match="use_reentrant=False"):
        model(x)
    assert all(p.grad is None for p in model.parameters())
