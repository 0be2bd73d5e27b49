"""validate(): every rule of contract 6, each broken on purpose and named in the error."""

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import needs, programs, research_cases, run_by_hand, schedule_cases

from fpipe.schedules import Action, Op, Program, ScheduleError, gpipe, validate
from fpipe.schedules.validate import execution_order

F, R = Op.FORWARD, Op.RECOMPUTE


def rule_of(program, **kwargs):
    with pytest.raises(ScheduleError) as info:
        validate(program, **kwargs)
    return info.value


def edit(program, worker, actions):
    workers = list(program.workers)
    workers[worker] = actions
    return Program(workers, program.n_stages, program.n_microbatches)


@given(programs())
def test_valid_programs_validate(program):
    # Valid by a reference outside fpipe: the test's own event loop runs every action.
    assert run_by_hand(program) is None
    assert validate(program) is program
    inference = program.forward_only()
    assert run_by_hand(inference, training=False) is None
    assert validate(inference, training=False) is inference


@given(st.one_of(schedule_cases(), research_cases()))
def test_shipped_schedules_run_by_hand(case):
    schedule, n_stages = case
    program = schedule.program(n_stages)
    assert run_by_hand(program) is None
    assert run_by_hand(program.forward_only(), training=False) is None


@given(programs())
def test_execution_order_respects_workers_and_dependencies(program):
    order = execution_order(program)
    assert sorted(order, key=str) == sorted((a for w in program.workers for a in w), key=str)
    rank = {a: i for i, a in enumerate(order)}
    for actions in program.workers:
        assert [rank[a] for a in actions] == sorted(rank[a] for a in actions)
        for action in actions:
            assert all(rank[d] < rank[action] for d in needs(action, program))


@given(programs(), st.data())
def test_dropping_an_action_is_rejected(program, data):
    candidates = [(w, i) for w, acts in enumerate(program.workers)
                  for i, a in enumerate(acts) if a.op is not R]
    worker, index = data.draw(st.sampled_from(candidates))
    actions = list(program.workers[worker])
    dropped = actions.pop(index)
    error = rule_of(edit(program, worker, actions))
    assert (error.rule, error.action, error.worker) == ("exactly-once", dropped, worker)
    assert f"{dropped} is missing" in str(error)


@given(programs(), st.data())
def test_duplicating_an_action_is_rejected(program, data):
    worker = data.draw(st.sampled_from([w for w, a in enumerate(program.workers) if a]))
    actions = list(program.workers[worker])
    copy = data.draw(st.sampled_from(actions))
    actions.insert(data.draw(st.integers(0, len(actions))), copy)
    error = rule_of(edit(program, worker, actions))
    assert (error.rule, error.action, error.worker) == ("exactly-once", copy, worker)
    assert "more than once" in str(error)


@given(programs(), st.data())
def test_moving_an_action_before_its_dependency_is_rejected(program, data):
    candidates = []
    for worker, actions in enumerate(program.workers):
        index = {a: i for i, a in enumerate(actions)}
        for action in actions:
            local = [d for d in needs(action, program) if d in index]
            if local:
                candidates.append((worker, action, max(local, key=index.get)))
    worker, action, need = data.draw(st.sampled_from(candidates))
    actions = [a for a in program.workers[worker] if a != action]
    actions.insert(actions.index(need), action)
    error = rule_of(edit(program, worker, actions))
    expected = needs(action, program)[need]
    assert (error.rule, error.action, error.worker) == (expected, action, worker)
    assert f"needs {need}" in str(error)


@given(programs(), st.data())
def test_an_action_off_its_stages_worker_is_rejected(program, data):
    busy = [w for w, acts in enumerate(program.workers) if acts]
    source = data.draw(st.sampled_from(busy))
    others = [w for w in range(program.n_workers) if w != source]
    if not others:
        program = Program([*program.workers, []], program.n_stages, program.n_microbatches)
        others = [program.n_workers - 1]
    target = data.draw(st.sampled_from(others))
    workers = [list(acts) for acts in program.workers]
    moved = workers[source].pop(data.draw(st.integers(0, len(workers[source]) - 1)))
    workers[target].insert(data.draw(st.integers(0, len(workers[target]))), moved)
    error = rule_of(Program(workers, program.n_stages, program.n_microbatches))
    assert error.rule == "stage-placement"
    assert error.action.stage == moved.stage
    assert f"stage {moved.stage} is held by worker" in str(error)


def test_cross_worker_deadlock_names_every_blocked_worker():
    program = Program([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]], 2, 2)
    error = rule_of(program)
    assert (error.rule, error.action, error.worker) == ("deadlock", Action.parse("0B0"), 0)
    message = str(error)
    assert "schedule rule 'deadlock'" in message and "at action 0B0 on worker 0" in message
    assert "worker 0 is stuck at 0B0 waiting for 1B0 (worker 1)" in message
    assert "worker 1 is stuck at 1F1 waiting for 0F1 (worker 0)" in message


