"""DualPipeV with DeepSeek's pairing: a forward overlapped with a backward is one unit, placed
where torch's ScheduleDualPipeV places its OVERLAP_F_B actions, whose simulated bubble is the
one DeepSeek's DualPipe README gives, which CSV keeps, and which runs exact."""

import csv
import io
import re
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import TIGHT, assert_trees_close, block, mlp_params, mse, whole_batch

import fpipe
from fpipe._runtime.instructions import KINDS, compiled
from fpipe.schedules import (
    Action,
    B,
    Costs,
    Overlap,
    Program,
    R,
    ScheduleError,
    UnmeasuredCostWarning,
    apply_remat,
    colocate,
    dual_pipe_v,
    from_csv,
    simulate,
    to_csv,
    validate,
)

UNIT = dict(forward=1, backward_input=1, backward_weight=1)  # F = I = W = 1, so B = 2


def torch_dual_pipe_v(n_workers: int, chunks: int) -> list[list]:
    """torch's own per-rank DualPipeV order (its computation needs no process group)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    fake = types.SimpleNamespace(pp_group_size=n_workers, _n_microbatches=chunks)
    return [[a for a in ScheduleDualPipeV._calculate_single_rank_operations(fake, rank)
             if a is not None] for rank in range(n_workers)]


@pytest.mark.parametrize("K, chunks", [(1, 2), (2, 4), (2, 7), (3, 6), (4, 11), (5, 10)])
def test_pairs_are_torchs(K, chunks):
    """Action for action and pair for pair torch's order, and its CSV reads back as ours."""
    program = validate(dual_pipe_v(chunks).program(2 * K))
    theirs = torch_dual_pipe_v(K, chunks)
    assert [[str(u) for u in units] for units in program.units] == [
        [str(a) for a in rank] for rank in theirs]
    assert len(program.overlaps) == sum(str(a).endswith("OVERLAP_F_B") for r in theirs for a in r)
    buffer = io.StringIO()  # as torch's _dump_csv writes its compute-only order
    csv.writer(buffer).writerows(theirs)
    assert from_csv(buffer.getvalue()) == program
    assert from_csv(to_csv(program)) == program and "OVERLAP_F_B" in to_csv(program)
    unpaired = dual_pipe_v(chunks, overlap=False).program(2 * K)
    assert unpaired == program.sequential() and not unpaired.overlaps
    assert unpaired.workers == program.workers


@pytest.mark.parametrize("K", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 3, 8])
def test_bubble_is_deepseeks(K, extra):
    """DualPipeV's bubble in DeepSeek's README is (PP/2-1)(F&B + B - 3W), PP stages on PP/2
    devices, F&B a forward and a backward run as one unit. With F = I = W = 1: each worker
    idles 2(K-1) when a pair costs F+B ("sum"); the longest idle is K-1 when it costs the
    longer of the two ("max"). Without the pairing, the forward starts before its partner's
    gradient is there and the bubble halves: the issue this test holds."""
    m = 2 * K + extra
    program = dual_pipe_v(m).program(2 * K)
    for overlap, f_and_b in (("sum", 3), ("max", 2)):
        costs = Costs(**UNIT, overlap=overlap)
        sim = simulate(program, costs)
        idle = [sim.makespan - _busy(units, costs) for units in program.units]
        expected = (K - 1) * (f_and_b + 2 - 3 * 1)
        assert max(idle) == expected
        if overlap == "sum":
            assert idle == [expected] * K
    sequential = simulate(program.sequential(), Costs(**UNIT))
    assert sequential.makespan - 6 * m == K - 1


def _busy(units, costs):
    def cost(a):
        return costs.of(a.op, a.stage)
    join = max if costs.overlap == "max" else sum
    return sum(join(map(cost, u.actions)) if isinstance(u, Overlap) else cost(u) for u in units)


def test_a_pair_is_one_unit_in_the_timeline():
    program = dual_pipe_v(6).program(6)
    sim = simulate(program, Costs(**UNIT, latency=0.25))
    spans = {s.action: s for row in sim.timeline for s in row}
    for pair in program.overlaps:  # the forward waits for the backward's input too
        f, b = spans[pair.forward], spans[pair.backward]
        assert b.start == f.end
        later = Action(pair.backward.stage + 1, B, pair.backward.microbatch)
        if later in spans and program.placement[later.stage] != program.placement[b.action.stage]:
            assert f.start >= spans[later].end + 0.25
    maxed = simulate(program, Costs(**UNIT, overlap="max"))
    spans = {s.action: s for row in maxed.timeline for s in row}
    assert all(spans[p.forward].start == spans[p.backward].start for p in program.overlaps)
    with pytest.raises(ValueError, match="overlap must be 'sum' or 'max'"):
        Costs(overlap="both")


