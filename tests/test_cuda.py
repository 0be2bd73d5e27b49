"""The GPU checklist: the numerical checks again with stages on CUDA (skipped without a GPU).

Several stages share ``cuda:0`` on different workers (given as programs: a schedule value puts
the stages of one GPU on one worker), so values go through the transport and
the compute streams, copy streams and events between them are exercised; a mixed CPU/CUDA
pipeline makes values cross devices. Races are made likely rather than hoped for: stages sleep
on the GPU (``torch.cuda._sleep``) before their outputs and their input gradients are written,
so a kernel that is not ordered after them reads stale memory, and every step has new inputs
so stale memory cannot hold the right answer. A hang (a deadlock between fpipe's workers and
autograd's device threads) fails within a timeout instead of hanging the run.
``docs/gpu-checklist.md`` says how to run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import optree
import pytest
import torch
from models import (
    OnBackward,
    block,
    forward,
    mlp_params,
    mse,
    two_stages_per_worker,
    whole_batch,
)

import fpipe
from fpipe.schedules import colocate, gpipe, one_f_one_b, zero_bubble

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TIGHT = dict(rtol=1e-10, atol=1e-12)


def to(params, devices):
    return [optree.tree_map(lambda t, d=d: t.to(d), p) for p, d in zip(params, devices)]


@pytest.mark.parametrize("devices", [["cuda:0"] * 4, ["cpu", "cuda:0", "cuda:0", "cpu"]])
@pytest.mark.parametrize("schedule", [gpipe(chunks=4), gpipe(chunks=3, remat="never"),
                                      one_f_one_b(chunks=5, remat="always")])
def test_matches_whole_batch_on_cuda(devices, schedule):
    params = to(mlp_params(4), devices)
    x = torch.randn(11, 8, dtype=torch.float64, device=devices[0])
    target = torch.randn(11, 8, dtype=torch.float64, device=devices[-1])

    def moving(stage_device):
        def stage(p, h):
            return block(p, h.to(stage_device))
        return stage

    reference_stages = [moving(d) for d in devices]
    expected_loss, expected_grads = whole_batch(reference_stages, params, x, target, mse)
    with fpipe.pipeline([block] * 4, params, schedule=schedule, loss_fn=mse) as pipe:
        for _ in range(3):  # repeated steps reuse the streams
            loss, grads = pipe.value_and_grad(x, target)
            torch.testing.assert_close(loss.cpu(), expected_loss.cpu(), **TIGHT)
            for g, e in zip(optree.tree_leaves(grads), optree.tree_leaves(expected_grads)):
                assert g.device == e.device
                torch.testing.assert_close(g, e, **TIGHT)
        y = pipe(x)
        torch.testing.assert_close(y, forward(reference_stages, params, x), **TIGHT)


def assert_same_under_remat(stages):
    """A seeded step on cuda:0 gives bitwise the same loss and gradients with and without
    recomputes: every recompute drew what its forward drew."""
    params = to(mlp_params(len(stages)), ["cuda:0"] * len(stages))
    x = torch.randn(8, 8, dtype=torch.float64, device="cuda:0")
    results = []
    for remat in ("never", "always"):
        with fpipe.pipeline(stages, params, schedule=gpipe(chunks=4, remat=remat),
                            loss_fn=mse) as pipe:
            torch.manual_seed(0)
            results.append(pipe.value_and_grad(x, x))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(optree.tree_leaves(grads_a), optree.tree_leaves(grads_b)):
        assert torch.equal(a, b)


def test_dropout_on_cuda_recompute_matches():
    import torch.nn.functional as F

    def dropout_block(p, x):
        return F.dropout(block(p, x), p=0.3, training=True)

    assert_same_under_remat([dropout_block] * 3)


# -- Races made likely: stages that sleep on the GPU --------------------------------------------

SLEEP = 5_000_000  # GPU cycles, a few milliseconds: wider than any host hand-off


def _sleep_then_clone(grad):
    """Input gradients written late (a sleep on the current, compute, stream): a reader not
    ordered after them reads stale memory."""
    if grad.is_cuda:
        torch.cuda._sleep(SLEEP)
    return grad.clone()


def sleepy(p, x):
    """``block`` that sleeps before its forward and before its input gradient (on CUDA)."""
    if x.is_cuda:
        torch.cuda._sleep(SLEEP)
    return OnBackward.apply(block(p, x), _sleep_then_clone)


def moving(stage, device):
    """``stage`` with its input moved to ``device`` first: the reference's hand-off."""
    def moved(p, h):
        return stage(p, h.to(device))
    return moved


