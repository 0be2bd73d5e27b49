"""The distributed driver on gloo over 127.0.0.1: each test spawns its ranks (see
tests/distributed_ranks.py) and holds their results to the single-process driver and to
whole-batch ``torch.func``, in float64."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from distributed_ranks import (
    SEQLEN_LR,
    cases,
    concurrent_case,
    data,
    fdist_schedule,
    fresh_state,
    full_params,
    large_case,
    local_steps,
    seqlen_case,
    spawn,
    stateful_case,
    vjp_case,
)
from models import block, forward, mlp_params, mse, whole_batch

import fpipe
import fpipe.distributed as fdist
from fpipe.schedules import gpipe, one_f_one_b

TIGHT = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"world{world}")
def parity(request):
    """Every case of :func:`distributed_ranks.cases` on ``world`` ranks, run once for the
    tests that check it."""
    world = request.param
    results, codes = spawn("parity", world)
    assert codes == [0] * world
    for rank_result in results:
        assert "crash" not in rank_result, rank_result.get("crash")
    return world, results


def test_matches_local_driver_and_whole_batch(parity):
    world, results = parity
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


def test_each_group_carries_messages_one_way_between_two_ranks(parity):
    """Why NCCL cannot stall: no rank ever sends to a peer on a group it receives from that
    peer on (nor posts p2p on the group of the broadcasts), so a receive never queues behind a
    send on one stream. Every message of every case (skips, interleaved, zero-bubble, ZB-V's
    sends to lower ranks) is checked, and each group's sends match its receives."""
    world, results = parity
    for name, *_ in cases(world):
        directions: dict[str, set] = {}
        sent, received = Counter(), Counter()
        for rank, result in enumerate(results):
            assert result[f"{name}: p2p"], name
            for op, peer, group in result[f"{name}: p2p"]:
                assert group != result[f"{name}: group"], (name, rank, op, peer)
                src, dst = (rank, peer) if op == "send" else (peer, rank)
                directions.setdefault(group, set()).add((src, dst))
                (sent if op == "send" else received)[group, src, dst] += 1
        assert all(len(pairs) == 1 for pairs in directions.values()), (name, directions)
        assert sent == received, name


def test_1f1b_with_large_activations_and_changing_shapes():
    """8 and 9 MiB activations and cotangents cross both ways in 1F1B's steady state (the
    pattern that stalls NCCL when sends and receives share a stream); the second step's
    shapes differ from the first's. Same code as NCCL runs: see test_distributed_cuda.py."""
    results, codes = spawn("large", 2)
    assert codes == [0, 0]
    assert all("crash" not in r for r in results), results
    stages, schedule, steps = large_case()
    for (x, target), (loss, grads), rank_steps in zip(
            steps, local_steps(stages, schedule, steps), zip(*(r["steps"] for r in results))):
        expected_loss, expected_grads = whole_batch(stages, mlp_params(2), x, target, mse)
        for rank, (rank_loss, rank_grads) in enumerate(rank_steps):
            torch.testing.assert_close(rank_loss, expected_loss, **TIGHT)
            torch.testing.assert_close(rank_loss, loss, **TIGHT)
            assert sorted(rank_grads) == [rank]
            torch.testing.assert_close(rank_grads[rank], expected_grads[rank], **TIGHT)
            torch.testing.assert_close(rank_grads[rank], grads[rank], **TIGHT)


def test_training_with_a_new_sequence_length_every_step():
    """SGD on batches whose sequence length and size change from step to step (longer, the
    same again, shorter, longer than ever; uneven last micro-batches) matches SGD on the whole
    batch in float64, step by step, under 1F1B and ZB-V on two ranks. A step whose shapes
    repeat the previous one's sends each value as one message; the others fall back to sending
    the new shapes, without error."""
    results, codes = spawn("seqlen", 2)
    assert codes == [0, 0]
    assert all("crash" not in r for r in results), results
    schedules, steps = seqlen_case()
    for name, n_stages in schedules:
        program = fdist_schedule(name, 3).program(n_stages)
        owners = program.placement
        crossing = [sum(owners[s - 1] != owners[s] for s in range(1, n_stages)
                        if rank in (owners[s - 1], owners[s])) * program.n_microbatches
                    for rank in range(2)]  # values each rank sends per step (x on, g back)
        params = mlp_params(n_stages)
        previous = None
        for i, (x, target) in enumerate(steps):
            loss, grads = whole_batch([block] * n_stages, params, x, target, mse)
            for rank, result in enumerate(results):
                rank_loss, rank_grads, sends = result[name][i]
                torch.testing.assert_close(rank_loss, loss, **TIGHT)
                assert sorted(rank_grads) == [s for s in range(n_stages) if owners[s] == rank]
                for s, g in rank_grads.items():
                    torch.testing.assert_close(g, grads[s], **TIGHT)
                if x.shape == previous:
                    assert sends == crossing[rank], (name, i, rank, sends)
                else:
                    assert sends >= crossing[rank], (name, i, rank, sends)
            previous = x.shape
            params = [{k: v - SEQLEN_LR * g[k] for k, v in p.items()}
                      for p, g in zip(params, grads)]