@pytest.mark.parametrize("workers, why", [
    ([["0F0", "(0F1;0W0)", "0I0", "0B1"]], "a backward"),            # W is not a backward
    ([["0F0", "(0F1;0B0)", "0B1"]], "different stages"),
    ([["0F0", "(1F0;0B0)", "1B0"]], "different micro-batches"),       # 0B0 needs 1F0

])
def test_pairs_that_cannot_overlap_are_refused(workers, why):
    program = Program.from_actions(workers)
    with pytest.raises(ScheduleError, match=why) as error:
        validate(program)
    assert error.value.rule == "overlap"


def test_pair_rules():
    pair = Overlap("2F1", "1B0")
    with pytest.raises(ScheduleError, match="right after its forward") as error:
        validate(Program([["0F0", "0F1", "3F0"], ["1F0", "2F0", "2F1", "2B0", "1B0", "2B1",
                                                  "1B1", "1F1"]], 4, 2, overlaps=[pair]))
    assert error.value.rule == "overlap"
    assert str(pair) == "(2F1;1B0)OVERLAP_F_B" and Overlap.parse(str(pair)) == pair
    program = dual_pipe_v(4).program(4)
    assert Program.parse(str(program)) == program


def test_a_pair_that_deadlocks_only_as_one_unit():
    """Worker 0's pair waits for 3B0, which worker 1 runs after 1F1, which needs the pair's
    forward: one action at a time this runs, as one unit it cannot."""
    text = """
        worker 0: 0F0 2F0 {pair} 2F1 2B1 0B0 0B1
        worker 1: 1F0 3F0 1F1 3B0 3F1 3B1 1B0 1B1
    """
    validate(Program.parse(text.format(pair="0F1 2B0")))
    with pytest.raises(ScheduleError, match="no global order") as error:
        validate(Program.parse(text.format(pair="(0F1;2B0)OVERLAP_F_B")))
    assert error.value.rule == "deadlock"


def test_remat_keeps_pairs_whole():
    program = apply_remat(dual_pipe_v(6).program(4), "always")
    validate(program)
    assert len(program.overlaps) == len(dual_pipe_v(6).program(4).overlaps)
    assert dual_pipe_v(6, "always").program(4) == program
    for units in program.units:  # each pair's recompute just before it
        for before, unit in zip(units, units[1:]):
            if isinstance(unit, Overlap):
                assert before.op.value == "R" and before.stage == unit.backward.stage


@pytest.mark.parametrize("remat", ["never", "always", "except_last"])
@pytest.mark.parametrize("K, extra", [(1, 0), (2, 0), (2, 3), (3, 1), (4, 4)])
def test_colocate_on_the_programs_own_placement_keeps_it_whole(K, extra, remat):
    """The program comes back as it was: every pair kept, so the same simulated time."""
    program = dual_pipe_v(2 * K + extra, remat).program(2 * K)
    merged = colocate(program, program.placement)
    assert merged == program and merged.overlaps == program.overlaps
    for overlap in ("sum", "max"):
        costs = Costs(**UNIT, overlap=overlap)
        assert simulate(merged, costs).makespan == simulate(program, costs).makespan


def split_pair(program, workers):
    """The first pair (by name) whose two stages ``workers`` puts on two workers, or None."""
    return next((o for o in sorted(program.overlaps, key=str)
                 if workers[o.forward.stage] != workers[o.backward.stage]), None)


@given(st.integers(1, 4), st.integers(0, 4), st.sampled_from(["never", "always"]), st.data())
def test_colocate_keeps_every_pair_or_refuses_the_placement_naming_it(K, extra, remat, data):
    """Pairs whose two stages go to one worker stay pairs (each right after its forward, with
    its recompute before it); a placement splitting one is refused, naming it."""
    program = dual_pipe_v(2 * K + extra, remat).program(2 * K)
    drawn = data.draw(st.lists(st.integers(0, 2 * K - 1), min_size=2 * K, max_size=2 * K))
    labels: dict[int, int] = {}
    workers = [labels.setdefault(w, len(labels)) for w in drawn]
    split = split_pair(program, workers)
    if split is not None:
        with pytest.raises(ValueError, match=rf"split the overlapped pair {re.escape(str(split))}"
                                             rf": stage {split.forward.stage} goes to worker "
                                             rf"{workers[split.forward.stage]} and stage "
                                             rf"{split.backward.stage} to worker "
                                             rf"{workers[split.backward.stage]}"):
            colocate(program, workers)
        colocate(program.sequential(), workers)  # the advice, followed, works
        return
    merged = validate(colocate(program, workers))
    assert merged.overlaps == program.overlaps and merged.placement == tuple(workers)
    paired = sum((list(units) for units in merged.units), [])
    assert sum(isinstance(u, Overlap) for u in paired) == len(program.overlaps)
    if remat == "always":  # each pair's recompute just before it, as apply_remat puts it
        for before, unit in zip(paired, paired[1:]):
            if isinstance(unit, Overlap):
                assert before == Action(unit.backward.stage, R, unit.backward.microbatch)


