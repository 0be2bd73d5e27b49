"""Interleaved 1F1B, looped BFS, ZB-H1 and ZB-V: their programs, and the simulator's claims."""

from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import research_cases

import fpipe
from fpipe.schedules import (
    Costs,
    InterleavedOneFOneB,
    LoopedBFS,
    Op,
    ZeroBubble,
    ZeroBubbleV,
    interleaved_one_f_one_b,
    looped_bfs,
    one_f_one_b,
    simulate,
    validate,
    zero_bubble,
    zero_bubble_v,
)
from fpipe.schedules.remat import normalize_remat, recomputed
from fpipe.schedules.zero_bubble import v_shape_order

F, R, B, I, W = Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
CONSTRUCTORS = [interleaved_one_f_one_b, looped_bfs, zero_bubble, zero_bubble_v]
workers = st.integers(1, 8)
chunks = st.integers(1, 16)
per_worker = st.integers(1, 4)
#: Equal F, I and W costs (B = I + W), for stages holding 1/v of a worker's layers.
EQUAL = Costs(forward=1, backward_input=1, backward_weight=1, backward=2)


def scaled(costs: Costs, by: float) -> Costs:
    return Costs(forward=costs.forward * by, backward=costs.backward * by,
                 backward_input=costs.backward_input * by,
                 backward_weight=costs.backward_weight * by, transfer=costs.transfer)


def idle(sim) -> float:
    """Idle time per worker, on average."""
    return sim.bubble * sim.makespan


