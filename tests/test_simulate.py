"""The simulator, held to the known bubbles and memory of GPipe and 1F1B."""

import math
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import needs, programs

from fpipe.schedules import Costs, Op, Program, gpipe, in_flight, one_f_one_b, simulate
from fpipe.schedules.actions import Action, Overlap

F, B = Op.FORWARD, Op.BACKWARD

stages = st.integers(1, 8)
chunks = st.integers(1, 16)
backward_costs = st.sampled_from([1.0, 2.0, 3.5])


@given(stages, chunks, backward_costs)
def test_gpipe_bubble(n_stages, n_mb, backward):
    sim = simulate(gpipe(n_mb, "never").program(n_stages), Costs(forward=1.0, backward=backward))
    assert sim.bubble == pytest.approx((n_stages - 1) / (n_mb + n_stages - 1))
    assert sim.makespan == pytest.approx((1 + backward) * (n_mb + n_stages - 1))


@given(stages, chunks, backward_costs)
def test_one_f_one_b_matches_gpipe_time_with_less_memory(n_stages, n_mb, backward):
    costs = Costs(forward=1.0, backward=backward)
    reference = simulate(gpipe(n_mb, "never").program(n_stages), costs)
    sim = simulate(one_f_one_b(n_mb).program(n_stages), costs)
    assert sim.makespan == pytest.approx(reference.makespan)
    assert sim.bubble == pytest.approx(reference.bubble)
    assert reference.peak_activations == (n_mb,) * n_stages
    assert max(sim.peak_activations) <= n_stages
    assert sim.peak_activations == in_flight(one_f_one_b(n_mb).program(n_stages))


@given(stages, chunks)
def test_gpipe_remat_keeps_one_full_activation(n_stages, n_mb):
    # "except_last" keeps whole the micro-batch backpropagated first, freed before any
    # recompute: one full micro-batch at a time, as "always" (it held two when it kept the
    # last micro-batch through every recompute).
    for policy, full in (("always", 1), ("except_last", 1)):
        sim = simulate(gpipe(n_mb, policy).program(n_stages))
        assert sim.peak_activations == (n_mb,) * n_stages
        assert sim.peak_full_activations == (full,) * n_stages
    assert simulate(gpipe(n_mb, "never").program(n_stages)).peak_full_activations == (
        (n_mb,) * n_stages)


@given(programs(), st.floats(0, 3), st.floats(0, 2))
def test_timeline_obeys_order_dependencies_and_costs(program, backward, transfer):
    costs = Costs(forward=(1.0,) * program.n_stages, backward=backward, transfer=transfer)
    sim = simulate(program, costs)
    placement = program.placement
    span = {s.action: s for spans in sim.timeline for s in spans}
    for worker, spans in enumerate(sim.timeline):
        assert tuple(s.action for s in spans) == program.workers[worker]
        for before, after in pairwise(spans):
            assert before.end <= after.start
        for s in spans:
            assert s.end - s.start == pytest.approx(costs.of(s.action.op, s.action.stage))
            for need in needs(s.action, program):
                carry = transfer if placement[need.stage] != worker else 0.0
                assert span[need].end + carry <= s.start + 1e-9
    assert sim.makespan == max((s.end for s in span.values()), default=0.0)
    assert 0.0 <= sim.bubble <= 1.0


def test_actions_start_as_soon_as_they_can():
    program = Program([["0F0", "0F1", "0B1", "0B0"], ["1F0", "1F1", "1B1", "1B0"]], 2, 2)
    sim = simulate(program, Costs(forward=1, backward=2, transfer=0.5))
    starts = [[(str(s.action), s.start, s.end) for s in spans] for spans in sim.timeline]
    assert starts == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B1", 6, 8), ("0B0", 8, 10)],
        [("1F0", 1.5, 2.5), ("1F1", 2.5, 3.5), ("1B1", 3.5, 5.5), ("1B0", 5.5, 7.5)],
    ]
    assert sim.makespan == 10
    assert sim.bubble == pytest.approx(1 - 12 / 20)


