"""Text timelines, Gantt charts, and programs shown in ScheduleError messages."""

import re
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import corruptions, programs

from fpipe.schedules import (
    Costs,
    Program,
    ScheduleError,
    Span,
    draw,
    gpipe,
    listing,
    one_f_one_b,
    render,
    simulate,
    validate,
)

ACTION = re.compile(r"\d+[FRBIW]\d+")


def rows(text):
    """Per worker line, the action spellings in it, in order."""
    lines = [line for line in text.splitlines() if line.startswith("worker ")]
    return [ACTION.findall(line.split(" ", 2)[2]) if line.count(" ") >= 2 else []
            for line in lines]


def spelled(program):
    return [[str(a) for a in actions] for actions in program.workers]


def test_one_f_one_b():
    assert render(one_f_one_b(4).program(3)) == (
        "         0       2       4       6       8       10      12      14      16\n"
        "worker 0 0F0 0F1 0F2 ................0B0     0F3 0B1     ....0B2     ....0B3\n"
        "worker 1 ....1F0 1F1 ........1B0     1F2 1B1     1F3 1B2     ....1B3     ........\n"
        "worker 2 ........2F0 2B0     2F1 2B1     2F2 2B2     2F3 2B3     ................"
    )


costs = st.builds(Costs, forward=st.sampled_from([0.0, 0.5, 1.0]),
                  backward=st.floats(0, 3), backward_input=st.floats(0, 2),
                  backward_weight=st.sampled_from([0.0, 1.0, 2.5]), transfer=st.floats(0, 1))


@given(programs(), costs)
def test_every_action_once_in_worker_order(program, costs):
    text = render(program, costs, max_width=None)
    assert rows(text) == spelled(program)
    simulation = simulate(program, costs)
    assert render(simulation, max_width=None) == text
    assert render(simulation.timeline, max_width=None) == text


@given(programs(max_stages=6, max_microbatches=6), st.integers(20, 80))
def test_width_is_capped(program, max_width):
    text = render(program, max_width=max_width)
    lines = text.splitlines()
    cut = lines[-1].startswith("(cut at time")
    body = lines[:-1] if cut else lines
    assert all(len(line) <= max_width for line in body)
    shown = rows(text)
    for actions, visible in zip(spelled(program), shown):
        assert visible == actions[:len(visible)]
    hidden = sum(map(len, spelled(program))) - sum(map(len, shown))
    assert cut == (hidden > 0)
    if cut:
        assert f": {hidden} of " in lines[-1]


def test_recorded_timeline_and_options():
    program = Program([["0F0", "0B0"], ["1F0", "1B0"]], 2, 1)
    recorded = [[Span(a, 100.0 + t, 100.0 + t + 0.25) for a, t in zip(w, (0, 1.5))]
                for w in program.workers]
    text = render(recorded, idle="-", ruler=False)
    assert text.splitlines()[0].startswith("worker 0 0F0")
    assert rows(text) == spelled(program) and "-" in text
    with pytest.raises(ValueError, match="idle must be one character"):
        render(program, idle="..")
    with pytest.raises(ValueError, match="costs apply to a program only"):
        render(simulate(program), Costs())
    with pytest.raises(TypeError, match="expected a Program, a Simulation or a timeline"):
        render(3)


def test_listing_marks_and_windows():
    program = one_f_one_b(64).program(16)
    text = listing(program, [(5, 40)], max_actions=10, max_workers=4)
    lines = text.splitlines()
    assert len(lines) <= 4 + 2 and lines[0] == lines[-1] == "..."
    assert f"[{program.workers[5][40]}]" in text and text.count("[") == 1
    assert all(len(ACTION.findall(line)) <= 10 for line in lines)
    small = Program([["0F0", "0B0"], ["1F0", "1B0"]], 2, 1)
    assert listing(small, [(1, 0), (0, 1)]) == "worker 0: 0F0 [0B0]\nworker 1: [1F0] 1B0"


