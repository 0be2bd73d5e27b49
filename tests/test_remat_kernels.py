"""A forward whose graph is dropped runs the kernels its recompute runs.

ATen picks kernels by ``requires_grad``: a batch-first attention's in-projection (a
non-contiguous 3-d input times a weight) is one ``mm`` when the weight requires grad and a
``bmm`` over the sequence when it does not. A dropped forward (remat, inference) must therefore
run on leaves that require grad as its recompute's do, under ``no_grad``: then gradients are
bitwise independent of the remat policy and no extra ``bmm`` runs. Checked on real
TransformerEncoderLayer stages, in float32 (where another kernel shows), on every worker
thread (the profiler records all threads; the pipelines are built inside it).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fpipe
from fpipe.schedules import gpipe
from fpipe.stages import from_sequential

POLICIES = ("never", "except_last", "always")


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
                           for _ in range(4)])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 10, 64, generator=g), torch.randn(16, 10, 64, generator=g)


def mse(y, t):
    return (y - t).pow(2).mean()


def counted(run) -> tuple[object, int]:
    """``run()``'s result and the number of ``aten::bmm`` calls on every thread."""
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # more worker threads than CI's cores: on purpose
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=config) as prof:
            result = run()
    return result, sum(e.count for e in prof.key_averages() if e.key == "aten::bmm")


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
def test_pipeline_gradients_are_bitwise_the_same_under_every_remat_policy(autodiff):
    model, (x, target) = layers(), batch()
    s = from_sequential(model, [1, 1, 1, 1], stateful=False)

    def step(remat):
        def run():
            with fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=8, remat=remat),
                                loss_fn=mse, autodiff=autodiff) as pipe:
                return pipe.value_and_grad(x, target)
        return counted(run)

    (loss, grads), bmm = step("never")
    for remat in POLICIES[1:]:
        (other_loss, other), other_bmm = step(remat)
        assert other_bmm == bmm, f"{remat} ran {other_bmm - bmm} extra bmm"
        assert torch.equal(other_loss, loss)
        for a, b in zip(grads, other):
            for name in a:
                assert torch.equal(a[name], b[name]), (remat, name)


def test_inference_computes_bitwise_what_a_training_forward_computes():
    model, (x, _) = layers(), batch()
    s = from_sequential(model, [1, 1, 1, 1], stateful=False)

    def run():
        with fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=8)) as pipe:
            return pipe(x), pipe.vjp(x)[0]
    (inferred, trained), bmm = counted(run)
    assert bmm == 0
    assert torch.equal(inferred, trained)


def test_gpipe_gradients_are_bitwise_the_same_under_every_checkpoint_mode():
    model, (x, target) = layers(), batch()

    def step(checkpoint):
        def run():
            piped = fpipe.GPipe(copy.deepcopy(model), balance=[1, 1, 1, 1], chunks=8,
                                checkpoint=checkpoint)
            mse(piped(x), target).backward()
            return [p.grad for p in piped.parameters()]
        return counted(run)

    grads, bmm = step("never")
    for checkpoint in POLICIES[1:]:
        other, other_bmm = step(checkpoint)
        assert other_bmm == bmm
        assert all(torch.equal(a, b) for a, b in zip(grads, other)), checkpoint