def test_colocate_merging_whole_workers_keeps_the_pairs():
    program = dual_pipe_v(8).program(8)  # 4 workers, pairs on each
    merged = colocate(program, [w // 2 for w in program.placement])
    assert merged.n_workers == 2 and merged.overlaps == program.overlaps
    assert len(program.overlaps) > 0


@pytest.mark.parametrize("schedule, n_stages", [
    (dual_pipe_v(2), 2), (dual_pipe_v(4), 4), (dual_pipe_v(7), 4), (dual_pipe_v(9), 6),
    (dual_pipe_v(6, "always"), 4), (dual_pipe_v(6, "except_last"), 6)])
def test_each_await_comes_right_before_its_pairs_forward(schedule, n_stages):
    """A worker's instructions are its actions in order, with an ``await`` of each pair's
    backward inserted right before the pair's forward, so the forward waits for the
    backward's inputs (a pair starts as one unit); the backward follows the forward."""
    program = schedule.program(n_stages)
    pair_of = {o.forward: o for o in program.overlaps}
    for actions, plan in zip(program.workers, compiled({}, program, True), strict=True):
        expected = []
        for action in actions:
            pair = pair_of.get(action)
            if pair is not None:
                expected.append((None, pair.backward.stage, pair.backward.microbatch))
            expected.append((action.op, action.stage, action.microbatch))
        assert [(kind.op, stage, mb) for kind, stage, mb in plan] == expected
        for i, (kind, stage, mb) in enumerate(plan):
            if kind is KINDS["await"]:
                forward = Action(plan[i + 1][1], plan[i + 1][0].op, plan[i + 1][2])
                assert pair_of[forward].backward == Action(stage, plan[i + 2][0].op, mb)
    assert program.overlaps


def test_pairs_run_exact_and_wait_as_one_unit():
    """Loss and gradients equal the whole batch's (float64) with pairs, also with remat; each
    pair's forward is compiled after an await of its backward's inputs; a step in two calls
    refuses pairs with why."""
    params = mlp_params(4, width=4)
    x = torch.randn(9, 4, dtype=torch.float64)
    target = torch.randn(9, 4, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch([block] * 4, params, x, target, mse)
    for schedule in (dual_pipe_v(5), dual_pipe_v(4, "except_last")):
        plan = compiled({}, schedule.program(4), True)
        awaits = sum(kind is KINDS["await"] for actions in plan for kind, _, _ in actions)
        assert awaits == len(schedule.program(4).overlaps) > 0
        with fpipe.pipeline([block] * 4, params, schedule=schedule, loss_fn=mse) as pipe:
            loss, grads = pipe.value_and_grad(x, target)
            torch.testing.assert_close(loss, expected_loss, **TIGHT)
            assert_trees_close(grads, expected_grads)
            with pytest.raises(ValueError, match="overlapped forward-backward pairs"):
                pipe.vjp(x)


def test_simulate_warns_when_a_recompute_was_never_measured():
    program = dual_pipe_v(4).program(4)
    fitted = Costs.from_timeline(simulate(program, Costs(**UNIT)).timeline)
    assert ("recompute", 0) in fitted.unmeasured and ("forward", 0) not in fitted.unmeasured
    simulate(program, fitted)  # no recompute priced: no warning (pytest would show it)
    with pytest.warns(UnmeasuredCostWarning, match="never measured"):
        simulate(apply_remat(program, "always"), fitted)
    with pytest.warns(UnmeasuredCostWarning):
        simulate(apply_remat(program, "always"), fitted.as_model(4))
    measured = Costs.from_timeline(simulate(apply_remat(program, "always"), Costs()).timeline)
    assert not measured.unmeasured
