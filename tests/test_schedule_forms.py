"""Any schedule form works the same: program_of, apply_remat, the stage-count error; render
shows the whole program; draw keeps its labels legible."""

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpipe.schedules import (
    Action,
    Costs,
    Op,
    ScheduleError,
    Span,
    StageCountError,
    apply_remat,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    placement_of,
    program_of,
    render,
    simulate,
    zero_bubble_v,
)
from fpipe.schedules.remat import recomputed
from fpipe.schedules.render import chart_plan


def forms(n_stages):
    """The same 1F1B program for ``n_stages`` stages in each schedule form."""
    value = one_f_one_b(4)
    return [value, value.program(n_stages), value.program, lambda n: value.program(n)]


@pytest.mark.parametrize("form", range(4))
def test_program_of_and_apply_remat_take_every_form(form):
    schedule = forms(3)[form]
    assert program_of(schedule, 3) == one_f_one_b(4).program(3)
    remat = apply_remat(schedule, "always")
    assert program_of(remat, 3) == one_f_one_b(4, "always").program(3)
    assert recomputed(program_of(remat, 3)) == {(s, m) for s in range(3) for m in range(4)}
    assert program_of(remat, 3).placement == placement_of(schedule, 3) == (0, 1, 2)
    assert placement_of(zero_bubble_v(2), 4) == (0, 1, 1, 0)


@pytest.mark.parametrize("schedule, n_stages", [
    (one_f_one_b(4).program(3), 4), (lambda n: one_f_one_b(4).program(3), 4),
    (one_f_one_b(4), 0), (gpipe(2).program, -1), (zero_bubble_v(2), 3),
    (interleaved_one_f_one_b(4, 3), 4)])
def test_a_wrong_stage_count_is_one_error_whatever_the_form(schedule, n_stages):
    with pytest.raises(StageCountError) as caught:
        program_of(schedule, n_stages)
    error = caught.value
    assert isinstance(error, ScheduleError) and isinstance(error, ValueError)
    assert isinstance(error, TypeError) and error.rule == "stage-count"
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is StageCountError and str(again) == str(error)


def test_stage_count_errors_of_the_placements():
    with pytest.raises(StageCountError, match="needs an even number of stages, got 3"):
        zero_bubble_v(2).program(3)
    with pytest.raises(StageCountError, match="is a multiple of 3"):
        interleaved_one_f_one_b(4, 3).program(4)
    with pytest.raises(TypeError, match="must return a Program"):
        program_of(lambda n: None, 2)
    with pytest.raises(TypeError, match="needs a Program or a schedule"):
        apply_remat(3, "always")


@given(st.integers(2, 8), st.integers(8, 40))
def test_render_shows_the_whole_program(n_stages, chunks):
    program = one_f_one_b(chunks).program(n_stages)
    text = render(program)
    assert "cut at time" not in text
    for w, actions in enumerate(program.workers):
        row = next(line for line in text.splitlines() if line.startswith(f"worker {w} "))
        assert row.replace(".", " ").split()[2:] == [str(a) for a in actions]


def test_draw_folds_long_programs_so_every_label_fits():
    sim = simulate(zero_bubble_v(32).program(8), Costs(forward=1, backward=2))
    plan = chart_plan(sim.timeline)
    assert 2 <= len(plan.panels) <= 16
    assert all(plan.labelled(s) for row in sim.timeline for s in row)
    assert plan.panels[0][0] == 0 and plan.panels[-1][1] == pytest.approx(sim.makespan)


def test_draw_leaves_tiny_measured_actions_unlabelled():
    """A measured step: one long action among short ones, some tiny."""
    row, t = [], 0.0
    for m in range(30):
        length = 0.05 if m == 3 else (1e-5 if m % 2 else 1e-3)
        row.append(Span(Action(0, Op.FORWARD, m), t, t + length))
        t += length
    plan = chart_plan([row])
    assert len(plan.panels) <= 2  # not sixteen mostly empty panels
    assert plan.labelled(row[3]) and not plan.labelled(row[1])