@given(corruptions())
def test_errors_show_the_program_with_the_action_marked(case):
    program, rule = case
    with pytest.raises(ScheduleError) as info:
        validate(program)
    error = info.value
    message = str(error)
    first, *shown = message.splitlines()
    assert first.startswith(f"schedule rule '{rule}' broken")
    located = (error.worker is not None and error.action is not None
               and error.action in program.workers[error.worker])
    if located:
        assert f"[{error.action}]" in message
    if program.n_workers:
        assert shown and all(line.startswith("  worker ") or line == "  ..." for line in shown)


def test_errors_stay_short_for_big_programs():
    program = one_f_one_b(256).program(32)
    workers = [list(actions) for actions in program.workers]
    workers[20].insert(100, workers[20].pop(300))  # a backward long before its forward
    with pytest.raises(ScheduleError) as info:
        validate(Program(workers, 32, 256))
    message = str(info.value)
    assert info.value.rule == "backward-after-forward"
    assert f"[{info.value.action}]" in message and len(message) < 2000
    workers = [list(actions) for actions in program.workers]
    workers[9].insert(10, workers[9].pop(40))  # deadlocks across every worker
    with pytest.raises(ScheduleError) as info:
        validate(Program(workers, 32, 256))
    assert info.value.rule == "deadlock" and len(str(info.value)) < 3000
    assert "more workers wait behind them" in str(info.value)


@pytest.mark.needs_extra  # [plot]
@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<svg")])
def test_draw_writes_a_chart(tmp_path, suffix, magic):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"chart{suffix}"
    program = Program([["0F0", "2F0", "2I0", "2W0", "0B0"], ["1F0", "1B0"]], 3, 1)
    assert draw(program, path, Costs(transfer=0.1), title="two stages on worker 0") == path
    assert path.stat().st_size > 0 and magic in path.read_bytes()[:400]
    draw(simulate(gpipe(8).program(4)), tmp_path / f"gpipe{suffix}", time_unit="s")
    assert (tmp_path / f"gpipe{suffix}").stat().st_size > 0


def test_draw_refuses_unknown_formats(tmp_path):
    with pytest.raises(ValueError, match="use a .png, .svg or .pdf suffix"):
        draw(gpipe(2).program(2), tmp_path / "chart.gif")


def test_draw_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    said = r"pip install matplotlib \(or, in fpipe's clone, pip install -e '\.\[plot\]'\)"
    with pytest.raises(ImportError, match=said):
        draw(gpipe(2).program(2), tmp_path / "chart.png")


@given(st.sampled_from(["gpipe", "one_f_one_b", "zero_bubble", "zero_bubble_v",
                        "interleaved_one_f_one_b", "dual_pipe_v", "v_half", "v_min"]),
       st.integers(1, 4), st.integers(10, 40), st.sampled_from([1.0, 2.0, 3.0]))
def test_every_bar_of_a_shipped_schedule_has_its_label(name, K, chunks, backward):
    """Two-digit micro-batches too: the panels are sized for the shortest op, not for the
    median action (a backward, when there are as many as forwards). (Past about 40
    micro-batches on 8 stages, 16 panels no longer hold every label of a V.)"""
    import fpipe.schedules as schedules
    from fpipe.schedules.render import chart_plan

    make = getattr(schedules, name)
    if name == "interleaved_one_f_one_b":
        schedule, n_stages = make(chunks, 2), 2 * K
    else:
        schedule, n_stages = make(chunks), (2 * K if name in ("zero_bubble_v", "dual_pipe_v",
                                                              "v_half", "v_min") else K)
    timeline = simulate(schedule.program(n_stages), Costs(backward=backward)).timeline
    plan = chart_plan(timeline)
    unlabelled = [str(s.action) for row in timeline for s in row if not plan.labelled(s)]
    assert unlabelled == []
