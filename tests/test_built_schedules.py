"""The list-scheduling builder, interleaved zero bubble and DualPipeV: valid over many sizes,
held to their sources' shapes and claims, and exact against the whole batch."""

from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import TIGHT, assert_trees_close, block, mlp_params, mse, whole_batch
from schedule_strategies import run_by_hand

import fpipe
from fpipe.schedules import (
    FAMILIES,
    Costs,
    ListScheduled,
    Op,
    StageCountError,
    choose_schedule,
    dual_pipe_v,
    forward_first,
    gpipe,
    interleaved_one_f_one_b,
    interleaved_zero_bubble,
    list_schedule,
    one_f_one_b,
    simulate,
    validate,
    zero_bubble,
    zero_bubble_v,
)
from fpipe.schedules.zero_bubble import v_shape_order

EQUAL = Costs(forward=1, backward=2)  # I = W = F


@given(st.integers(1, 8), st.integers(1, 16))
def test_the_builder_writes_one_f_one_b_and_gpipe_from_their_rules(K, chunks):
    assert list_schedule(K, chunks, range(K), in_flight=[K - w for w in range(K)]) == (
        one_f_one_b(chunks).program(K))
    assert list_schedule(K, chunks, range(K), rule=forward_first) == (
        gpipe(chunks, "never").program(K))


@st.composite
def placements(draw):
    """Any placement: loops, Vs and shuffles of 1 to 5 workers, 1 to 3 stages each."""
    workers = draw(st.integers(1, 5))
    per = draw(st.integers(1, 3))
    stages = draw(st.permutations([w for w in range(workers) for _ in range(per)]))
    return list(stages)


@given(placements(), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 6)),
       st.booleans(), st.sampled_from(["backward_first", "forward_first"]),
       st.sampled_from([0.0, 0.5]))
def test_the_builder_is_valid_whatever_the_rule_and_cap(placement, chunks, cap, split, rule,
                                                        transfer):
    """The cap is hard, whatever the transfer time: no worker ever holds more live pairs
    than its cap (simulated at the costs the builder used), and nothing hangs; a cap below
    the stages a micro-batch holds on one worker is refused."""
    import fpipe.schedules as schedules

    costs = Costs(transfer=transfer)
    build = partial(list_schedule, len(placement), chunks, placement, in_flight=cap,
                    split_backward=split, rule=getattr(schedules, rule), costs=costs)
    most = max(placement.count(w) for w in placement)
    if cap is not None and cap < most:
        with pytest.raises(ValueError, match=f"in_flight cap {cap} of worker .* less than"):
            build()
        return
    program = build()
    if cap is not None:
        assert max(simulate(program, costs).peak_activations) <= cap
    validate(program)
    assert run_by_hand(program) is None
    assert program.placement == tuple(placement)
    ops = {a.op for w in program.workers for a in w}
    assert ops == ({Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT} if split
                   else {Op.FORWARD, Op.BACKWARD})
    for worker in program.workers:  # each stage's ops in micro-batch order
        for stage in {a.stage for a in worker}:
            for op in ops:
                mbs = [a.microbatch for a in worker if a.stage == stage and a.op is op]
                assert mbs == sorted(mbs)


def test_the_builder_refuses_bad_arguments():
    with pytest.raises(ValueError, match="placement has 2 entries but there are 3"):
        list_schedule(3, 2, [0, 1])
    with pytest.raises(ValueError, match="with none left out"):
        list_schedule(2, 2, [0, 2])
    with pytest.raises(ValueError, match="in_flight has 1 caps but there are 2"):
        list_schedule(2, 2, [0, 1], in_flight=[1])
    with pytest.raises(ValueError, match="in_flight must be a positive integer"):
        list_schedule(2, 2, [0, 1], in_flight=0)
    with pytest.raises(StageCountError):
        ListScheduled(2, placement=lambda s, n: s).program(0)
    with pytest.raises(ValueError, match=r"cap 1 of worker 0 .* 2 stages .* \(\[0, 3\]\)"):
        list_schedule(4, 2, [0, 1, 1, 0], in_flight=1)


@pytest.mark.parametrize("K, chunks, latency", [(4, 16, 0.25), (3, 9, 1.0), (4, 8, 0.1)])
def test_the_cap_holds_under_hand_off_latency(K, chunks, latency):
    """A V capped at 2K pairs never holds 2K+1 when hand-offs take time."""
    costs = Costs(forward=1, backward=2, latency=latency)
    schedule = ListScheduled(chunks, v_placement, in_flight=lambda w, k: 2 * k,
                             split_backward=True, costs=costs)
    program = validate(schedule.program(2 * K))
    assert max(simulate(program, costs).peak_activations) <= 2 * K