def test_vjp_runs_a_step_in_two_calls_as_torch_func_vjp():
    """``y, vjp_fn = pipe.vjp(x)`` then ``grads, x_grad = vjp_fn(cotangent)``: the output on the
    last rank, each rank's gradients and the input's gradient on the first rank equal
    ``torch.func.vjp`` of the whole batch. In between, other calls are refused; a second
    ``vjp_fn`` call is refused; the pipeline runs whole steps after it; a schedule whose
    forwards are not all first (1F1B) cannot run in two calls."""
    results, codes = spawn("vjp", 2)
    assert codes == [0, 0]
    assert all("crash" not in r for r in results), results
    stages, _, x, cotangent, (x2, target2) = vjp_case()
    params = mlp_params(2)
    y, whole_vjp = torch.func.vjp(lambda ps, x: forward(stages, ps, x), params, x)
    param_grads, x_grad = whole_vjp(cotangent)
    torch.testing.assert_close(results[1]["y"], y, **TIGHT)
    assert results[0]["y"] is None
    for rank, result in enumerate(results):
        grads, rank_x_grad = result["grads"]
        assert sorted(grads) == [rank]
        for key in ("w", "b"):
            torch.testing.assert_close(grads[rank][key], param_grads[rank][key], **TIGHT)
        if rank == 0:
            torch.testing.assert_close(rank_x_grad, x_grad, **TIGHT)
        else:
            assert rank_x_grad is None
        kind, name, message = result["refused"]
        assert (kind, name) == ("error", "RuntimeError")
        assert "waiting for its vjp_fn" in message
        kind, name, message = result["again"]
        assert (kind, name) == ("error", "RuntimeError") and "called already" in message
        loss, grads = result["after"]
        whole_loss, whole_grads = whole_batch(stages, params, x2, target2, mse)
        torch.testing.assert_close(loss, whole_loss, **TIGHT)
        torch.testing.assert_close(grads[rank], whole_grads[rank], **TIGHT)
        kind, name, message = result["1f1b"]
        assert (kind, name) == ("error", "ValueError") and "forwards" in message


def test_concurrent_calls_are_refused_and_mismatched_calls_stop():
    results, codes = spawn("concurrent", 2)
    assert codes == [0, 0]
    assert all("crash" not in r for r in results), results
    schedule, steps = concurrent_case()
    expected = local_steps([block] * 2, schedule, steps)
    for rank, result in enumerate(results):
        assert result["started"]
        kind, *refused = result["refused"]
        assert kind == "error" and refused[0] == "RuntimeError", refused
        assert "already running a step on another thread" in refused[1]
        for outcome, (loss, grads), (x, target) in zip((result["first"], result["second"]),
                                                       expected, steps):
            assert outcome[0] == "ok", outcome
            rank_loss, rank_grads = outcome[1]
            whole_loss, whole_grads = whole_batch([block] * 2, mlp_params(2), x, target, mse)
            torch.testing.assert_close(rank_loss, whole_loss, **TIGHT)
            torch.testing.assert_close(rank_grads[rank], whole_grads[rank], **TIGHT)
            torch.testing.assert_close(rank_loss, loss, **TIGHT)
            torch.testing.assert_close(rank_grads[rank], grads[rank], **TIGHT)
    # rank 0 asked to train while rank 1 asked to infer: both raise, naming the mismatch
    for result in results:
        kind, name, message = result["mixed"]
        assert kind == "error", result["mixed"]
        assert "rank 1 was called for inference (call 3) but rank 0 for value_and_grad " \
               "(call 3)" in message, message
    assert results[0]["mixed"][1] == "PeerError" and results[1]["mixed"][1] == "RuntimeError"


@pytest.fixture(scope="module")
def stage_raises():
    results, codes = spawn("stage_raises", 3)
    assert codes == [0, 0, 0]
    return results


def test_a_stage_raising_stops_every_rank_with_its_name(stage_raises):
    for rank, result in enumerate(stage_raises):
        assert result["where"] == (2, 2, "forward", 2), result  # stage, micro-batch, op, rank
        assert "sample 5 is cursed" in result["message"]
        if rank != 2:  # told by the store: a StageError saying where, and what was raised
            assert result["type"] == "StageError", result
            assert f"rank 2 failed, so rank {rank} stopped" in result["message"]
            assert "stage 2 failed in the forward of micro-batch 2: ValueError: sample 5 is " \
                   "cursed" in result["message"]
        assert "waited" not in result["message"]  # announced, not found out by a timeout
        assert result["again"] == "RuntimeError"  # a stopped pipeline refuses to run


def test_the_failing_rank_raises_the_stage_own_exception(stage_raises):
    assert stage_raises[2]["type"] == "ValueError", stage_raises[2]
    assert stage_raises[2]["message"] == "sample 5 is cursed"


