"""Recorded timelines: every action once, in each worker's order, after what it depends on."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import block, mlp_params, mse
from schedule_strategies import needs

import fpipe
from fpipe.schedules import Program, gpipe, one_f_one_b

SPLIT = Program.parse("""
worker 0: 0F0 0F1 0I0 0I1 0W0 0W1
worker 1: 1F0 1I0 1F1 1I1 1W1 1W0
""")


def check(timeline, program, present):
    assert [[span.action for span in spans] for spans in timeline] == \
        [list(actions) for actions in program.workers]
    ends = {span.action: span.end for spans in timeline for span in spans}
    for spans in timeline:
        for span, after in zip(spans, spans[1:] + (None,)):
            assert 0 <= span.start <= span.end
            assert after is None or span.end <= after.start
            # A span starts once its inputs arrived: after every action it depends on ended
            # (the dependency rules as the tests state them, not fpipe's validator's).
            for need in needs(span.action, program):
                assert need in present and ends[need] <= span.start


@settings(deadline=None, max_examples=15)
@given(n_stages=st.integers(1, 3), chunks=st.integers(1, 4),
       make=st.sampled_from([gpipe, one_f_one_b]), remat=st.sampled_from(["never", "always"]))
def test_training_timeline_follows_the_program(n_stages, chunks, make, remat):
    schedule = make(chunks, remat)
    program = schedule.program(n_stages)
    recorder = fpipe.Recorder()
    with fpipe.pipeline([block] * n_stages, mlp_params(n_stages), schedule=schedule,
                        loss_fn=mse) as pipe:
        x = torch.randn(8, 8, dtype=torch.float64)
        pipe.value_and_grad(x, x, record=recorder)
        pipe(x, record=recorder)
    present = {a for actions in program.workers for a in actions}
    training, inference = recorder.steps
    check(training, program, present)
    forwards = program.forward_only()
    check(inference, forwards, {a for actions in forwards.workers for a in actions})


def test_split_backward_is_recorded_as_input_then_weight():
    recorder = fpipe.Recorder()
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=SPLIT, loss_fn=mse) as pipe:
        x = torch.randn(4, 8, dtype=torch.float64)
        pipe.value_and_grad(x, x, record=recorder)
    check(recorder.timeline, SPLIT, {a for actions in SPLIT.workers for a in actions})


def test_nothing_recorded_yet():
    with pytest.raises(ValueError, match="record=recorder"):
        _ = fpipe.Recorder().timeline


def test_a_bubble_over_chosen_workers_is_theirs_alone():
    """A distributed rank's figures give its own worker's bubble, ``1 - busy / makespan`` of
    its spans, not the average with workers it does not run (binary fractions: exact)."""
    from fpipe.schedules.actions import Action, Op
    from fpipe.schedules.simulate import Span
    timeline = ((Span(Action(0, Op.FORWARD, 0), 0.0, 0.25),
                 Span(Action(0, Op.BACKWARD, 0), 0.75, 1.0)),
                (Span(Action(1, Op.FORWARD, 0), 0.25, 0.5),))
    assert fpipe.timeline.bubble(timeline) == 1 - 0.75 / (1.0 * 2)
    assert fpipe.timeline.bubble(timeline, (0,)) == 1 - 0.5 / 1.0
    assert fpipe.timeline.bubble(timeline, (1,)) == 1 - 0.25 / 0.5
    assert fpipe.timeline.bubble(((), ()), (1,)) is None
