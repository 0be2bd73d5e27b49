"""The distributed driver on gloo over 127.0.0.1: each test spawns its ranks (see
tests/distributed_ranks.py) and holds their results to the single-process driver and to
whole-batch ``torch.func``, in float64."""

from __future__ import annotations

import pytest
import torch
from distributed_ranks import cases, fresh_state, full_params, spawn, stateful_case
from models import mse, whole_batch

import fpipe
import fpipe.distributed as fdist
from fpipe.schedules import gpipe, one_f_one_b

TIGHT = dict(rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world", [2, 4])
def test_matches_local_driver_and_whole_batch(world):
    results, codes = spawn("parity", world)
    assert codes == [0] * world
    for rank_result in results:
        assert "crash" not in rank_result, rank_result.get("crash")
    for name, stages, schedule, steps in cases(world):
        params = full_params(name, len(stages))
        program = schedule.program(len(stages))
        placement = program.placement
        for rank, rank_result in enumerate(results):  # each rank records its own worker only
            assert rank_result[f"{name}: recorded"] == [
                [str(a) for a in actions] if worker == rank else []
                for worker, actions in enumerate(program.workers)]
        with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse) as local:
            for i, (x, target) in enumerate(steps):
                expected_loss, expected_grads = whole_batch(stages, params, x, target, mse)
                local_loss, local_grads = local.value_and_grad(x, target)
                torch.testing.assert_close(local_loss, expected_loss, **TIGHT)
                for rank, rank_result in enumerate(results):
                    loss, grads, y = rank_result[name][i]
                    torch.testing.assert_close(loss, expected_loss, **TIGHT)  # on every rank
                    assert sorted(grads) == [s for s, w in enumerate(placement) if w == rank]
                    for s, g in grads.items():
                        torch.testing.assert_close(g, expected_grads[s], **TIGHT)
                        torch.testing.assert_close(g, local_grads[s], **TIGHT)
                    if rank == placement[-1]:
                        torch.testing.assert_close(y, local(x), **TIGHT)
                    else:
                        assert y is None


def test_a_stage_raising_stops_every_rank_with_its_name():
    results, codes = spawn("stage_raises", 3)
    assert codes == [0, 0, 0]
    for rank, result in enumerate(results):
        assert result["type"] == "StageError", result
        assert (result["rank"], result["stage"], result["microbatch"]) == (2, 2, 2)
        assert "sample 5 is cursed" in result["message"]
        assert "stage 2 failed in the forward of micro-batch 2" in result["message"]
        if rank != 2:
            assert f"rank 2 failed, so rank {rank} stopped" in result["message"]
        assert result["elapsed"] < 4  # well within the 5 s timeout: the failure is announced
        assert result["again"] == "RuntimeError"  # a stopped pipeline refuses to run


def test_a_dying_rank_does_not_leave_the_others_hanging():
    results, codes = spawn("rank_dies", 3)
    assert codes[2] == 3 and results[2] is None
    for result in results[:2]:
        assert result["type"] in ("PeerError", "StageError"), result
        assert "rank 2" in result["message"]
        assert result["elapsed"] < 4


def test_a_silent_rank_is_timed_out():
    """Rank 2 stalls (alive, sending nothing) for longer than the 5 s timeout: the others give
    up after the timeout, not after the stall, and rank 2 then finds the pipeline stopped."""
    results, codes = spawn("rank_stalls", 3, timeout=40)
    assert codes == [0, 0, 0]
    for result in results[:2]:
        assert result["type"] == "PeerError", result
        assert "waited 5 s" in result["message"] or "rank 2" in result["message"], result
        assert result["elapsed"] < 11  # the timeout, not the 12 s stall
    assert results[2]["type"] is not None  # the stalled rank does not carry on as if all is well


def test_my_stages_follows_the_program_placement():
    assert fdist.my_stages(gpipe(chunks=2), 4, rank=1) == (1,)
    assert fdist.my_stages(one_f_one_b(chunks=2), 2, rank=0) == (0,)
    assert fdist.backend_for("cpu") == "gloo" and fdist.backend_for("cuda:0") == "nccl"


def test_state_flows_as_in_the_local_driver():
    results, codes = spawn("stateful", 2)
    assert codes == [0, 0]
    assert all("crash" not in r for r in results), results
    stages, schedule, steps = stateful_case()
    params = full_params("stateful", 2)
    with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse,
                        state=fresh_state(2)) as local:
        state = local.state
        for i, (x, target) in enumerate(steps):
            loss, grads, state = local.value_and_grad(x, target, state=state)
            for rank, result in enumerate(results):
                rank_loss, rank_grads, rank_state = result["steps"][i]
                torch.testing.assert_close(rank_loss, loss, **TIGHT)
                assert sorted(rank_state) == [rank]
                assert rank_state[rank]["seen"] == state[rank]["seen"]
                torch.testing.assert_close(rank_state[rank]["total"], state[rank]["total"],
                                           **TIGHT)
                for key in ("w", "b"):
                    torch.testing.assert_close(rank_grads[rank][key], grads[rank][key], **TIGHT)
        y, state = local(steps[0][0], state=state)
    torch.testing.assert_close(results[1]["y"], y, **TIGHT)
    assert results[0]["y"] is None
    for rank, result in enumerate(results):
        assert result["state"][rank]["seen"] == state[rank]["seen"] == 7 + 5 + 7
