"""Pipeline x data parallel on gloo over 127.0.0.1 (tests/data_parallel_ranks.py runs the
ranks): two replicas of a two-worker pipeline, each given its own shard of the global batch,
return the loss and gradients of the WHOLE batch, computed here in one process with
``torch.func`` in float64; and close() leaves nothing for destroy_process_group to trip on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from data_parallel_ranks import (
    ACCUMULATED,
    BN_CHUNKS,
    BN_SHARDS,
    LR,
    MESH_CASES,
    bn_modules,
    bn_steps,
    mesh_steps,
    shard,
    uneven_steps,
)
from distributed_ranks import data, fdist_schedule, spawn
from models import block, mlp_params, mse, whole_batch

from fpipe._runtime.instructions import compiled
from fpipe._runtime.ranks.data_parallel import DataParallel, GradReduce, _buckets, mesh_groups

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _ok(results: list, codes: list) -> None:
    for result in results:
        assert result is not None and "crash" not in result, result
    assert codes == [0] * len(codes)


def _sgd_steps(stages: list, params: list, steps: list) -> list:
    """(loss, grads) of each whole-batch step, SGD between them, as the ranks train."""
    out = []
    for x, target in steps:
        loss, grads = whole_batch(stages, params, x, target, mse)
        out.append((loss, grads))
        params = [{k: v - LR * g[k] for k, v in p.items()} for p, g in zip(params, grads)]
    return out


def _check(rank_steps: list, expected: list, held: list) -> None:
    for (loss, grads), (want_loss, want_grads) in zip(rank_steps, expected, strict=True):
        torch.testing.assert_close(loss, want_loss, **TIGHT)
        assert sorted(grads) == held
        for s in held:
            torch.testing.assert_close(grads[s], want_grads[s], **TIGHT)


def _bn_alone(start: list, x: torch.Tensor) -> list:
    """Each stage's new state when one process runs the batch ``x`` alone, in plain torch:
    a stage's BatchNorm updates its running statistics once from its whole input, which is
    the previous stage's output normalised per micro-batch (as the pipeline runs it)."""
    out, h = [], x
    with torch.no_grad():
        for part, state in zip(bn_modules(), start):
            conv, bn = part[0], part[1]
            z = conv(h)
            mean, var = state["1.running_mean"].clone(), state["1.running_var"].clone()
            F.batch_norm(z, mean, var, training=True, momentum=bn.momentum, eps=bn.eps)
            out.append({**state, "1.running_mean": mean, "1.running_var": var,
                        "1.num_batches_tracked": state["1.num_batches_tracked"] + 1})
            h = torch.cat([F.batch_norm(piece, None, None, bn.weight, bn.bias, training=True,
                                        eps=bn.eps) for piece in z.tensor_split(BN_CHUNKS)])
    return out


def _share_mean(per_replica: list) -> list:
    """The replicas' states (each a list of stage dicts) averaged by their shares of the
    batch; integer leaves are the first replica's (the replicas' are equal here)."""
    shares = [n / sum(BN_SHARDS) for n in BN_SHARDS]
    return [{k: sum(w * states[s][k] for w, states in zip(shares, per_replica))
             if v.is_floating_point() else v for k, v in per_replica[0][s].items()}
            for s in range(len(per_replica[0]))]


