"""The schedule constructors and the rematerialisation transforms."""

import ast
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import remat_policies, schedule_cases

import fpipe.schedules
from fpipe.schedules import (
    GPipeSchedule,
    OneFOneB,
    Op,
    Program,
    apply_remat,
    colocate,
    gpipe,
    in_flight,
    normalize_remat,
    one_f_one_b,
    validate,
    zero_bubble_v,
)
from fpipe.schedules.remat import recomputed

F, R, B = Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD


def selected(policy, n_stages, n_microbatches):
    """The (stage, micro-batch) pairs a policy recomputes, written out independently."""
    pairs = {(s, m) for s in range(n_stages) for m in range(n_microbatches)}
    if policy == "always":
        return pairs
    if policy == "never":
        return set()
    if policy == "except_last":  # every stage's first backward is micro-batch 0's
        return {(s, m) for s, m in pairs if m != 0}
    return {(s, m) for s, m in pairs if s in policy}


def test_schedules_are_hashable_values():
    assert gpipe(8) == gpipe(chunks=8) == GPipeSchedule(8, "except_last")
    assert hash(gpipe(8)) == hash(gpipe(chunks=8))
    assert one_f_one_b(4) == OneFOneB(4, "never") != gpipe(4, "never")
    assert gpipe(4, {2, 0}) == gpipe(4, [0, 2, 2]) == gpipe(4, frozenset({0, 2}))
    assert gpipe(4, (1,)).remat == frozenset({1})
    assert len({gpipe(4), gpipe(4), gpipe(5), one_f_one_b(4)}) == 3
    with pytest.raises(AttributeError):
        gpipe(4).chunks = 5


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
@pytest.mark.parametrize("chunks", [0, -3, True, 2.0, "4", None])
def test_bad_chunks_rejected(make, chunks):
    with pytest.raises(ValueError, match=f"chunks must be a positive integer, got {chunks!r}"):
        make(chunks)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
@pytest.mark.parametrize("n_stages", [0, -1, True, 1.5])
def test_bad_stage_count_rejected(make, n_stages):
    with pytest.raises(ValueError, match="n_stages must be a positive integer"):
        make(2).program(n_stages)


@pytest.mark.parametrize("policy, message", [
    ("sometimes", "unknown remat policy 'sometimes': expected one of 'always', 'except_last'"),
    ("", "unknown remat policy ''"),
    (None, "remat policy must be one of .* or a set of stage indices, got None"),
    (3, "remat policy must be .*, got 3"),
    ({-1, 2}, "remat stages must be non-negative integers, got -1"),
    ({True}, "remat stages must be non-negative integers, got True"),
    ([1.0], "remat stages must be non-negative integers, got 1.0"),
    (["a"], "remat stages must be non-negative integers, got 'a'"),
])
def test_bad_remat_rejected(policy, message):
    with pytest.raises(ValueError, match=message):
        normalize_remat(policy)
    with pytest.raises(ValueError, match=message):
        gpipe(2, policy)


def test_remat_stage_beyond_the_pipeline_rejected():
    with pytest.raises(ValueError, match=r"remat stages \[3, 5\] do not exist: the program has 3"):
        gpipe(2, {0, 3, 5}).program(3)


def test_gpipe_program_shape():
    assert str(gpipe(3, "never").program(2)) == (
        "worker 0: 0F0 0F1 0F2 0B0 0B1 0B2\n"
        "worker 1: 1F0 1F1 1F2 1B0 1B1 1B2"
    )
    # "except_last" keeps the micro-batch backpropagated first, freed before any recompute
    assert str(gpipe(3).program(1)) == "worker 0: 0F0 0F1 0F2 0B0 0R1 0B1 0R2 0B2"