def test_a_per_stage_transfer_is_charged_at_the_sender():
    """Stage s's result (its activation forward, its input gradient backward) takes
    ``transfer[s]`` to reach the next worker, whichever way it travels."""
    program = gpipe(1, "never").program(3)
    sim = simulate(program, Costs(forward=1, backward=2, transfer=(0.5, 2.0, 7.0)))
    spans = {str(s.action): (s.start, s.end) for row in sim.timeline for s in row}
    assert spans == {"0F0": (0, 1), "1F0": (1.5, 2.5), "2F0": (4.5, 5.5), "2B0": (5.5, 7.5),
                     "1B0": (14.5, 16.5), "0B0": (18.5, 20.5)}


def test_split_backward_costs_and_live_until_weight_gradient():
    program = Program([["0F0", "0F1", "0I0", "0I1", "0W0", "0W1"]], 1, 2)
    sim = simulate(program, Costs(backward_input=2, backward_weight=3))
    assert sim.makespan == 1 + 1 + 2 + 2 + 3 + 3
    assert sim.peak_activations == (2,) and in_flight(program) == (2,)


def test_recompute_cost_defaults_to_forward():
    program = gpipe(2, "always").program(1)
    assert simulate(program, Costs(forward=2, backward=1)).makespan == 2 * 2 + 2 * 2 + 2 * 1
    assert simulate(program, Costs(forward=2, backward=1, recompute=0.5)).makespan == 7


def test_per_stage_costs():
    sim = simulate(gpipe(1, "never").program(3), Costs(forward=(1, 2, 3), backward=(4, 5, 6)))
    assert sim.makespan == 1 + 2 + 3 + 6 + 5 + 4


def test_inference_programs_simulate_and_keep_nothing():
    sim = simulate(gpipe(4).program(3).forward_only())
    assert sim.makespan == 4 + 3 - 1
    assert sim.peak_activations == sim.peak_full_activations == (0, 0, 0)


@pytest.mark.parametrize("costs, message", [
    (dict(forward=-1), "costs.forward must be a non-negative number"),
    (dict(backward=math.inf), "costs.backward must be a non-negative number"),
    (dict(transfer="fast"), "costs.transfer must be a non-negative number"),
    (dict(recompute=(1, -2)), r"costs.recompute must be a non-negative number or a tuple"),
    (dict(forward=True), "costs.forward must be"),
])
def test_bad_costs_rejected(costs, message):
    with pytest.raises(ValueError, match=message):
        Costs(**costs)


def test_per_stage_costs_must_match_stage_count():
    with pytest.raises(ValueError, match="costs.backward has 2 entries but the program has 3"):
        simulate(gpipe(2).program(3), Costs(backward=(1, 2)))


def test_costs_are_hashable_values():
    assert Costs(forward=[1, 2]) == Costs(forward=(1.0, 2.0))
    assert hash(Costs(forward=[1, 2])) == hash(Costs(forward=(1.0, 2.0)))
    assert Costs().of(Op.RECOMPUTE, 0) == 1.0



def test_a_worker_busy_all_the_time_has_no_bubble_whatever_the_rounding():
    """A one-worker program with overlapped pairs, whose busy time and span ends are summed in
    different orders (found by hypothesis: its useful fraction rounded to 1 + 2e-16, its
    bubble to -2e-16)."""
    order = [(0, F, 0), (0, F, 1), (1, F, 0), (0, F, 2), (0, F, 3), (1, F, 1), (2, F, 0),
             (3, F, 0), (3, B, 0), (1, F, 2), (2, B, 0), (1, F, 3), (2, F, 1), (1, B, 0),
             (2, F, 2), (0, B, 0), (2, F, 3), (3, F, 1), (3, F, 2), (3, F, 3), (3, B, 1),
             (3, B, 2), (3, B, 3), (2, B, 1), (2, B, 2), (2, B, 3), (1, B, 1), (1, B, 2),
             (1, B, 3), (0, B, 1), (0, B, 2), (0, B, 3)]
    pairs = [((1, 2), (2, 0)), ((2, 2), (0, 0)), ((2, 1), (1, 0))]
    program = Program((tuple(Action(s, op, m) for s, op, m in order),), 4, 4,
                      frozenset(Overlap(Action(f[0], F, f[1]), Action(b[0], B, b[1]))
                                for f, b in pairs))
    sim = simulate(program, Costs(forward=(1.0,) * 4, backward=1.1204441037524429))
    assert sim.bubble == 0.0 and sim.breakdown.useful == 1.0 and sim.breakdown.idle == 0.0
