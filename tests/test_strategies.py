"""The public hypothesis strategies: valid programs are valid, corruptions always rejected."""

import sys
from pathlib import Path

import patience
import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import run_by_hand

from fpipe.schedules import Op, ScheduleError, validate
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