def home(schedule, n_stages: int, stage: int) -> int:
    """The worker each schedule's docstring says holds ``stage``."""
    if isinstance(schedule, (InterleavedOneFOneB, LoopedBFS)):
        return stage % (n_stages // schedule.stages_per_worker)
    if isinstance(schedule, ZeroBubbleV):
        return min(stage, n_stages - 1 - stage)
    return stage


def test_schedules_are_hashable_values():
    assert interleaved_one_f_one_b(8) == InterleavedOneFOneB(8, 2, "never")
    assert interleaved_one_f_one_b(8, 3) != interleaved_one_f_one_b(8, 2)
    assert looped_bfs(4, remat={1}) == LoopedBFS(4, 2, frozenset({1}))
    assert zero_bubble(4) == ZeroBubble(4, "never") != zero_bubble_v(4)
    assert zero_bubble_v(4, "always") == ZeroBubbleV(4, "always")
    assert len({zero_bubble(4), zero_bubble(4), zero_bubble_v(4), looped_bfs(4)}) == 3
    with pytest.raises(AttributeError):
        zero_bubble(4).chunks = 5
    assert {fpipe.interleaved_one_f_one_b, fpipe.looped_bfs, fpipe.zero_bubble,
            fpipe.zero_bubble_v} == set(CONSTRUCTORS)
    names = {make.__name__ for make in CONSTRUCTORS}
    assert names <= set(fpipe.__all__)
    assert names | {"InterleavedOneFOneB", "LoopedBFS", "ZeroBubble", "ZeroBubbleV"} <= set(
        fpipe.schedules.__all__)


@pytest.mark.parametrize("make", CONSTRUCTORS)
@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4", None])
def test_bad_chunks_rejected(make, bad):
    with pytest.raises(ValueError, match=f"chunks must be a positive integer, got {bad!r}"):
        make(bad)


@pytest.mark.parametrize("make", [interleaved_one_f_one_b, looped_bfs])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_stages_per_worker_rejected(make, bad):
    with pytest.raises(ValueError, match="stages_per_worker must be a positive integer"):
        make(4, bad)


@pytest.mark.parametrize("make", CONSTRUCTORS)
@pytest.mark.parametrize("n_stages", [0, -1, True, 1.5])
def test_bad_stage_count_rejected(make, n_stages):
    with pytest.raises(ValueError, match="n_stages must be a positive integer"):
        make(2).program(n_stages)


def test_stage_counts_the_placement_cannot_hold_are_rejected():
    with pytest.raises(ValueError, match="stages_per_worker=3 needs a number of stages that is "
                                         "a multiple of 3 .*, got 4"):
        interleaved_one_f_one_b(4, 3).program(4)
    with pytest.raises(ValueError, match="looped BFS with stages_per_worker=2 .* got 5"):
        looped_bfs(4).program(5)
    with pytest.raises(ValueError, match="needs an even number of stages, got 3"):
        zero_bubble_v(4).program(3)


def test_program_shapes():
    assert str(interleaved_one_f_one_b(4).program(4)) == (
        "worker 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "worker 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
    assert str(looped_bfs(2).program(4)) == (
        "worker 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n"
        "worker 1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"
    )
    assert str(zero_bubble(4).program(4)) == (
        "worker 0: 0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3\n"
        "worker 1: 1F0 1F1 1F2 1I0 1F3 1I1 1W0 1I2 1W1 1I3 1W2 1W3\n"
        "worker 2: 2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2I3 2W1 2W2 2W3\n"
        "worker 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3W1 3W2 3W3"
    )
    assert str(zero_bubble(2, "always").program(1)) == "worker 0: 0F0 0R0 0I0 0W0 0F1 0R1 0I1 0W1"
    assert str(zero_bubble_v(2).program(4)) == (
        "worker 0: 0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1\n"
        "worker 1: 1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1"
    )


@given(research_cases())
def test_programs_obey_the_contract(case):
    schedule, n_stages = case
    program = validate(schedule.program(n_stages))
    n_mb = schedule.chunks
    assert (program.n_stages, program.n_microbatches) == (n_stages, n_mb)
    assert program.placement == tuple(home(schedule, n_stages, s) for s in range(n_stages))
    split = isinstance(schedule, (ZeroBubble, ZeroBubbleV))
    count = Counter((a.stage, a.op, a.microbatch) for w in program.workers for a in w)
    for s in range(n_stages):
        for m in range(n_mb):
            ops = (F, I, W) if split else (F, B)
            assert [count[s, op, m] for op in (F, B, I, W)] == [int(op in ops)
                                                                for op in (F, B, I, W)]
    policy = schedule.remat
    assert recomputed(program) == {  # "except_last" keeps the first backpropagated, mb 0
        (s, m) for s in range(n_stages) for m in range(n_mb)
        if policy == "always" or (policy == "except_last" and m != 0)
        or (isinstance(policy, frozenset) and s in policy)
    }
    for actions in program.workers:
        for before, after in pairwise(actions):
            if before.op is R:
                assert (after.op, after.stage, after.microbatch) == (
                    I if split else B, before.stage, before.microbatch)
        # each stage forwards, and finishes its backwards, in micro-batch order (stateful
        # stages, and gradients summed in one order whatever the schedule)
        for stage in {a.stage for a in actions}:
            for op in (F, W if split else B):
                mbs = [a.microbatch for a in actions if a.stage == stage and a.op is op]
                assert mbs == sorted(mbs)
    assert validate(program.forward_only(), training=False) == program.forward_only()


@given(workers, chunks, per_worker)
def test_one_stage_per_worker_interleaving_is_one_f_one_b(n_workers, n_mb, v):
    program = interleaved_one_f_one_b(n_mb, 1).program(n_workers)
    assert program == one_f_one_b(n_mb).program(n_workers)
    # with K dividing the chunks, Megatron's warm-up of (v-1)*K + 2*(K-1-w) forwards, and
    # the first forward of the steady phase, come before the first backward
    program = interleaved_one_f_one_b(n_workers * n_mb, v).program(n_workers * v)
    for w, actions in enumerate(program.workers):
        warmup = (v - 1) * n_workers + (2 if v > 1 else 1) * (n_workers - 1 - w)
        first_backward = [a.op for a in actions].index(B)
        assert first_backward == min(n_workers * n_mb * v, warmup + 1)


@given(workers, chunks, per_worker, st.sampled_from([1.0, 2.0, 3.5]))
def test_interleaving_divides_the_idle_time_by_the_stages_per_worker(K, n_mb, v, backward):
    """With K workers and each worker's layers cut into v stages (costs 1/v each), the idle
    time per worker is 1F1B's divided by v as soon as there are K micro-batches or more, for
    any count (not only multiples of K): the bubble fraction is (K-1)/(vM+K-1), against
    1F1B's (K-1)/(M+K-1). Looped BFS fills the pipeline the same way."""
    costs = Costs(forward=1.0, backward=backward)
    reference = simulate(one_f_one_b(n_mb).program(K), costs)
    sim = simulate(interleaved_one_f_one_b(n_mb, v).program(K * v), scaled(costs, 1 / v))
    bfs = simulate(looped_bfs(n_mb, v).program(K * v), scaled(costs, 1 / v))
    if n_mb >= K:
        assert idle(sim) == pytest.approx(idle(reference) / v, abs=1e-9)
        assert sim.bubble == pytest.approx((K - 1) / (v * n_mb + K - 1), abs=1e-12)
        assert bfs.bubble == pytest.approx((K - 1) / (v * n_mb + K - 1), abs=1e-12)
    assert idle(sim) <= idle(reference) + 1e-9  # never worse, even with few micro-batches
    # memory: the warm-up, plus one; with K dividing the chunks that is (v-1)*K + 2*(K-1-w) + 1
    # stage-activations of 1/v of the layers, against 1F1B's K-w whole ones
    rounds_max = n_mb if n_mb < K else -(-n_mb // (n_mb // K))
    for w, peak in enumerate(sim.peak_activations):
        assert peak <= (v - 1) * rounds_max + (2 if v > 1 else 1) * (K - 1 - w) + 1
    assert bfs.peak_activations == (v * n_mb,) * K


split_costs = st.builds(
    lambda f, i, w, t: Costs(forward=f, backward_input=i, backward_weight=w, backward=i + w,
                             transfer=t),
    st.floats(0.1, 3), st.floats(0.1, 3), st.floats(0.05, 3), st.sampled_from([0.0, 0.2]),
)


@given(st.integers(2, 8), st.integers(2, 16), split_costs)
def test_zero_bubble_beats_one_f_one_b_in_its_memory(K, n_mb, costs):
    sim = simulate(zero_bubble(n_mb).program(K), costs)
    reference = simulate(one_f_one_b(n_mb).program(K), costs)
    assert sim.makespan < reference.makespan
    # ZB-H1 lets every worker hold what 1F1B's first worker holds, and no more
    assert sim.peak_activations == (max(reference.peak_activations),) * K
    assert reference.peak_activations[0] == min(K, n_mb)


@given(workers, chunks)
def test_zero_bubble_idle_time_is_a_third_of_one_f_one_b(K, n_mb):
    """Equal F, I, W costs: 1F1B idles (K-1)(F+I+W) per worker, ZB-H1 (K-1)(F+I-W)."""
    sim = simulate(zero_bubble(n_mb).program(K), EQUAL)
    reference = simulate(one_f_one_b(n_mb).program(K), EQUAL)
    assert idle(reference) == pytest.approx(3 * (K - 1))
    if n_mb >= K:
        assert sim.makespan == 3 * n_mb + K - 1
        assert idle(sim) == pytest.approx(K - 1)


@given(workers, chunks)
def test_zero_bubble_v_nearly_removes_the_bubble(K, n_mb):
    """ZB-V's 2K stages hold half of a worker's layers each: costs 1 against 1F1B's 2."""
    sim = simulate(zero_bubble_v(n_mb).program(2 * K), EQUAL)
    reference = simulate(one_f_one_b(n_mb).program(K), scaled(EQUAL, 2))
    h1 = simulate(zero_bubble(n_mb).program(K), scaled(EQUAL, 2))
    if K >= 2:
        assert sim.makespan < reference.makespan
    if n_mb >= K:
        assert sim.makespan <= h1.makespan
    if n_mb >= 2 * K:  # the last worker waits K-1 for its first input, and that is all
        assert sim.makespan <= 6 * n_mb + (K - 1) + 2
    # at most 2K half-stage activations: the memory of 1F1B's first worker
    assert max(sim.peak_activations) <= min(2 * K, 2 * n_mb)


@given(st.integers(1, 5), st.integers(1, 8), st.integers(1, 3))
def test_v_shape_order_is_valid_whatever_the_cap(K, n_mb, cap):
    """A cap too small for the V stalls; forwards then pass the cap, and nothing hangs."""
    program = validate(v_shape_order(n_mb, K, cap))
    assert program.placement == tuple(min(s, 2 * K - 1 - s) for s in range(2 * K))


@pytest.mark.parametrize("make, n_stages", [(zero_bubble, 3), (zero_bubble_v, 4),
                                            (interleaved_one_f_one_b, 4), (looped_bfs, 4)])
def test_remat_applies_to_the_research_schedules(make, n_stages):
    program = make(3, remat="except_last").program(n_stages)
    assert recomputed(program) == {(s, m) for s in range(n_stages) for m in (1, 2)}
    assert normalize_remat(make(3).remat) == "never"