def test_replicas_state_is_the_share_weighted_mean_the_first_replicas_or_their_own():
    """A real (deferred) BatchNorm on both workers of a (2, 2) mesh, shards of 5 and 3
    samples, two training steps threading the state, then (with "mean") a stateful inference
    call: after each call every replica holds, bitwise alike, the share-weighted mean of what
    each would have computed alone; "broadcast" gives replica 0's; None keeps each its own,
    which differ. Last, a replica that never comes stops the other's reduction with a
    PeerError within the timeout."""
    from fpipe.stages import from_modules

    results, codes = spawn("data_parallel_ranks:bn_state", 4, timeout=120)
    _ok(results, codes)
    start = from_modules(bn_modules(), stateful=True).state
    calls = bn_steps()
    shards = [[shard(x, r, BN_SHARDS) for r in (0, 1)] for x, _ in calls]
    expected = {"mean": [], "broadcast": [], None: []}
    mean, first, own = start, start, [start, start]
    for call, xs in enumerate(shards):
        mean = _share_mean([_bn_alone(mean, x) for x in xs])
        expected["mean"].append([mean, mean])
        if call < 2:
            first = _bn_alone(first, xs[0])
            own = [_bn_alone(own[r], xs[r]) for r in (0, 1)]
            expected["broadcast"].append([first, first])
            expected[None].append(own)
    for how, calls_expected in expected.items():
        for call, want in enumerate(calls_expected):
            for rank, result in enumerate(results):
                replica, worker = divmod(rank, 2)
                got = {k: torch.tensor(v, dtype=getattr(torch, dtype))
                       for k, (dtype, v) in result[how][call].items()}
                assert sorted(got) == sorted(want[replica][worker]), (how, call, rank)
                for name, value in want[replica][worker].items():
                    torch.testing.assert_close(got[name], value, **TIGHT,
                                               msg=f"{how} call {call} rank {rank} {name}")
                if how is not None:  # both replicas hold the very same bits
                    assert result[how][call] == results[(rank + 2) % 4][how][call]
    for rank, result in enumerate(results):  # floats reduced, integers broadcast or kept
        replica = rank // 2
        own = {"flag": ("torch.bool", [replica == 1, True]), "ids": ("torch.int64", [replica, 7]),
               "n": replica, "none": None, "x": ("torch.float32", replica + 1.0)}
        assert result["None odd"] == own
        assert result["mean odd"] == {**own, "x": ("torch.float32", 5 / 8 * 1 + 3 / 8 * 2)}
        assert result["broadcast odd"] == {**own, "flag": ("torch.bool", [False, True]),
                                           "ids": ("torch.int64", [0, 7]),
                                           "x": ("torch.float32", 1.0)}
    for rank in (0, 1):  # replica 1 never reduced its state: replica 0 stopped in time
        kind, message, waited = results[rank]["gone"]
        assert kind == "PeerError" and "the state of stage(s)" in message, message
        assert waited < 30
    assert results[2]["gone"] is None and results[3]["gone"] is None
    for worker in (0, 1):  # left alone, the replicas' statistics drift apart
        assert (results[worker][None][1]["1.running_mean"]
                != results[worker + 2][None][1]["1.running_mean"])


def test_two_replicas_on_a_mesh_give_the_whole_batch_loss_and_gradients():
    """The issue's acceptance test: a ("dp", "pp") = (2, 2) mesh, GPipe, 1F1B (one bucket per
    leaf) and ZB-V, two steps each with SGD between; every rank has the global loss and the
    global batch's gradients of its stages."""
    results, codes = spawn("data_parallel_ranks:mesh", 4, timeout=120)
    _ok(results, codes)
    for name, chunks, n_stages, _ in MESH_CASES:
        placement = fdist_schedule(name, chunks).program(n_stages).placement
        expected = _sgd_steps([block] * n_stages, mlp_params(n_stages), mesh_steps())
        for rank, result in enumerate(results):
            replica, worker = divmod(rank, 2)
            assert result[f"{name}: ranks"] == (2 * replica, 2 * replica + 1)
            held = [s for s, w in enumerate(placement) if w == worker]
            _check(result[name], expected, held)


