"""The public hypothesis strategies: valid programs are valid, corruptions always rejected."""

import sys
from pathlib import Path

import patience
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schedule_strategies import run_by_hand

from fpipe.schedules import FAMILIES, Op, ScheduleError, validate
from fpipe.schedules._orders import fitting_families, shipped
from fpipe.schedules.strategies import CORRUPTIONS, corruptions, programs

ROOT = Path(__file__).resolve().parent.parent
ORDER_RULES = {"forward-order", "backward-order", "backward-after-forward",
               "backward-after-recompute", "recompute-after-forward", "weight-after-input"}


def ops(program):
    return {a.op for actions in program.workers for a in actions}


@given(programs())
def test_programs_are_valid(program):
    assert run_by_hand(program) is None
    validate(program)
    assert program.n_workers <= program.n_stages


@given(programs(max_stages=4, max_microbatches=3, max_workers=6, split=True, remat=True))
def test_programs_options(program):
    validate(program)
    assert Op.BACKWARD not in ops(program)
    recomputes = sum(a.op is Op.RECOMPUTE for actions in program.workers for a in actions)
    assert recomputes == program.n_stages * program.n_microbatches
    assert program.n_stages <= 4 and program.n_microbatches <= 3 and program.n_workers <= 6


@given(programs(split=False, remat=False))
def test_programs_without_split_or_remat(program):
    validate(program)
    assert ops(program) == {Op.FORWARD, Op.BACKWARD}


@given(programs(training=False))
def test_inference_programs(program):
    validate(program, training=False)
    assert ops(program) == {Op.FORWARD}


def drawn(strategy, n):
    """``n`` draws of ``strategy`` as the tests get them (its generation phase), the same draws
    at every run (derandomized), so the shares below are reproducible."""
    seen = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], derandomize=True,
              deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(value):
        seen.append(value)

    draw()
    return seen


def test_programs_reach_the_whole_space():
    """Most programs drawn have several busy workers, and most of them at least 4 stages and
    4 micro-batches too; a sizeable share overlap pairs, share workers between stages, split
    backwards and recompute. The shares are printed (pytest -s) and bounded."""
    seen = drawn(programs(), 300)

    def share(has):
        return sum(map(has, seen)) / len(seen)

    def busy(p):
        return sum(1 for actions in p.workers if actions)

    shares = {
        ">= 2 busy workers": share(lambda p: busy(p) >= 2),
        ">= 4 stages, >= 4 micro-batches, >= 2 busy workers":
            share(lambda p: p.n_stages >= 4 and p.n_microbatches >= 4 and busy(p) >= 2),
        "overlapped pairs": share(lambda p: bool(p.overlaps)),
        "a worker with several stages": share(
            lambda p: any(len({a.stage for a in actions}) > 1 for actions in p.workers)),
        "split backwards": share(lambda p: Op.BACKWARD_INPUT in ops(p)),
        "recomputes": share(lambda p: Op.RECOMPUTE in ops(p)),
    }
    report = "\n".join(f"{value:6.1%}  {name}" for name, value in shares.items())
    print(f"\nof {len(seen)} programs drawn:\n{report}")
    bounds = {">= 2 busy workers": 0.6, ">= 4 stages, >= 4 micro-batches, >= 2 busy workers":
              0.45, "overlapped pairs": 0.15, "a worker with several stages": 0.5,
              "split backwards": 0.3, "recomputes": 0.3}
    assert all(shares[name] >= bound for name, bound in bounds.items()), report
    for program in seen:
        validate(program)


def test_the_shipped_branch_draws_every_shipped_family():
    """Every family choose_schedule knows fits some sizes the strategy draws, and at the
    largest default sizes (6 stages, 6 micro-batches) every one is drawn."""
    reached = set().union(*(fitting_families(s, m) for s in range(1, 7) for m in range(1, 7)))
    assert reached == set(FAMILIES)
    assert {name for name, _ in drawn(shipped(6, 6), 60)} == set(FAMILIES)
    for name, program in fitting_families(6, 6).items():
        assert program == FAMILIES[name](6, "never", 6, program.n_workers).program(6)


@settings(max_examples=12, deadline=None)
@given(programs(max_stages=4, max_microbatches=4, overlap=True).filter(lambda p: p.overlaps))
def test_programs_with_overlapped_pairs_run_exact(program):
    """Generated programs with overlapped pairs run on torch with the whole batch's loss and
    gradients (float64, 1e-12)."""
    import torch
    from models import TIGHT, assert_trees_close, block, mlp_params, mse, whole_batch

    import fpipe

    n = program.n_stages
    params = mlp_params(n, width=4)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(program.n_microbatches, 4, generator=g, dtype=torch.float64)
    target = torch.randn(program.n_microbatches, 4, generator=g, dtype=torch.float64)
    expected_loss, expected_grads = whole_batch([block] * n, params, x, target, mse)
    with fpipe.pipeline([block] * n, params, schedule=program, loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    torch.testing.assert_close(loss, expected_loss, **TIGHT)
    assert_trees_close(grads, expected_grads)


def rejected(program, rule):
    # Invalid by a reference outside fpipe too: the test's own event loop cannot run it.
    assert run_by_hand(program) is not None, program
    with pytest.raises(ScheduleError) as info:
        validate(program)
    assert info.value.rule == rule, f"{info.value}\nexpected rule {rule!r}"
    return info.value


@given(corruptions())
def test_corruptions_are_rejected_with_their_rule(case):
    program, rule = case
    rejected(program, rule)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
@given(data=st.data())
def test_each_kind_of_corruption_is_rejected(kind, data):
    program, rule = data.draw(corruptions(kinds=[kind]))
    rejected(program, rule)
    if CORRUPTIONS[kind] is not None:
        assert rule == CORRUPTIONS[kind]
    else:
        assert rule in ORDER_RULES


@given(corruptions(programs(max_stages=3, max_microbatches=2), kinds=["deadlock", "drop"]))
def test_corruptions_of_a_given_strategy(case):
    program, rule = case
    assert rule in ("deadlock", "exactly-once")
    assert program.n_stages <= 3
    rejected(program, rule)


@given(st.data())
def test_unknown_kind(data):
    with pytest.raises(ValueError, match="unknown corruption kinds"):
        data.draw(corruptions(kinds=["explode"]))


def test_fpipe_needs_no_hypothesis():
    code = ("import sys\n"
            "sys.modules['hypothesis'] = None\n"
            "import fpipe.schedules\n"
            "assert 'fpipe.schedules.strategies' not in sys.modules\n"
            "try:\n"
            "    import fpipe.schedules.strategies\n"
            "except ImportError as error:\n"
            "    assert 'pip install hypothesis' in str(error), error\n"
            "else:\n"
            "    raise AssertionError('imported without hypothesis')\n")
    patience.run([sys.executable, "-c", code], 120, check=True, cwd=ROOT)
