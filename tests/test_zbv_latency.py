"""ZB-V under hand-off latency: without costs, fpipe's order is torch's, so never longer than
it; given the costs, it is at most as long as torch's and the zero-bubble authors'
(tests/zbv_peers.py), at ZB-V's memory."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from zbv_peers import authors_zero_bubble_v, torch_zero_bubble_v

from fpipe.schedules import Costs, ZeroBubbleV, simulate, validate, zero_bubble_v
from fpipe.schedules.v_shape import fill_weight_gradients, handcrafted_v
from fpipe.schedules.zero_bubble import SLACKS, v_shape_order

# F = I = W = 1; latency in forwards.
GRID = [(4, m, latency) for m in (8, 16, 32) for latency in (0.1, 0.25, 0.5)] + [
    (8, m, latency) for m in (8, 16) for latency in (0.1, 0.25, 0.5)] + [(8, 32, 0.25)]
# With fewer micro-batches than the 2K-1 the hand-written V is laid out for, the authors'
# greedy finds 58.2 where ours finds 59.0 (1.4% longer); torch's takes 64.8.
SHORT = {(8, 8, 0.1)}


def costs_with(latency):
    return Costs(forward=1, backward_input=1, backward_weight=1, latency=latency)


def idle_inside(sim):
    """Per worker, the time it waits between its first action's start and its last's end."""
    return tuple(spans[-1].end - spans[0].start - sum(s.end - s.start for s in spans)
                 for spans in sim.timeline)


@pytest.mark.parametrize("K, chunks, latency", [
    (K, m, latency) for K in (4, 8) for m in (8, 16, 32) for latency in (0.0, 0.1, 0.25, 0.5)])
def test_zero_bubble_v_without_costs_is_at_most_torch(K, chunks, latency):
    costs = costs_with(latency)
    ours = simulate(zero_bubble_v(chunks).program(2 * K), costs).makespan
    assert ours <= simulate(torch_zero_bubble_v(K, chunks), costs).makespan


@given(st.integers(1, 8), st.integers(1, 40))
def test_zero_bubble_v_without_costs_is_torchs_order_and_idles_inside_no_busy_span(K, chunks):
    """torch's order action for action; with equal costs and free hand-offs, no worker waits
    between its first action and its last once there are the 2K-1 micro-batches the V is laid
    out for (with fewer, torch's waits too)."""
    program = zero_bubble_v(chunks).program(2 * K)
    assert program == torch_zero_bubble_v(K, chunks)
    if chunks >= 2 * K - 1:
        assert idle_inside(simulate(program, costs_with(0.0))) == (0.0,) * K


@given(st.integers(1, 5), st.integers(1, 16), st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
       st.sampled_from([0.5, 1.0, 2.0]))
def test_zero_bubble_v_given_costs_is_the_fastest_candidate(K, chunks, latency, i_cost):
    """The fastest of the hand-written V, the unit-step order and both with their W moved; of
    those tied, the first (so the hand-written V, torch's order, when nothing is faster)."""
    costs = Costs(forward=1, backward_input=i_cost, backward_weight=1, latency=latency)
    bases = (handcrafted_v(chunks, K), v_shape_order(chunks, K, cap=2 * K))
    candidates = [*bases, *(fill_weight_gradients(base, costs, cap=2 * K, slack=slack)
                            for base in bases for slack in SLACKS)]
    spans = [simulate(program, costs).makespan for program in candidates]
    chosen = zero_bubble_v(chunks, costs=costs).program(2 * K)
    assert chosen == candidates[spans.index(min(spans))]


@pytest.mark.parametrize("K, chunks, latency", GRID)
def test_zero_bubble_v_given_costs_is_at_most_torch_and_the_authors(K, chunks, latency):
    costs = costs_with(latency)
    ours = simulate(zero_bubble_v(chunks, costs=costs).program(2 * K), costs)
    torch_ = simulate(torch_zero_bubble_v(K, chunks), costs)
    authors = simulate(authors_zero_bubble_v(K, chunks, latency=latency), costs)
    assert ours.makespan <= torch_.makespan + 1e-9
    if (K, chunks, latency) not in SHORT:
        assert ours.makespan <= authors.makespan + 1e-9
    # ZB-V's memory: at most 2K pairs alive on a worker, as in both peers' orders.
    assert max(ours.peak_activations) <= 2 * K == max(torch_.peak_activations)


@pytest.mark.xfail(strict=True, reason="the authors' greedy is 1.4% shorter here (see SHORT)")
def test_the_one_case_where_the_authors_order_is_shorter():
    K, chunks, latency = next(iter(SHORT))
    costs = costs_with(latency)
    ours = simulate(zero_bubble_v(chunks, costs=costs).program(2 * K), costs).makespan
    assert ours <= simulate(authors_zero_bubble_v(K, chunks, latency=latency), costs).makespan


@pytest.mark.parametrize("K, chunks", [(4, 16), (8, 32)])
def test_the_unit_order_is_what_latency_hurts(K, chunks):
    """Why the default is the hand-written V: latency hurts the unit-step order more than
    torch's; with free hand-offs the costs keep the hand-written V (nothing is faster)."""
    costs = costs_with(0.5)
    unit = v_shape_order(chunks, K, cap=2 * K)
    assert simulate(unit, costs).makespan > simulate(torch_zero_bubble_v(K, chunks),
                                                     costs).makespan
    assert ZeroBubbleV(chunks).program(2 * K) == handcrafted_v(chunks, K)
    assert zero_bubble_v(chunks, costs=costs_with(0.0)).program(2 * K) == handcrafted_v(chunks, K)


def test_with_fewer_micro_batches_than_the_v_the_costs_pick_the_unit_order():
    """Below 2K-1 micro-batches the hand-written V is laid out for more than there are, and
    with free hand-offs the unit-step order is shorter (55 against torch's 62 at K = 8, m = 8)."""
    costs = costs_with(0.0)
    chosen = simulate(zero_bubble_v(8, costs=costs).program(16), costs).makespan
    assert (chosen, simulate(zero_bubble_v(8).program(16), costs).makespan) == (55.0, 62.0)


@pytest.mark.parametrize("K, chunks", [(1, 1), (1, 3), (2, 1), (2, 3), (3, 5), (4, 8)])
def test_the_hand_written_v_and_the_filled_orders_are_valid(K, chunks):
    pattern = handcrafted_v(chunks, K)
    validate(pattern)
    assert pattern == torch_zero_bubble_v(K, chunks)
    for latency in (0.0, 0.3):
        for slack in (1.0, 0.1):
            filled = fill_weight_gradients(pattern, costs_with(latency), cap=2 * K, slack=slack)
            validate(filled)
            assert max(simulate(filled).peak_activations) <= 2 * K


def test_costs_must_be_costs_and_remat_still_applies():
    with pytest.raises(TypeError, match="Costs value"):
        zero_bubble_v(8, costs={"latency": 0.1})
    costs = costs_with(0.25)
    program = validate(zero_bubble_v(8, "always", costs=costs).program(4))
    assert sum(a.op.value == "R" for w in program.workers for a in w) == 4 * 8
    with pytest.raises(ValueError, match=r"\dR\d is neither F, I nor W"):
        fill_weight_gradients(program, costs, cap=4)
