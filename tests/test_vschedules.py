"""V-Half and V-Min (the controllable-memory V schedules, Qi et al. 2024): valid programs,
the authors' generator's times exactly, the peak live pairs the building blocks give, exact
gradients when run, CSV and charts, and choose_schedule's use of them."""

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import TIGHT, assert_trees_close, block, mlp_params, mse, whole_batch
from schedule_strategies import remat_policies

import fpipe
from fpipe.schedules import (
    FAMILIES,
    ControllableV,
    Costs,
    Memory,
    Op,
    choose_schedule,
    draw,
    from_csv,
    render,
    simulate,
    to_csv,
    v_half,
    v_min,
    validate,
)
from fpipe.schedules.controllable_v import BLOCKS, PERIOD, v_peak
from fpipe.schedules.remat import recomputed

F, R, I, W = Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
MAKE = {"half": v_half, "min": v_min}

# The authors' makespans, for M = 1, 2, ..., 4K micro-batches, from their generator:
# sail-sg/zero-bubble-pipeline-parallelism at 064369d6a5c670cc20480a201363e3c0a4ec0246,
# megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py, the max_time of
# PipelineGraph(K, M, memory, f, b, w, c).create_schedule (its schedule_from_pattern of
# stable_pattern_v_<memory>, reorder on), run outside this repository (the file in a scratch
# directory, its megatron import and the ScheduledNode conversion left out), for each memory,
# K and M: `print(PipelineGraph(K, M, memory, f, b, w, c).schedule_from_pattern(
# pattern(K), M, [f, f, b, b, w, w])[0])`. Their b is the input gradient (fpipe's I), c the
# transfer time (fpipe's latency). Two cost sets: their tests' (f, b, w, c = 5, 6, 4, 1,
# tests/unit_tests/pipeline_parallel/zerobubble/test_scheduler.py) and the fixed ones their
# runtime.py passes for these schedules (1000, 1000, 1000, 1).
THEIRS_TEST_COSTS = {  # f, b, w, c = 5, 6, 4, 1
    ("half", 1): (30, 60, 90, 120),
    ("half", 2): (56, 86, 105, 135, 165, 195, 225, 255),
    ("half", 3): (82, 112, 134, 166, 196, 226, 256, 286, 316, 346, 376, 406),
    ("half", 4): (108, 128, 166, 198, 232, 238, 268, 298, 328, 358, 388, 418, 448, 478, 508, 538),
    ("half", 6): (160, 180, 210, 246, 280, 301, 357, 348, 379, 409, 439, 469, 499, 529, 559,
                  589, 619, 649, 679, 709, 739, 769, 799, 829),
    ("half", 8): (212, 232, 262, 292, 326, 362, 366, 409, 455, 459, 489, 519, 549, 579, 609,
                  639, 669, 699, 729, 759, 789, 819, 849, 879, 909, 939, 969, 999, 1029, 1059,
                  1089, 1119),
    ("min", 1): (30, 60, 90, 120),
    ("min", 2): (52, 87, 122, 157, 192, 227, 262, 297),
    ("min", 3): (78, 118, 158, 184, 224, 264, 304, 344, 384, 424, 464, 504),
    ("min", 4): (104, 144, 184, 224, 264, 304, 344, 384, 424, 464, 504, 544, 584, 624, 664, 704),
    ("min", 6): (156, 186, 238, 278, 309, 346, 388, 428, 470, 510, 552, 592, 634, 674, 716, 756,
                 798, 838, 880, 920, 962, 1002, 1044, 1084),
    ("min", 8): (208, 238, 280, 327, 367, 404, 449, 491, 531, 573, 613, 655, 695, 737, 777, 819,
                 859, 901, 941, 983, 1023, 1065, 1105, 1147, 1187, 1229, 1269, 1311, 1351, 1393,
                 1433, 1475),
}
THEIRS_RUNTIME_COSTS = {  # f, b, w, c = 1000, 1000, 1000, 1
    ("half", 1): (6000, 12000, 18000, 24000),
    ("half", 2): (10004, 15006, 19006, 25008, 31008, 37008, 43008, 49008),
    ("half", 3): (14008, 19010, 23012, 29014, 35014, 41014, 47014, 53014, 59014, 65014, 71014,
                  77014),
    ("half", 4): (18012, 22012, 27018, 34016, 38024, 41020, 47022, 53022, 59022, 65022, 71022,
                  77022, 83022, 89022, 95022, 101022),
    ("half", 6): (26020, 30020, 35022, 40024, 47026, 48034, 56042, 59034, 65034, 71034, 77034,
                  83034, 89034, 95034, 101034, 107034, 113034, 119034, 125034, 131034, 137034,
                  143034, 149034, 155034),
    ("half", 8): (34028, 38028, 43030, 48032, 53034, 60036, 59042, 65046, 71056, 77048, 83048,
                  89048, 95048, 101048, 107048, 113048, 119048, 125048, 131048, 137048, 143048,
                  149048, 155048, 161048, 167048, 173048, 179048, 185048, 191048, 197048,
                  203048, 209048),
    ("min", 1): (6000, 12000, 18000, 24000),
    ("min", 2): (9004, 15006, 21008, 27010, 33012, 39014, 45016, 51018),
    ("min", 3): (13008, 19012, 26014, 29018, 35022, 41026, 47030, 53034, 59038, 65042, 71046,
                 77050),
    ("min", 4): (17012, 23016, 29020, 35024, 41028, 47032, 53036, 59040, 65044, 71048, 77052,
                 83056, 89060, 95064, 101068, 107072),
    ("min", 6): (25020, 30022, 37030, 43034, 49036, 53042, 59048, 65052, 71058, 77062, 83068,
                 89072, 95078, 101082, 107088, 113092, 119098, 125102, 131108, 137112, 143118,
                 149122, 155128, 161132),
    ("min", 8): (33028, 38030, 44036, 51042, 57046, 63054, 69058, 75064, 81068, 87074, 93080,
                 99084, 105090, 111094, 117100, 123106, 129110, 135116, 141120, 147126, 153132,
                 159136, 165142, 171146, 177152, 183158, 189162, 195168, 201172, 207178, 213184,
                 219188),
}
COSTS = {"test": Costs(forward=5, backward_input=6, backward_weight=4, latency=1),
         "runtime": Costs(forward=1000, backward_input=1000, backward_weight=1000, latency=1)}
