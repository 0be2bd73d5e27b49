"""Faults anywhere are named and leave the pipeline usable; long runs leak nothing;
a non-finite loss is never returned silently."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import OnBackward, block, fpipe_workers, mlp_params, mse

import fpipe
from fpipe import NonFiniteLossError
from fpipe.schedules import gpipe, one_f_one_b, zero_bubble


def fails(grad):
    raise RuntimeError("boom in backward")


def faulty(n_stages, fault, armed):
    """Stages where ``fault = (stage, micro-batch, op)`` raises while ``armed["on"]``; the
    micro-batch index rides in column 0 of the input (the stages keep it there)."""
    def make(s):
        def stage(p, x):
            here = armed["on"] and fault[:2] == (s, int(x[0, 0].item()))
            if here and fault[2] == "forward" and not fpipe.is_recomputing():
                raise RuntimeError("boom in forward")
            if here and fault[2] == "recompute" and fpipe.is_recomputing():
                raise RuntimeError("boom in recompute")
            w = OnBackward.apply(p["w"], fails) if here and fault[2] == "weight" else p["w"]
            y = x + 0 * w.sum()
            return OnBackward.apply(y, fails) if here and fault[2] == "backward" else y
        return stage

    return [make(s) for s in range(n_stages)]


def expected_op(op, make, stage):
    """The action a fault surfaces in: under a split backward, a fault on the input path is
    in I (stage 0 has no input gradient, so its whole backward is W), one on a weight's branch
    in W."""
    if op in ("forward", "recompute"):
        return op
    if make is not zero_bubble:
        return "backward"
    if op == "backward" and stage > 0:
        return "input-gradient backward"
    return "weight-gradient backward"


@settings(max_examples=25)
@given(data=st.data(), n_stages=st.integers(1, 4), chunks=st.integers(1, 4),
       make=st.sampled_from([gpipe, one_f_one_b, zero_bubble]),
       op=st.sampled_from(["forward", "recompute", "backward", "weight"]))
def test_a_fault_anywhere_is_named_and_the_pipeline_recovers(data, n_stages, chunks, make, op):
    stage = data.draw(st.integers(0, n_stages - 1))
    microbatch = data.draw(st.integers(0, chunks - 1))
    x = torch.arange(chunks, dtype=torch.float64).repeat_interleave(2)[:, None].repeat(1, 8)
    target = torch.zeros_like(x)
    armed = {"on": True}
    stages = faulty(n_stages, (stage, microbatch, op), armed)
    threads = fpipe_workers()
    with fpipe.pipeline(stages, mlp_params(n_stages), schedule=make(chunks=chunks, remat="always"),
                        loss_fn=mse) as pipe:
        for _ in range(2):  # the same fault again: the first left nothing behind
            # The stage's own exception, as itself (not wrapped), with where it was raised.
            boom = f"boom in {'backward' if op == 'weight' else op}"
            with pytest.raises(RuntimeError, match=boom) as info:
                pipe.value_and_grad(x, target)
            error = info.value
            assert type(error) is RuntimeError
            assert tuple(fpipe.errors.where(error))[:3] == \
                (stage, microbatch, expected_op(op, make, stage))
        armed["on"] = False
        loss, _ = pipe.value_and_grad(x, target)  # the same pipeline runs the next step
        torch.testing.assert_close(loss, mse(x, target))
        started = fpipe_workers() - threads
        assert len(started) == (pipe.program.n_workers - 1)  # none lost or added by faults
    assert not any(t.is_alive() for t in started)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_loss_raises_and_names_the_microbatch(bad):
    x = torch.randn(6, 8, dtype=torch.float64)
    target = torch.randn(6, 8, dtype=torch.float64)
    target[4] = bad  # micro-batch 2 of 3
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=3),
                        loss_fn=mse) as pipe:
        with pytest.raises(NonFiniteLossError, match=r"micro-batch\(es\) \[2\]") as info:
            pipe.value_and_grad(x, target)
        assert info.value.microbatches == [2]
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=3), loss_fn=mse,
                        nonfinite="ignore") as pipe:
        loss, _ = pipe.value_and_grad(x, target)
        assert not torch.isfinite(loss)
    with pytest.raises(ValueError, match="nonfinite must be"):
        fpipe.pipeline([block], mlp_params(1), schedule=gpipe(chunks=1), nonfinite="warn")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc")
def test_500_steps_keep_memory_and_threads_flat():
    params = mlp_params(3, width=32)
    x, target = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    with fpipe.pipeline([block] * 3, params, schedule=one_f_one_b(chunks=4, remat="always"),
                        loss_fn=mse) as pipe:
        for _ in range(100):  # warm up allocator caches and lazily built state
            pipe.value_and_grad(x, target)
        gc.collect()
        threads, before = fpipe_workers(), rss_bytes()
        for _ in range(400):
            pipe.value_and_grad(x, target)
            pipe(x)
        gc.collect()
        growth = rss_bytes() - before
        assert not fpipe_workers() - threads  # no thread started (or leaked) per step
    # A leak of one micro-batch's activations per step would be 400 x 4 x 16 x 32 x 8 bytes
    # = 6.5 MB at least; allocator noise stays well under 4 MB.
    assert growth < 4 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB"