def test_one_f_one_b_program_shape():
    assert str(one_f_one_b(4).program(3)) == (
        "worker 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "worker 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "worker 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )
    assert str(one_f_one_b(1, "always").program(3)) == (
        "worker 0: 0F0 0R0 0B0\nworker 1: 1F0 1R0 1B0\nworker 2: 2F0 2R0 2B0"
    )


@given(schedule_cases())
def test_constructed_programs_obey_the_contract(case):
    schedule, n_stages = case
    program = validate(schedule.program(n_stages))
    n_mb = schedule.chunks
    assert (program.n_stages, program.n_microbatches) == (n_stages, n_mb)
    assert program.placement == tuple(range(n_stages))
    count = Counter((a.stage, a.op, a.microbatch) for w in program.workers for a in w)
    for s in range(n_stages):
        for m in range(n_mb):
            assert count[s, F, m] == count[s, B, m] == 1
    want = selected(schedule.remat, n_stages, n_mb)
    assert recomputed(program) == want
    for actions in program.workers:
        for i, action in enumerate(actions):
            if action.op is R:
                assert actions[i + 1].op is B and actions[i + 1].stage == action.stage
                assert actions[i + 1].microbatch == action.microbatch
    assert validate(program.forward_only(), training=False) == program.forward_only()


@given(schedule_cases())
def test_in_flight_bounds(case):
    schedule, n_stages = case
    flight = in_flight(schedule.program(n_stages))
    if isinstance(schedule, GPipeSchedule):
        assert flight == (schedule.chunks,) * n_stages
    else:
        assert flight == tuple(min(n_stages - k, schedule.chunks) for k in range(n_stages))
        assert max(flight) <= n_stages


@given(st.integers(1, 6), st.integers(1, 8), st.data())
def test_apply_remat_is_idempotent_and_never_is_identity(n_stages, chunks, data):
    base = one_f_one_b(chunks).program(n_stages)
    policy = data.draw(remat_policies(n_stages))
    once = apply_remat(base, policy)
    assert apply_remat(once, policy) == once
    assert apply_remat(base, "never") == base
    assert recomputed(once) == selected(normalize_remat(policy), n_stages, chunks)
    assert once.forward_only() == base.forward_only()


def test_apply_remat_puts_recompute_before_the_input_gradient():
    program = Program([["0F0", "0I0", "0W0"]], 1, 1)
    assert apply_remat(program, "always") == Program([["0F0", "0R0", "0I0", "0W0"]], 1, 1)
    assert apply_remat(program.forward_only(), "always") == program.forward_only()


def test_schedules_package_knows_nothing_of_tensors():
    package = Path(fpipe.schedules.__file__).parent
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "torch" for n in names), source.name


@given(n_stages=st.integers(1, 8), chunks=st.integers(1, 8), data=st.data(),
       make=st.sampled_from([gpipe, one_f_one_b]),
       remat=st.sampled_from(["always", "except_last", "never"]))
def test_colocated_programs_stay_valid(n_stages, chunks, data, make, remat):
    program = make(chunks, remat).program(n_stages)
    drawn = data.draw(st.lists(st.integers(0, n_stages - 1), min_size=n_stages,
                               max_size=n_stages))
    labels: dict[int, int] = {}
    workers = [labels.setdefault(w, len(labels)) for w in drawn]  # numbered 0.. in order
    n_workers = len(labels)
    merged = colocate(program, workers)
    validate(merged)
    assert merged.n_workers == n_workers
    assert merged.placement == tuple(workers)
    for stage in range(n_stages):  # each stage keeps the order of its own actions
        mine = [a for w in merged.workers for a in w if a.stage == stage]
        assert mine == [a for a in program.workers[stage] if a.stage == stage]
    if make is gpipe:  # still every forward first: what Pipeline.vjp needs
        for actions in merged.workers:
            ops = [a.op for a in actions]
            assert Op.FORWARD not in ops[ops.index(Op.FORWARD) + ops.count(Op.FORWARD):]


def test_colocate_takes_a_schedule_value_and_the_pipeline_runs_it():
    """The OversubscriptionWarning's advice, as written: colocate a schedule value."""
    import torch
    from models import TIGHT, assert_trees_close, block, mlp_params, mse, whole_batch

    import fpipe

    merged = colocate(one_f_one_b(chunks=4), [0, 0, 1, 1])
    assert merged == colocate(one_f_one_b(chunks=4).program(4), [0, 0, 1, 1])
    assert merged.placement == (0, 0, 1, 1)
    params = mlp_params(4, width=4)
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch([block] * 4, params, x, target, mse)
    with fpipe.pipeline([block] * 4, params, schedule=merged, loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)
    with pytest.raises(ValueError, match="even number of stages"):
        colocate(zero_bubble_v(4), [0, 0, 1])


def test_colocate_refuses_bad_worker_lists():
    program = gpipe(2).program(3)
    with pytest.raises(ValueError, match="for 2 stages but the program has 3"):
        colocate(program, [0, 0])
    with pytest.raises(ValueError, match="none left out"):
        colocate(program, [0, 2, 2])
