"""Ranks built differently are refused when the pipeline is built, alike on every rank, before
any step (tests/agreement_ranks.py runs the ranks): the field, both ranks and both values are
named. Before, replicas of another width aborted inside gloo's first gradient reduction, ranks
given other schedules deadlocked or raised errors that looked like their stage's."""

from __future__ import annotations

import pytest
import torch
from agreement_ranks import MESH_CASES, PIPELINE_CASES
from distributed_ranks import data, spawn
from models import block, mlp_params, mse, whole_batch

from fpipe._runtime.ranks.agreement import check, fingerprint
from fpipe.errors import PlacementError
from fpipe.schedules import gpipe, one_f_one_b

#: What each case's error must say: the field and both values, as quoted.
SAID = {
    "width": ("stage 1's parameters", "(8, 8)", "(6, 6)"),
    "dtype": ("stage 0's parameters", "torch.float64", "torch.float32"),
    "order": ("worker 0's actions", "'0F0 0F1 0B0 0B1'", "'0F0 0F1 0B0 0R1 0B1'"),
    "chunks": ("different chunks", "2", None),
    "autodiff": ("different autodiff", "'autograd'", "'func'"),
    "grad_dtype": ("different grad_dtype", "'torch.float32'", "None"),
    "frozen": ("stage 1's parameters", "('b', (8,), 'torch.float64')",
               "('b', (8,), 'torch.float64', 'frozen')"),
}


def _refused_alike(results: list, cases: tuple) -> None:
    for name, odd, _ in cases:
        errors = {r: result[name] for r, result in enumerate(results)}
        kinds = {error[0] if error else None for error in errors.values()}
        assert kinds == {"PlacementError"}, (name, errors)
        messages = {error[1] for error in errors.values()}
        assert len(messages) == 1, (name, messages)  # one error, alike on every rank
        message = messages.pop()
        field, *values = SAID[name]
        assert field in message, (name, message)
        for value in values:
            if value is not None:
                assert value in message, (name, value, message)
        assert f"rank {odd}" in message, (name, message)
        assert "no step was run" in message


def _loss_is_the_whole_batch(results: list) -> None:
    x, target = data(4, 8, seed=40)
    expected, _ = whole_batch([block, block], mlp_params(2), x, target, mse)
    for result in results:  # a pipeline built alike after the refusals still runs
        torch.testing.assert_close(result["loss"], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scenario, world, timeout, cases", [
    ("mesh", 4, 180, MESH_CASES),  # a (dp=2, pp=2) mesh: replicas and pipeline ranks
    ("two", 2, 120, PIPELINE_CASES)])  # one pipeline on 2 ranks
def test_ranks_that_differ_are_refused_alike_at_build(scenario, world, timeout, cases):
    results, codes = spawn(f"agreement_ranks:{scenario}", world, timeout=timeout)
    assert codes == [0] * world, results
    assert all("crash" not in r for r in results), results
    _refused_alike(results, cases)
    _loss_is_the_whole_batch(results)


def _printed(schedule, worker=0):
    return fingerprint((0, 1), worker, None, schedule.program(2), {"autodiff": "autograd"},
                       {worker: mlp_params(2)[worker]}, None)


def test_a_long_value_is_quoted_around_its_difference():
    a, b = _printed(gpipe(40)), _printed(one_f_one_b(40), worker=1)
    with pytest.raises(PlacementError, match="worker 0's actions") as caught:
        check([a, b])
    assert "..." in str(caught.value) and len(str(caught.value)) < 1000