def microbatch_reference(params, devices, x, target, chunks):
    """Loss and gradients as the pipeline computes them: per micro-batch, weighted by its
    share, each gradient cast to float32 and summed (the pipeline's ``grad_dtype``)."""
    stages = [moving(block, d) for d in devices]
    loss, grads, n = 0.0, None, x.shape[0]
    for xs, ts in zip(x.tensor_split(chunks), target.tensor_split(chunks)):
        part_loss, part = whole_batch(stages, params, xs, ts,
                                      lambda y, t, w=xs.shape[0] / n: mse(y, t) * w)
        part = optree.tree_map(lambda g: g.float(), part)
        loss = loss + part_loss.float()
        grads = part if grads is None else optree.tree_map(torch.add, grads, part)
    return loss, grads


def assert_close_trees(actual, expected, **tol):
    for a, e in zip(optree.tree_leaves(actual), optree.tree_leaves(expected)):
        assert a.device == e.device and a.dtype == e.dtype
        torch.testing.assert_close(a, e, **tol)


LOSS_TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5),
                  torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
SLEEPY_SCHEDULES = [gpipe(chunks=4, remat="always"), one_f_one_b(chunks=4),
                    zero_bubble(chunks=4)]


def test_a_cuda_stage_drawing_from_the_cpu_generator_is_reproduced():
    """torchgpipe saves and restores both generators; fpipe seeds both for a CUDA stage."""
    def cpu_noise_block(p, x):
        noise = torch.rand(x.shape, dtype=x.dtype).to(x.device)  # drawn on the CPU
        return block(p, x) * noise

    assert_same_under_remat([block, cpu_noise_block, block])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("devices", [["cuda:0"] * 3, ["cpu", "cuda:0", "cuda:0"],
                                     ["cuda:0", "cpu", "cuda:0"]])
@pytest.mark.parametrize("schedule", SLEEPY_SCHEDULES, ids=["gpipe", "1f1b", "zero-bubble"])
def test_sleepy_stages_match_the_reference(dtype, devices, schedule):
    params = to(mlp_params(3, dtype=dtype), devices)
    # The program itself, so that each stage has a worker of its own: stages sharing a GPU
    # share a worker when the pipeline is given a schedule value.
    with fpipe.pipeline([sleepy] * 3, params, schedule=schedule.program(3), loss_fn=mse,
                        grad_dtype=torch.float32) as pipe:
        for step in range(3):  # new inputs every step: stale memory is never the answer
            g = torch.Generator().manual_seed(step)
            x = torch.randn(12, 8, generator=g).to(devices[0], dtype)
            target = torch.randn(12, 8, generator=g).to(devices[-1], dtype)
            loss, grads = pipe.value_and_grad(x, target)
            expected_loss, expected = microbatch_reference(params, devices, x, target, 4)
            # The loss is summed in its dtype, the reference's in float32.
            torch.testing.assert_close(loss.float(), expected_loss, **LOSS_TOLERANCE[dtype])
            assert_close_trees(grads, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("schedule", [colocate(gpipe(chunks=4).program(4), [0, 1, 0, 1]),
                                      two_stages_per_worker(4)], ids=["colocated", "looped"])
def test_hand_offs_on_one_gpu(schedule):
    """Four stages on cuda:0, two per worker: values go through the transport between
    workers (and not between a worker's own stages), with no copy to order them."""
    devices = ["cuda:0"] * 4
    params = to(mlp_params(4, dtype=torch.float32), devices)
    with fpipe.pipeline([sleepy] * 4, params, schedule=schedule, loss_fn=mse,
                        grad_dtype=torch.float32) as pipe:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, target = (torch.randn(8, 8, generator=g).cuda() for _ in range(2))
            loss, grads = pipe.value_and_grad(x, target)
            expected_loss, expected = microbatch_reference(params, devices, x, target, 4)
            torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-5)
            assert_close_trees(grads, expected, rtol=1e-4, atol=1e-5)