def v_placement(stage, n_stages):
    return min(stage, n_stages - 1 - stage)


def zero_bubble_v_rule(action, worker):
    """The unit-step ZB-V's priority (see v_shape_order): a forward, of the second stage first; an
    input gradient, of the first stage first; a weight gradient, the oldest first."""
    rank = {Op.FORWARD: 0, Op.BACKWARD_INPUT: 1, Op.BACKWARD_WEIGHT: 2}[action.op]
    depth = {Op.FORWARD: -action.stage, Op.BACKWARD_INPUT: action.stage}.get(action.op, 0)
    return rank, depth, action.microbatch


@given(st.integers(1, 6), st.integers(1, 12))
def test_a_v_from_zero_bubble_v_rule_is_as_fast(K, chunks):
    """A V, split backwards, cap 2K and the unit-step ZB-V's rule: never slower than it."""
    schedule = ListScheduled(chunks, v_placement, rule=zero_bubble_v_rule,
                             in_flight=lambda w, k: 2 * k, split_backward=True)
    sim = simulate(schedule.program(2 * K), EQUAL)
    unit = v_shape_order(chunks, K, cap=2 * K)
    assert sim.makespan <= simulate(unit, EQUAL).makespan
    assert max(sim.peak_activations) <= 2 * K


@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 16))
def test_interleaved_zero_bubble(K, v, chunks):
    program = validate(interleaved_zero_bubble(chunks, v).program(K * v))
    assert run_by_hand(program) is None
    assert program.placement == tuple(s % K for s in range(K * v))
    if v == 1:
        assert program == zero_bubble(chunks).program(K)
        return
    # never slower than interleaved 1F1B, nor than ZB-H1 on the same model
    sim = simulate(program, EQUAL)
    assert sim.makespan <= simulate(interleaved_one_f_one_b(chunks, v).program(K * v),
                                    EQUAL).makespan
    assert sim.makespan <= simulate(zero_bubble(chunks).program(K), EQUAL.scaled(v)).makespan


@given(st.integers(1, 8), st.integers(0, 16))
def test_dual_pipe_v(K, extra):
    chunks = 2 * K + extra
    program = validate(dual_pipe_v(chunks).program(2 * K))
    assert run_by_hand(program) is None
    assert program.placement == tuple(min(s, 2 * K - 1 - s) for s in range(2 * K))
    sim = simulate(program, EQUAL)
    assert max(sim.peak_activations) <= 2 * K + 1
    # one action a unit, DeepSeek's order takes ZB-V's time; its pairs wait for both inputs
    zbv = simulate(zero_bubble_v(chunks).program(2 * K), EQUAL).makespan
    assert simulate(program.sequential(), EQUAL).makespan == zbv <= sim.makespan
    if K > 1:
        assert sim.makespan < simulate(one_f_one_b(chunks).program(K), EQUAL.scaled(2)).makespan


def test_dual_pipe_v_refuses_what_it_cannot_run():
    with pytest.raises(StageCountError, match="even number of stages"):
        dual_pipe_v(8).program(3)
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        dual_pipe_v(3).program(4)
    assert "dual_pipe_v" in FAMILIES and "interleaved_zero_bubble" in FAMILIES
    choice = choose_schedule(4, Costs(per="model"), n_workers=2, chunks=(2, 4))
    assert {t.chunks for t in choice.trials if t.name == "dual_pipe_v"} == {4}


KINDS = {
    "interleaved_zero_bubble": lambda chunks, remat, K: (
        interleaved_zero_bubble(chunks, 2, remat), 2 * K),
    "dual_pipe_v": lambda chunks, remat, K: (dual_pipe_v(2 * K + chunks, remat), 2 * K),
    "list_scheduled_v": lambda chunks, remat, K: (
        ListScheduled(chunks, v_placement, in_flight=lambda w, k: 2, split_backward=True,
                      remat=remat), 2 * K),
}


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_matches_whole_batch(kind, data):
    """Loss and gradients equal the whole batch's (float64, torch.func reference)."""
    K = data.draw(st.sampled_from([2, 1, 3]))
    chunks = data.draw(st.sampled_from([3, 1, 2, 4]))
    remat = data.draw(st.sampled_from(["never", "always", "except_last"]))
    schedule, n_stages = KINDS[kind](chunks, remat, K)
    n = schedule.chunks + data.draw(st.integers(0, 2))
    params = mlp_params(n_stages, width=4)
    x = torch.randn(n, 4, dtype=torch.float64)
    target = torch.randn(n, 4, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch([block] * n_stages, params, x, target, mse)
    with fpipe.pipeline([block] * n_stages, params, schedule=schedule, loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)