def test_deadlock_lists_workers_blocked_behind_the_cycle():
    program = Program([["0F0", "0F1", "0B0", "0B1"],
                       ["1F0", "1B0", "1F1", "1B1"],
                       ["2F1", "2F0", "2B0", "2B1"]], 3, 2)
    message = str(rule_of(program))
    assert "worker 0 is stuck at 0B0 waiting for 1B0 (worker 1)" in message
    assert "worker 1 is stuck at 1B0 waiting for 2B0 (worker 2)" in message
    assert "worker 2 is stuck at 2F1 waiting for 1F1 (worker 1)" in message


def test_error_message_names_rule_action_worker():
    program = Program([["0F0", "0B0"], ["1B0", "1F0"]], 2, 1)
    error = rule_of(program)
    assert (error.rule, error.action, error.worker) == ("backward-after-forward",
                                                        Action.parse("1B0"), 1)
    assert str(error) == ("schedule rule 'backward-after-forward' broken at action 1B0 on "
                          "worker 1: 1B0 needs 1F0, which worker 1 runs later\n"
                          "  worker 0: 0F0 0B0\n"
                          "  worker 1: [1B0] 1F0")


def test_error_survives_pickling():
    error = rule_of(Program([["0F0", "0F0", "0B0"]], 1, 1))
    again = pickle.loads(pickle.dumps(error))
    assert (again.rule, again.action, again.worker, str(again)) == (
        error.rule, error.action, error.worker, str(error))


@pytest.mark.parametrize("workers, rule, where", [
    ([["0F0", "0B0", "0F1", "0B1"]], "index-range", "at action 0F1 on worker 0"),
    ([["0F0", "1F0", "0B0", "1B0"]], "index-range", "at action 1F0 on worker 0"),
    ([["0F0", "0B0"], ["0F0"]], "stage-placement", "at action 0F0 on worker 1"),
    ([["0F0", "0B0", "0I0", "0W0"]], "exactly-once", "at action 0I0 on worker 0"),
    ([["0F0", "0B0", "0W0"]], "exactly-once", "at action 0W0 on worker 0"),
    ([["0F0", "0I0"]], "exactly-once", "at action 0W0 on worker 0"),
    ([["0F0", "0W0"]], "exactly-once", "at action 0I0 on worker 0"),
    ([["0F0"]], "exactly-once", "at action 0B0 on worker 0"),
    ([["0F0", "0R0", "0R0", "0B0"]], "exactly-once", "at action 0R0 on worker 0"),
    ([["0R0", "0F0", "0B0"]], "recompute-after-forward", "at action 0R0 on worker 0"),
    ([["0F0", "0B0", "0R0"]], "backward-after-recompute", "at action 0B0 on worker 0"),
    ([["0F0", "0W0", "0I0"]], "weight-after-input", "at action 0W0 on worker 0"),
])
def test_single_stage_rules(workers, rule, where):
    error = rule_of(Program(workers, 1, 1))
    assert error.rule == rule and where in str(error)


def test_order_rules_between_stages_on_one_worker():
    forward = Program([["1F0", "0F0", "1B0", "0B0"]], 2, 1)
    assert rule_of(forward).rule == "forward-order"
    backward = Program([["0F0", "1F0", "0B0", "1B0"]], 2, 1)
    assert rule_of(backward).rule == "backward-order"
    split = Program([["0F0", "1F0", "0I0", "1I0", "0W0", "1W0"]], 2, 1)
    error = rule_of(split)
    assert (error.rule, error.action) == ("backward-order", Action.parse("0I0"))
    assert "needs 1I0" in str(error)


def test_missing_stage_has_no_worker():
    error = rule_of(Program([["0F0", "0B0"]], 2, 1))
    assert (error.rule, error.action, error.worker) == ("exactly-once", Action.parse("1F0"), None)
    assert "1F0 is missing" in str(error)


def test_zero_workers_rejected():
    error = rule_of(Program([], 1, 1))
    assert error.rule == "no-workers" and error.action is None and error.worker is None


def test_idle_worker_allowed():
    validate(Program([["0F0", "0B0"], []], 1, 1))


def test_inference_programs():
    program = gpipe(3).program(2)
    validate(program.forward_only(), training=False)
    error = rule_of(program, training=False)
    assert error.rule == "forward-only" and error.action.op is not F
    assert rule_of(program.forward_only()).rule == "exactly-once"


@pytest.mark.parametrize("extra", ["0R0", "0B0", "0I0", "0W0"])
def test_an_inference_program_holds_nothing_but_forwards(extra):
    error = rule_of(Program([["0F0", extra]], 1, 1), training=False)
    assert (error.rule, str(error.action), error.worker) == ("forward-only", extra, 0)


def test_validation_handles_large_programs():
    """A program of over 40,000 actions validates (how fast is the benchmarks' business: a
    wall-clock bound here would fail on a loaded machine, not on slow code)."""
    program = gpipe(1024).program(16)
    assert sum(map(len, program.workers)) > 40_000
    assert validate(program) is program