def test_a_step_run_under_a_side_stream():
    """The caller's current stream is a side stream: the step must see what was enqueued on it
    (its input is written there, late), and what the caller reads there after the step must
    see the step's results."""
    devices = ["cuda:0"] * 3
    params = to(mlp_params(3, dtype=torch.float32), devices)
    g = torch.Generator().manual_seed(0)
    source, target = (torch.randn(8, 8, generator=g).cuda() for _ in range(2))
    expected_loss, expected = microbatch_reference(params, devices, source, target, 4)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with fpipe.pipeline([sleepy] * 3, params, schedule=one_f_one_b(chunks=4), loss_fn=mse,
                        grad_dtype=torch.float32) as pipe, torch.cuda.stream(side):
        x = torch.empty_like(source)
        torch.cuda._sleep(SLEEP)
        x.copy_(source)  # lands late, on the side stream
        loss, grads = pipe.value_and_grad(x, target)
        checks = (loss.clone(), optree.tree_map(torch.clone, grads))  # read on the side stream
    side.synchronize()
    torch.testing.assert_close(checks[0], expected_loss, rtol=1e-4, atol=1e-5)
    assert_close_trees(checks[1], expected, rtol=1e-4, atol=1e-5)


def test_an_input_on_the_gpu_for_a_first_stage_on_the_cpu():
    """The batch crosses from CUDA to the CPU before the step: the copy must land before the
    first stage reads it (a non-blocking CUDA-to-CPU copy would not wait)."""
    devices = ["cpu", "cuda:0"]
    params = to(mlp_params(2, dtype=torch.float32), devices)
    g = torch.Generator().manual_seed(0)
    source, target = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g).cuda()
    expected_loss, expected = microbatch_reference(params, devices, source, target, 2)
    with fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=2), loss_fn=mse,
                        grad_dtype=torch.float32) as pipe:
        x = torch.zeros(8, 8, device="cuda:0")
        torch.cuda._sleep(SLEEP)
        x.copy_(source, non_blocking=True)  # lands late, on the caller's stream
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-5)
    assert_close_trees(grads, expected, rtol=1e-4, atol=1e-5)


def test_memory_is_flat_over_steps():
    """Twenty steps after a warm-up leave no more memory allocated than the first ones: no
    value, event or ``record_stream`` keeps a step's tensors alive."""
    devices = ["cuda:0", "cpu", "cuda:0", "cuda:0"]
    params = to(mlp_params(4, width=64, dtype=torch.float32), devices)
    x, target = torch.randn(64, 64, device="cuda:0"), torch.randn(64, 64, device="cuda:0")
    allocated = []
    with fpipe.pipeline([sleepy] * 4, params, schedule=one_f_one_b(chunks=4), loss_fn=mse,
                        grad_dtype=torch.float32) as pipe:
        for step in range(25):
            loss, grads = pipe.value_and_grad(x, target)
            del loss, grads
            torch.cuda.synchronize()
            if step >= 5:  # after the warm-up
                allocated.append(torch.cuda.memory_allocated())
    assert max(allocated[10:]) <= max(allocated[:10]), allocated


SEEN: set = set()  # the dtypes matmul_block's matmul ran in


def matmul_block(p, x):
    """``block`` whose matmul autocast runs in bfloat16; it notes the dtype it ran in."""
    y = x @ p["w"]
    SEEN.add(y.dtype)
    return torch.tanh(y + p["b"])