THEIRS = {"test": THEIRS_TEST_COSTS, "runtime": THEIRS_RUNTIME_COSTS}


def placement(K):
    return tuple(min(s, 2 * K - 1 - s) for s in range(2 * K))


@given(st.sampled_from(["half", "min"]), st.integers(1, 6), st.integers(1, 20), st.data())
def test_programs_are_valid_vs_with_every_action_once(memory, K, chunks, data):
    """Valid, on the V's placement, F, I and W of each (stage, micro-batch) once, each stage's
    ops in micro-batch order, and the remat policy applied as to every family."""
    remat = data.draw(remat_policies(2 * K))
    schedule = MAKE[memory](chunks, remat)
    program = validate(schedule.program(2 * K))
    assert (program.n_stages, program.n_microbatches) == (2 * K, chunks)
    assert program.placement == placement(K)
    count = Counter((a.stage, a.op, a.microbatch) for actions in program.workers for a in actions)
    assert count == {(s, op, m): 1 for s in range(2 * K) for m in range(chunks)
                     for op in (F, I, W)} | {k: 1 for k in count if k[1] is R}
    policy = schedule.remat
    assert recomputed(program) == {
        (s, m) for s in range(2 * K) for m in range(chunks)
        if policy == "always" or (policy == "except_last" and m != 0)
        or (isinstance(policy, frozenset) and s in policy)}
    for actions in program.workers:
        for stage in {a.stage for a in actions}:
            for op in (F, I, W):
                mbs = [a.microbatch for a in actions if a.stage == stage and a.op is op]
                assert mbs == sorted(mbs)


@pytest.mark.parametrize("costs", sorted(COSTS))
@pytest.mark.parametrize("memory, K", sorted(THEIRS_TEST_COSTS))
def test_simulated_times_are_the_authors_generators(memory, K, costs):
    """At every size of the table, fpipe's simulated makespan is the authors' time, exactly."""
    ours = tuple(simulate(MAKE[memory](m).program(2 * K), COSTS[costs]).makespan
                 for m in range(1, 4 * K + 1))
    assert ours == THEIRS[costs][memory, K]