def test_a_dying_rank_does_not_leave_the_others_hanging():
    results, codes = spawn("rank_dies", 3)
    assert codes[2] == 3 and results[2] is None
    for result in results[:2]:
        assert result["type"] in ("PeerError", "StageError"), result
        assert "lost rank 2" in result["message"], result  # the death was noticed:
        assert "waited" not in result["message"], result  # no rank waited out its timeout


def test_a_rank_leaving_its_with_block_on_an_error_stops_the_others_at_once():
    """No rank waits out its 300 s timeout (the spawn's own timeout is 120 s): the one that
    leaves keeps its error; the other, in a step or in close(), raises an error naming it."""
    results, codes = spawn("leaving", 2, timeout=120)
    assert codes == [0, 0], results
    for round_, then in enumerate(("step", "close")):
        assert results[1][then] == ("KeyError", f"'rank 1 gives up in round {round_}'")
        kind, message = results[0][then]
        assert kind == "PeerError", results[0][then]
        assert "rank 1 failed" in message and "KeyError" in message, message
    torch.testing.assert_close(results[0]["after"], results[1]["after"], rtol=0, atol=0)


def test_a_silent_rank_is_timed_out():
    """Rank 2 stalls (alive, sending nothing) for longer than the 5 s timeout: the others give
    up after the timeout, not after the stall, and rank 2 then finds the pipeline stopped."""
    results, codes = spawn("rank_stalls", 3, timeout=40)
    assert codes == [0, 0, 0]
    for result in results[:2]:
        assert result["type"] == "PeerError", result
        # Gave up by the 5 s timeout (its own or its neighbour's, relayed), not after the
        # 12 s stall: waiting that out would have ended in no error at all.
        waited = re.search(r"waited ([0-9.]+) s", result["message"])  # as measured
        assert waited is not None and 5 <= float(waited.group(1)) < 12, result
        assert result["rank"] == 2, result  # the stalled rank, not the waiting neighbour
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
    seen, total = [0, 0], [torch.zeros(8, dtype=torch.float64)] * 2  # by hand
    with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse,
                        state=fresh_state(2)) as local:
        state = local.state
        for i, (x, target) in enumerate(steps):
            loss, grads, state = local.value_and_grad(x, target, state=state)
            # The counting stages' output is the block's: the whole batch's loss and grads.
            whole_loss, whole_grads = whole_batch([block] * 2, params, x, target, mse)
            for s, stage_input in enumerate((x, block(params[0], x))):
                seen[s] += x.shape[0]
                total[s] = total[s] + stage_input.sum(0)
            for rank, result in enumerate(results):
                rank_loss, rank_grads, rank_state = result["steps"][i]
                torch.testing.assert_close(rank_loss, whole_loss, **TIGHT)
                torch.testing.assert_close(rank_loss, loss, **TIGHT)
                assert sorted(rank_state) == [rank]
                assert rank_state[rank]["seen"] == state[rank]["seen"] == seen[rank]
                torch.testing.assert_close(rank_state[rank]["total"], total[rank], **TIGHT)
                torch.testing.assert_close(rank_state[rank]["total"], state[rank]["total"],
                                           **TIGHT)
                for key in ("w", "b"):
                    torch.testing.assert_close(rank_grads[rank][key], whole_grads[rank][key],
                                               **TIGHT)
                for key in ("w", "b"):
                    torch.testing.assert_close(rank_grads[rank][key], grads[rank][key], **TIGHT)
        y, state = local(steps[0][0], state=state)
    torch.testing.assert_close(results[1]["y"], y, **TIGHT)
    assert results[0]["y"] is None
    for rank, result in enumerate(results):
        assert result["state"][rank]["seen"] == state[rank]["seen"] == 7 + 5 + 7


def test_grad_dtype_and_nonfinite_as_in_the_local_pipeline():
    """The distributed face takes the options of ``fpipe.pipeline``: float64 gradient sums for
    float32 parameters equal the local pipeline's, and a non-finite loss is refused on every
    rank, naming the micro-batch, without breaking the pipeline."""
    results, codes = spawn("options", 2)
    assert codes == [0, 0]
    assert all("crash" not in r for r in results), results
    x, target = data(6, 8, seed=13)
    x, target = x.float(), target.float()
    params = mlp_params(2, dtype=torch.float32)
    with fpipe.pipeline([block, block], params, schedule=one_f_one_b(chunks=3), loss_fn=mse,
                        grad_dtype=torch.float64) as local:
        loss, grads = local.value_and_grad(x, target)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"], loss)
        assert sorted(result["grads"]) == [rank]
        for name, g in result["grads"][rank].items():
            assert g.dtype == torch.float64
            torch.testing.assert_close(g, grads[rank][name])
        assert result["refused"] == [1]
        torch.testing.assert_close(result["after"], loss)
        assert torch.isnan(result["ignored"])
