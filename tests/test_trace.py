"""Chrome/Perfetto traces of simulated and recorded timelines."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import programs

from fpipe.schedules import (
    Costs,
    Program,
    Span,
    chrome_trace,
    one_f_one_b,
    simulate,
    write_chrome_trace,
)


def complete(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@given(programs(), st.floats(0, 3), st.sampled_from([1.0, 1e3, 1e6]))
def test_one_event_per_action_with_the_spans_durations(program, backward, unit):
    sim = simulate(program, Costs(backward=backward, transfer=0.25))
    trace = chrome_trace(sim, unit=unit)
    assert json.loads(json.dumps(trace)) == trace
    events = complete(trace)
    spans = [(w, s) for w, row in enumerate(sim.timeline) for s in row]
    assert len(events) == len(spans)
    for event, (worker, span) in zip(events, spans):
        action = span.action
        assert event["name"] == str(action)
        assert (event["pid"], event["tid"]) == (0, worker)
        assert event["ts"] == pytest.approx(span.start * unit)
        assert event["dur"] == pytest.approx((span.end - span.start) * unit)
        assert event["args"] == {"stage": action.stage, "op": action.op.value,
                                 "microbatch": action.microbatch}


def test_simulated_and_measured_side_by_side(tmp_path):
    program = one_f_one_b(2).program(2)
    sim = simulate(program)
    # A recorded timeline: wall-clock seconds from some arbitrary origin.
    measured = tuple(tuple(Span(s.action, 5000.0 + s.start * 0.01, 5000.0 + s.end * 0.011)
                           for s in row) for row in sim.timeline)
    trace = chrome_trace({"simulated": sim, "measured": measured},
                         unit={"simulated": 1e4, "measured": 1e6})
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "simulated", 1: "measured"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"]
               for e in events if e["name"] == "thread_name"}
    assert threads == {(p, w): f"worker {w}" for p in (0, 1) for w in (0, 1)}
    by_pid = {pid: [e for e in complete(trace) if e["pid"] == pid] for pid in (0, 1)}
    assert len(by_pid[0]) == len(by_pid[1]) == 8
    assert min(e["ts"] for e in by_pid[1]) == 0  # aligned to its first span
    first = measured[0][1]
    event = next(e for e in by_pid[1] if e["name"] == str(first.action))
    assert event["ts"] == pytest.approx((first.start - 5000.0) * 1e6)
    assert event["dur"] == pytest.approx((first.end - first.start) * 1e6)
    unaligned = complete(chrome_trace(measured, align=False))
    assert unaligned[0]["ts"] == pytest.approx(5000.0 * 1e6)

    path = write_chrome_trace(tmp_path / "step.json", {"simulated": sim, "measured": measured})
    assert json.loads(path.read_text())["traceEvents"]


def test_programs_are_simulated_first():
    program = Program([["0F0", "0B0"]], 1, 1)
    events = complete(chrome_trace(program, costs=Costs(forward=2, backward=3)))
    assert [(e["name"], e["ts"], e["dur"]) for e in events] == [
        ("0F0", 0.0, 2e6), ("0B0", 2e6, 3e6)]
    assert chrome_trace(program)["traceEvents"][0]["args"]["name"] == "simulated"


@pytest.mark.parametrize("call, message", [
    (lambda sim: chrome_trace({}), "no timelines given"),
    (lambda sim: chrome_trace({"a": sim}, unit={"b": 1.0}), "unit gives no scale for 'a'"),
    (lambda sim: chrome_trace(sim, unit=0), "must be a positive number of microseconds"),
    (lambda sim: chrome_trace([[Span(sim.timeline[0][0].action, 2.0, 1.0)]]),
     "ends .* before it starts"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call(simulate(one_f_one_b(2).program(2)))