#: The authors' orders at two sizes (the same generator's third result, stage_order, at f, b, w,
#: c = 5, 6, 4, 1; their F, f, B, b, W, w of worker w are fpipe's F of stage w, F of stage
#: 2K-1-w, I of 2K-1-w, I of w, W of 2K-1-w and W of w): times alone cannot tell the order of
#: two weight gradients of equal cost.
THEIR_ORDERS = {
    ("half", 2, 3): "worker 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0I0 3I1 3W1 3F2 3I2 0I1 3W2 0I2 0W0 "
                    "0W1 0W2\n"
                    "worker 1: 1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 1F2 2F2 2I1 1I1 2I2 1I2 2W1 2W2 "
                    "1W1 1W2",
    ("min", 3, 3): "worker 0: 0F0 0F1 0F2 5F0 5I0 5W0 5F1 5I1 5W1 0I0 0W0 5F2 0I1 5I2 5W2 0W1 "
                   "0I2 0W2\n"
                   "worker 1: 1F0 1F1 4F0 4F1 4I0 4W0 1I0 1W0 4I1 1F2 4W1 4F2 1I1 1W1 4I2 4W2 "
                   "1I2 1W2\n"
                   "worker 2: 2F0 3F0 2F1 3F1 3I0 2I0 3W0 2W0 3I1 2F2 3F2 2I1 3W1 2W1 3I2 2I2 "
                   "3W2 2W2",
}


@pytest.mark.parametrize("memory, K, chunks", sorted(THEIR_ORDERS))
def test_orders_are_the_authors(memory, K, chunks):
    assert str(MAKE[memory](chunks).program(2 * K)) == THEIR_ORDERS[memory, K, chunks]


@pytest.mark.parametrize("memory", ["half", "min"])
def test_no_two_jobs_of_a_block_share_a_slot(memory):
    """Each worker's four slots differ modulo the period, for every K (up to 60 here), so the
    block laid out once per micro-batch never puts two jobs in one slot."""
    for K in range(1, 61):
        for starts in BLOCKS[memory](K):
            assert len({s % PERIOD for s in starts}) == 4, (K, starts)