def test_accumulated_calls_on_plain_replicas_give_one_whole_batch_call_s_gradients():
    """``accumulate=True`` without FSDP: two calls on a (2, 2) mesh, shards of 5 and 3 then 4
    and 4; each call's loss is its global batch's, and the last call's gradients those of one
    whole-batch call on both batches, each batch's mean loss summed (torch.func, float64)."""
    results, codes = spawn("data_parallel_ranks:accumulating", 4, timeout=120)
    _ok(results, codes)
    batches = [data(8, 8, seed=seed) for seed, _ in ACCUMULATED]
    x, target = (torch.cat(parts) for parts in zip(*batches))

    def summed(y, t):  # each batch's mean, summed: what accumulated calls return
        return sum(mse(y[i:i + 8], t[i:i + 8]) for i in (0, 8))
    for name, chunks, n_stages in (("1f1b", 2, 2), ("zbv", 3, 4)):
        placement = fdist_schedule(name, chunks).program(n_stages).placement
        stages, params = [block] * n_stages, mlp_params(n_stages)
        _, grads = whole_batch(stages, params, x, target, summed)
        losses = [whole_batch(stages, params, *batch, mse)[0] for batch in batches]
        for rank, result in enumerate(results):
            (first_loss, none), (loss, got) = result[name]
            assert none is None  # the accumulating call returns no gradients
            torch.testing.assert_close(first_loss, losses[0], **TIGHT)
            torch.testing.assert_close(loss, losses[1], **TIGHT)
            held = [s for s, w in enumerate(placement) if w == rank % 2]
            assert sorted(got) == held
            for s in held:
                torch.testing.assert_close(got[s], grads[s], **TIGHT)


def test_explicit_groups_uneven_shards_vjp_and_gradients_left_alone():
    results, codes = spawn("data_parallel_ranks:groups", 4, timeout=120)
    _ok(results, codes)
    (x, target), = uneven_steps()
    params = mlp_params(2)
    expected = _sgd_steps([block, block], params, [(x, target)])
    loss = expected[0][0]
    for rank, result in enumerate(results):
        replica, worker = divmod(rank, 2)
        assert result["held"] == (worker,)
        assert result["ranks"] == (2 * replica, 2 * replica + 1)
        _check(result["train"], expected, [worker])
        kind, message = result["short"]
        assert kind == "BatchError"
        assert ("fewer than chunks=2" if replica == 1 else "replica") in message
        torch.testing.assert_close(result["after"], loss, **TIGHT)
        grads, _ = result["vjp"]
        torch.testing.assert_close(grads[worker], expected[0][1][worker], **TIGHT)
        # grad_reduce=None: the global loss, but this replica's own shard's gradients.
        alone_loss, alone = result["alone"]
        torch.testing.assert_close(alone_loss, loss, **TIGHT)
        xs, ts = shard(x, replica, (5, 3)), shard(target, replica, (5, 3))
        _, own = whole_batch([block, block], params, xs, ts, mse)
        torch.testing.assert_close(alone[worker], own[worker], **TIGHT)
        kind, message = result["crossed"]  # data_parallel groups pairing worker 0 with 1
        assert kind == "PlacementError" and "data_parallel group" in message


def test_a_failure_in_one_replica_stops_every_rank_of_both():
    results, codes = spawn("data_parallel_ranks:replica_fails", 4, timeout=120)
    _ok(results, codes)
    assert results[2]["error"] == ("ValueError", "sample 99 is cursed")  # the cursed stage
    for rank in (0, 1, 3):  # the other replica too, woken from its gradient reduction
        kind, message = results[rank]["error"]
        assert kind == "StageError", (rank, kind, message)  # not "lost rank N": the original
        assert f"rank 2 failed, so rank {rank} stopped" in message, message
        assert "ValueError: sample 99 is cursed" in message, message


def test_close_then_destroy_process_group_is_safe_and_later_calls_raise():
    results, codes = spawn("data_parallel_ranks:closing", 2, timeout=120)
    _ok(results, codes)
    for result in results:
        assert len(result["rounds"]) == 3
        for _, after, released in result["rounds"]:
            assert "was closed" in after
            assert released  # no reference left to fpipe's groups


def test_a_pipeline_never_closed_lets_go_of_its_groups_at_exit():
    results, codes = spawn("data_parallel_ranks:unclosed", 2, timeout=120, fresh=True)
    _ok(results, codes)  # and both processes exited cleanly
    for result in results:
        assert result["before"]
        assert result["after"] == (None, {}, None)