def test_the_callers_autocast_reaches_the_stages():
    devices = ["cuda:0"] * 3
    params = to(mlp_params(3, dtype=torch.float32), devices)
    g = torch.Generator().manual_seed(0)
    x, target = (torch.randn(8, 8, generator=g).cuda() for _ in range(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected_loss, expected = whole_batch([matmul_block] * 3, params, x, target, mse)
    SEEN.clear()
    # the program itself, so that the stages run on worker threads of their own
    with fpipe.pipeline([matmul_block] * 3, params, schedule=gpipe(chunks=4).program(3),
                        loss_fn=mse) as pipe, torch.autocast("cuda", dtype=torch.bfloat16):
        loss, grads = pipe.value_and_grad(x, target)
    assert SEEN == {torch.bfloat16}, "the stages did not run under the caller's autocast"
    torch.testing.assert_close(loss, expected_loss, rtol=5e-2, atol=2e-2)
    for a, e in zip(optree.tree_leaves(grads), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, e, rtol=5e-2, atol=2e-2)


def test_recorded_spans_on_one_gpu_follow_the_program_and_do_not_overlap():
    from test_timeline import check  # the checks of a recorded timeline on the CPU

    schedule = one_f_one_b(chunks=4)
    program = schedule.program(3)
    recorder = fpipe.Recorder()
    params = to(mlp_params(3, dtype=torch.float32), ["cuda:0"] * 3)
    x = torch.randn(8, 8, device="cuda:0")
    # the program itself, so that each stage has a worker of its own (a schedule value would
    # put the three stages of cuda:0 on one)
    with fpipe.pipeline([sleepy] * 3, params, schedule=program, loss_fn=mse) as pipe:
        pipe.value_and_grad(x, x, record=recorder)
    check(recorder.timeline, program, {a for actions in program.workers for a in actions})
    spans = sorted((s for spans in recorder.timeline for s in spans), key=lambda s: s.start)
    for span, after in zip(spans, spans[1:]):  # one device, one compute stream
        assert span.end <= after.start, f"{span.action} overlaps {after.action}"


# -- The module face, in a child process: a deadlock fails instead of hanging the run ----------

HANG_TIMEOUT = 120  # seconds; a step of this model takes milliseconds

GPIPE_CHECK = """
import copy, faulthandler, sys, torch
import torch.nn.functional as F
from torch import nn
import fpipe

faulthandler.dump_traceback_later({timeout}, exit=True)  # stacks of every thread, then fail
devices = {devices!r}
torch.manual_seed(0)
plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 4)).double()
piped = fpipe.GPipe(copy.deepcopy(plain), balance=[2, 3], devices=devices, chunks=4)
for step in range(3):
    x = torch.randn(12, 8, dtype=torch.float64)
    target = torch.randn(12, 4, dtype=torch.float64)
    plain.zero_grad()
    piped.zero_grad()
    x_plain, x_piped = x.clone().requires_grad_(), x.to(devices[0]).requires_grad_()
    F.mse_loss(plain(x_plain), target).backward()
    output = piped(x_piped)
    F.mse_loss(output, target.to(output.device)).backward()
    torch.testing.assert_close(output.cpu(), plain(x_plain).detach())
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-7, atol=1e-9, msg=name)
    torch.testing.assert_close(x_piped.grad.cpu(), x_plain.grad, rtol=1e-7, atol=1e-9)
print("ok")
"""


@pytest.mark.parametrize("devices", [["cpu", "cuda:0"], ["cuda:0", "cuda:0"],
                                     ["cuda:0", "cpu"]])
def test_gpipe_module_backward_finishes_and_matches(devices):
    """``loss.backward()`` through ``fpipe.GPipe``: autograd runs the pipeline's backward on
    its device thread for the output's device, and fpipe's workers run vjps that need autograd
    too. It runs in a child process, so a deadlock fails (with every thread's stack printed)
    and leaves no thread stuck in this one."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root), os.environ.get("PYTHONPATH", "")]))
    script = textwrap.dedent(GPIPE_CHECK).format(devices=devices, timeout=HANG_TIMEOUT)
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=HANG_TIMEOUT + 30)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"fpipe.GPipe's backward on {devices} hung:\n{hung.stderr}")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