def expected_peaks(memory, K, chunks):
    """Per worker, the most live pairs (half-size stages) the blocks give: the block's peak,
    2*floor((K+2)/2) for V-Half (K+2 or K+1, about half of 1F1B's 2K) and 2*floor((K+4)/3)
    for V-Min (about a third); one fewer on worker 0 of V-Min when K = 2 (mod 3), whose
    block holds two fewer there; and no more than 2M (each of two stages' micro-batches) or
    M+1+w on worker w (the warm-up reaches worker w's peak w micro-batches later)."""
    cap = 2 * ((K + 2) // 2) if memory == "half" else 2 * ((K + 4) // 3)
    low = memory == "min" and K % 3 == 2
    return tuple(min(cap - (low and w == 0), 2 * chunks, chunks + 1 + w) for w in range(K))


@given(st.sampled_from(["half", "min"]), st.integers(1, 12), st.data())
def test_peak_live_pairs_per_worker(memory, K, data):
    """Equal to :func:`expected_peaks` per worker; V-Min with K = 2 (mod 3) and fewer
    micro-batches than workers squeezes some warm-ups lower still, so there each worker is
    only held to it. The cap is :func:`v_peak`'s, which squeezing never passes."""
    chunks = data.draw(st.integers(1, 4 * K))
    peaks = simulate(MAKE[memory](chunks).program(2 * K)).peak_activations
    expected = expected_peaks(memory, K, chunks)
    if memory == "min" and K % 3 == 2 and chunks < K:
        assert all(p <= e for p, e in zip(peaks, expected, strict=True))
    else:
        assert peaks == expected
    assert v_peak(memory, K) == max(expected_peaks(memory, K, 4 * K))


def test_half_and_a_third_of_one_f_one_b():
    """The paper's claim at K = 12 (1F1B's first worker: 12 whole-stage pairs, 24 of half
    size): V-Half 14 (24/2 + 2), V-Min 10 (24/3 + 2), ZB-V 24."""
    K = 12
    one_f_one_b = 2 * max(simulate(fpipe.one_f_one_b(48).program(K)).peak_activations)
    zb_v = max(simulate(fpipe.zero_bubble_v(48).program(2 * K)).peak_activations)
    half = max(simulate(v_half(48).program(2 * K)).peak_activations)
    least = max(simulate(v_min(48).program(2 * K)).peak_activations)
    assert (one_f_one_b, zb_v, half, least) == (24, 24, 24 // 2 + 2, 24 // 3 + 2)


@pytest.mark.parametrize("schedule, n_stages", [
    (v_half(5), 4), (v_min(6), 4), (v_half(7, "except_last"), 6), (v_min(4, "always"), 6),
    (v_half(2), 8), (v_min(1), 2)])
def test_gradients_are_the_whole_batchs(schedule, n_stages):
    """Loss and gradients equal those of the unpipelined model on the whole batch (float64)."""
    params = mlp_params(n_stages, width=4)
    x = torch.randn(2 * schedule.chunks + 1, 4, dtype=torch.float64)
    target = torch.randn(2 * schedule.chunks + 1, 4, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch([block] * n_stages, params, x, target, mse)
    with fpipe.pipeline([block] * n_stages, params, schedule=schedule, loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)


@given(st.sampled_from(["half", "min"]), st.integers(1, 5), st.integers(1, 12),
       st.sampled_from(["never", "always"]))
def test_csv_round_trip_and_text_chart(memory, K, chunks, remat):
    program = MAKE[memory](chunks, remat).program(2 * K)
    assert from_csv(to_csv(program)) == program
    text = render(program, COSTS["test"], max_width=None)
    rows = [line.split()[2:] for line in text.splitlines() if line.startswith("worker ")]
    spelled = [[str(a) for a in actions] for actions in program.workers]
    assert [[cell for cell in row for cell in [cell.strip(".")] if cell] for row in rows] == \
        spelled


@pytest.mark.needs_extra  # [plot]
def test_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    for make in (v_half, v_min):
        path = draw(simulate(make(8).program(8), COSTS["test"]), tmp_path / "v.png")
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_values_and_errors():
    assert v_half(4) == ControllableV(4, "half", "never") != v_min(4) == ControllableV(4, "min")
    assert fpipe.v_half is v_half and fpipe.v_min is v_min
    with pytest.raises(ValueError, match="memory must be one of 'half', 'min'"):
        ControllableV(4, "third")
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        v_min(0)
    with pytest.raises(ValueError, match="v_half places 2K stages on K workers .* got 5"):
        v_half(4).program(5)


def test_choose_schedule_picks_them_where_only_they_fit():
    """Without recomputing, on 4 workers, 16 micro-batches: every other family of 8 stages
    holds at least ZB-V's 8 pairs of an eighth of the model; V-Half holds 6 and V-Min 4. Under a
    budget of 6 pairs the search picks V-Half (the faster); under 4, V-Min."""
    costs = Costs(forward=8, backward_input=8, backward_weight=8, per="model")
    memory = Memory(activations=128 * 2**20, per="model")  # a pair: 1 MiB at 16 micro-batches
    assert {"v_half", "v_min"} <= set(FAMILIES)
    tried = choose_schedule(8, costs, n_workers=4, memory=memory, budget=6 * 2**20,
                            chunks=(16,), remat=("never",))
    assert {t.name for t in tried.trials if t.fits} == {"v_half", "v_min"}
    assert len(tried.trials) > 2
    assert tried.schedule == v_half(16) and tried.best.peak_bytes == 6 * 2**20
    least = choose_schedule(8, costs, n_workers=4, memory=memory, budget=4 * 2**20,
                            chunks=(16,), remat=("never",))
    assert least.schedule == v_min(16) and least.best.peak_bytes == 4 * 2**20
    assert [t.name for t in least.trials if t.fits] == ["v_min"]


def test_drawn_by_the_strategies_as_shipped_families():
    """fpipe.schedules.strategies' shipped programs include them wherever a V fits."""
    from fpipe.schedules._orders import fitting_families

    found = fitting_families(6, 5)
    assert found["v_half"] == v_half(5).program(6) and found["v_min"] == v_min(5).program(6)
    assert not {"v_half", "v_min"} & set(fitting_families(5, 5))