def test_a_stage_gradients_are_reduced_as_soon_as_they_are_final():
    """ZB-V on two workers: worker 0 holds stages 0 and 3; stage 3's last weight gradient
    comes before stage 0's backwards, so its reduction is launched mid-plan."""
    program = fdist_schedule("zbv", 3).program(4)
    plan = compiled({}, program, True, False)
    actions = plan[0]
    cuts = dict((stages[0], end) for end, stages in GradReduce.cuts(None, actions))
    assert set(cuts) == {0, 3}
    assert cuts[3] < cuts[0] == len(actions)
    assert all(a[0].op.name not in ("BACKWARD", "BACKWARD_WEIGHT") or a[1] != 3
               for a in actions[cuts[3]:])


class _Mesh:
    def __init__(self, names):
        self.mesh_dim_names, self.ndim = names, len(names)


def test_a_mesh_needs_dp_and_pp_dimensions_and_no_other_groups():
    with pytest.raises(ValueError, match="named 'pp'"):
        mesh_groups(None, _Mesh(("data", "pipe")), None)
    with pytest.raises(ValueError, match="exactly the dimensions"):
        mesh_groups(None, _Mesh(("dp", "pp", "tp")), None)
    with pytest.raises(ValueError, match="not both"):
        mesh_groups(object(), _Mesh(("dp", "pp")), None)
    with pytest.raises(ValueError, match="not both"):
        mesh_groups(None, _Mesh(("dp", "pp")), object())


@pytest.mark.parametrize("cap, expected", [(10**6, [[0, 2], [1]]), (40, [[0], [2], [1]])])
def test_buckets_group_leaves_by_dtype_within_the_cap(cap, expected):
    grads = [torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float32),
             torch.zeros(2, dtype=torch.float64)]
    assert sorted(_buckets(grads, cap)) == sorted(expected)


@pytest.mark.parametrize("reduce, bucket_mb, state_reduce, match", [
    ("sum", 25.0, "mean", "grad_reduce"), ("mean", 0, "mean", "bucket_mb"),
    (None, "big", None, "bucket_mb"),
    ("mean", 25.0, "sum", "state_reduce must be 'mean', 'broadcast' or None, got 'sum'")])
def test_bad_reduction_options_are_refused(reduce, bucket_mb, state_reduce, match):
    with pytest.raises(ValueError, match=match):
        DataParallel.check_options(reduce, bucket_mb, state_reduce)


def test_a_tie_across_workers_of_two_replicas_and_its_global_norm(
        scenario: str = "data_parallel_ranks:mesh_ties", backend: str = "gloo"):
    """Stage 0's and stage 1's weights are one tensor (``ties=``) on a (2, 2) mesh: each copy's
    gradient is the shared tensor's over the whole batch, two steps with SGD between keep the
    copies equal, and ``global_norm(..., ties=, group=pp)`` is the one-tensor model's norm."""
    from data_parallel_ranks import tied_params

    results, codes = spawn(scenario, 4, timeout=120, backend=backend)
    _ok(results, codes)

    def model(shared, x):
        h = block({"w": shared["w"], "b": shared["b0"]}, x)
        return block({"w": shared["w"], "b": shared["b1"]}, h)

    start = tied_params()
    shared = {"w": start[0]["w"], "b0": start[0]["b"], "b1": start[1]["b"]}
    expected = []
    for x, target in mesh_steps():
        grads, loss = torch.func.grad_and_value(
            lambda p, x=x, target=target: mse(model(p, x), target))(shared)
        expected.append((loss, [{"w": grads["w"], "b": grads["b0"]},
                                {"w": grads["w"], "b": grads["b1"]}]))
        shared = {k: v - LR * grads[k] for k, v in shared.items()}
    norm = torch.cat([g.flatten() for g in expected[0][1][0].values()]
                     + [expected[0][1][1]["b"]]).norm()
    for rank, result in enumerate(results):
        _check(result["steps"], expected, [rank % 2])
        torch.testing.assert_close(result["norm"], norm, **TIGHT)


def test_a_rank_that_builds_no_pipeline_is_reported_within_the_timeout():
    results, codes = spawn("data_parallel_ranks:absent", 3, timeout=60)
    assert results[2] == {"absent": True}
    for result in results[:2]:
        assert result["error"] == "PeerError", result
        assert "waited 3 s for every rank of the job to build its pipeline" in result["message"]
        assert result["waited"] < 30
