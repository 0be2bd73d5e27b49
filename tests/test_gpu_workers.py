"""Stages that share a CUDA device share a worker in ``fpipe.pipeline`` (as torchgpipe runs one
thread per device), CPU stages keep theirs, and a ``Program`` given as such runs as it is.

The merge is a pure function of the program and the stages' devices, so it is checked on any
machine; ``tests/test_cuda.py`` runs pipelines built this way on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import block, mlp_params, mse

import fpipe
from fpipe._runtime.driver import one_worker_per_gpu
from fpipe.schedules import Op, gpipe, one_f_one_b, validate
from fpipe.schedules.strategies import programs

R = Op.RECOMPUTE
DEVICES = [torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)]


@given(programs(), st.data())
def test_workers_sharing_a_gpu_are_merged_and_nothing_else_changes(program, data):
    devices = [data.draw(st.sampled_from(DEVICES)) for _ in range(program.n_stages)]
    shared = validate(one_worker_per_gpu(program, devices))
    home = shared.placement
    for s in range(program.n_stages):
        for t in range(program.n_stages):
            same_gpu = devices[s] == devices[t] and devices[s].type == "cuda"
            if same_gpu or program.placement[s] == program.placement[t]:
                assert home[s] == home[t]
    # no more merged than that: a worker without a GPU stage keeps to itself
    cpu_only = {w for w in range(program.n_workers)
                if all(devices[s].type == "cpu" for s in range(program.n_stages)
                       if program.placement[s] == w)}
    for w in cpu_only:
        stages = {s for s in range(program.n_stages) if program.placement[s] == w}
        if stages:
            assert {s for s in range(program.n_stages) if home[s] == home[min(stages)]} == stages
    for s in range(program.n_stages):  # each stage's actions keep their order (recomputes
        # go just before their backward, as colocate puts them)
        assert [a for a in shared.workers[home[s]] if a.stage == s and a.op is not R] == [
            a for a in program.workers[program.placement[s]] if a.stage == s and a.op is not R]
    if shared.n_workers == program.n_workers:
        assert shared is program


def test_four_stages_on_two_gpus_run_on_two_workers():
    devices = [DEVICES[1], DEVICES[1], DEVICES[2], DEVICES[2]]
    for schedule in (gpipe(4), one_f_one_b(4)):
        shared = one_worker_per_gpu(schedule.program(4), devices)
        assert shared.placement == (0, 0, 1, 1)
    assert one_worker_per_gpu(gpipe(4).program(4), [DEVICES[0]] * 4).placement == (0, 1, 2, 3)
    mixed = one_worker_per_gpu(gpipe(4).program(4), [DEVICES[1], DEVICES[0], DEVICES[1],
                                                     DEVICES[0]])
    assert mixed.placement == (0, 1, 0, 2)


def test_cpu_stages_keep_a_worker_each():
    with fpipe.pipeline([block] * 3, mlp_params(3), schedule=gpipe(2), loss_fn=mse) as pipe:
        assert pipe.program.n_workers == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stages_on_one_gpu_share_a_worker_unless_a_program_says_otherwise():
    params = [{k: v.cuda() for k, v in p.items()} for p in mlp_params(3, dtype=torch.float32)]
    x = torch.randn(8, 8, device="cuda")
    with fpipe.pipeline([block] * 3, params, schedule=gpipe(4), loss_fn=mse) as pipe:
        assert pipe.program.n_workers == 1
        shared = pipe.value_and_grad(x, x)
    explicit = gpipe(4).program(3)
    with fpipe.pipeline([block] * 3, params, schedule=explicit, loss_fn=mse) as pipe:
        assert pipe.program is explicit and pipe.program.n_workers == 3
        separate = pipe.value_and_grad(x, x)
    torch.testing.assert_close(shared, separate, rtol=0, atol=0)
