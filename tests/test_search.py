"""choose_schedule: the fastest candidate that fits, never worse than one it was given, never
over budget."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fpipe.schedules import (
    FAMILIES,
    Costs,
    Memory,
    Program,
    choose_schedule,
    gpipe,
    one_f_one_b,
    peak_bytes,
    simulate,
    zero_bubble,
)

positive = st.integers(1, 8).map(float)
costs = st.builds(lambda f, b, i, t, o: Costs(forward=f, backward=b, backward_input=min(i, b),
                                              transfer=t, overhead=o),
                  positive, positive, positive, st.sampled_from([0.0, 0.5, 2.0]),
                  st.sampled_from([0.0, 0.01, 0.1]))
memories = st.builds(lambda a, i, p: Memory(activations=a, inputs=min(i, a), parameters=p),
                     st.integers(10, 1000), st.integers(0, 1000), st.integers(0, 5000))


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 4), costs, memories, st.floats(0.5, 3.0), st.data())
def test_never_over_budget_and_never_worse_than_a_candidate(K, batch_costs, memory, slack,
                                                            data):
    given_ = data.draw(st.lists(st.sampled_from([gpipe(4, "never"), one_f_one_b(2),
                                                 zero_bubble(8), gpipe(2, "always")]),
                                max_size=2, unique=True))
    budget = slack * max(peak_bytes(one_f_one_b(4).program(K), memory.scaled(1 / 4)))
    try:
        choice = choose_schedule([K, 2 * K], batch_costs.as_model(K), n_workers=K,
                                 memory=Memory(activations=memory.activations * K,
                                               inputs=memory.inputs,
                                               parameters=memory.parameters * K, per="model"),
                                 budget=budget, chunks=(2, 4), remat=("never", "always"),
                                 candidates=given_)
    except ValueError as error:
        assert "fits" in str(error) and slack < 1  # 1F1B over 4 chunks fits a budget >= 1x
        return
    best = choice.best
    assert best.fits and best.peak_bytes <= budget
    assert best.program.n_workers == K
    for trial in choice.trials:
        if trial.fits:
            assert best.makespan <= trial.makespan
    for schedule in given_:
        program = schedule.program(K)
        m = program.n_microbatches
        stage_memory = Memory(activations=memory.activations, inputs=memory.inputs,
                              parameters=memory.parameters)
        if max(peak_bytes(program, stage_memory.scaled(1 / m))) <= budget:
            assert best.makespan <= simulate(program, batch_costs.scaled(1 / m)).makespan + 1e-9


@given(st.integers(1, 4), costs)
@settings(max_examples=10, deadline=None)
def test_without_a_budget_the_fastest_of_all(K, batch_costs):
    choice = choose_schedule(K, batch_costs, chunks=(2, 4))
    fastest = min(t.makespan for t in choice.trials)
    assert choice.best.makespan == fastest
    assert {t.chunks for t in choice.trials} == {2, 4}
    assert choice.schedule == choice.best.schedule and choice.program == choice.best.program


def test_the_table_and_the_issue_case():
    """F=1, B=4 per stage, 4 workers, 8 micro-batches: ZB-H1 (46) beats 1F1B (55)."""
    per_mb = Costs(forward=1, backward=4)
    choice = choose_schedule(4, {8: per_mb}, families={
        name: FAMILIES[name] for name in ("gpipe", "one_f_one_b", "zero_bubble")},
        remat=("never",))
    assert choice.best.name == "zero_bubble" and choice.best.makespan == 46
    assert [t.makespan for t in choice.trials] == [55, 55, 46]
    text = choice.table()
    assert text.splitlines()[1].startswith("zero_bubble") and "46" in text


def test_memory_decides_when_time_does_not():
    """GPipe without remat holds all 8 micro-batches: over a budget 1F1B meets."""
    memory = Memory(activations=8 * 100, parameters=0)
    budget = 4 * 100
    choice = choose_schedule(4, Costs(), memory=memory, budget=budget, chunks=(8,),
                             remat=("never",), families={k: FAMILIES[k] for k in
                                                         ("gpipe", "one_f_one_b")})
    gpipe_trial, one_f_one_b_trial = choice.trials
    assert not gpipe_trial.fits and one_f_one_b_trial.fits
    assert choice.best is one_f_one_b_trial
    assert "over budget" in choice.table()
    with pytest.raises(ValueError, match="no candidate of 2 fits 100 bytes per worker; the "
                                         "least memory is 400 bytes"):
        choose_schedule(4, Costs(), memory=memory, budget=100, chunks=(8,), remat=("never",),
                        families={k: FAMILIES[k] for k in ("gpipe", "one_f_one_b")})


def test_bad_arguments():
    with pytest.raises(ValueError, match="a budget needs a memory model"):
        choose_schedule(2, Costs(), budget=10)
    with pytest.raises(TypeError, match="costs must be a Costs value or a mapping"):
        choose_schedule(2, {"forward": 1.0}.values())
    with pytest.raises(ValueError, match="has no entry"):
        choose_schedule(2, {4: Costs()}, candidates=[gpipe(8)])


def test_candidates_of_any_form_and_errors_are_rows():
    hand = Program([["0F0", "0B0"], ["1F0", "1B0"]], 2, 1)
    choice = choose_schedule(2, Costs(), chunks=(1,), families={},
                             candidates=[hand, zero_bubble(1), lambda n: hand])
    assert [t.makespan for t in choice.trials] == [6, 5, 6]  # ZB-H1's W overlaps
    broken = Program([["0B0", "0F0"], ["1F0", "1B0"]], 2, 1)
    choice = choose_schedule(2, Costs(), chunks=(1,), families={}, candidates=[broken, hand])
    assert "backward-after-forward" in choice.trials[0].error
    assert choice.best.program is hand


def test_a_schedule_built_from_costs_is_built_from_the_costs_it_is_tried_under():
    """ZB-V in the search is the order fastest under each candidate's costs, not the
    unit-step one that hand-off latency hurts."""
    from fpipe.schedules import zero_bubble_v

    batch = Costs(forward=16, backward=32, latency=0.5)
    choice = choose_schedule(8, batch, n_workers=4, chunks=(16,), remat=("never",),
                             families={"zero_bubble_v": FAMILIES["zero_bubble_v"]})
    (trial,) = choice.trials
    per_mb = batch.scaled(1 / 16)
    assert trial.schedule == zero_bubble_v(16, costs=per_mb)
    unit = simulate(zero_bubble_v(16).program(8), per_mb).makespan
    assert trial.makespan == simulate(trial.program, per_mb).makespan < unit


def test_costs_by_chunks_and_stage_count_price_each_candidate_as_it_runs():
    """``{(M, n_stages): costs}``: every trial is simulated under the costs of its own chunk
    count and stage count, and only the pairs given are tried."""
    by_pair = {(4, 2): Costs(forward=(1.0, 2.0), backward_input=(0.5, 3.0),
                             backward_weight=(2.0, 2.0), latency=0.25),
               (8, 2): Costs(forward=(0.5, 1.0), backward=(1.0, 2.5)),
               (4, 4): Costs(forward=(1.0, 0.25, 0.5, 0.75), backward=(0.5, 1.5, 1.5, 1.5),
                             backward_input=(0.1, 0.75, 0.75, 0.5), overhead=0.125)}
    choice = choose_schedule((2, 4), by_pair, n_workers=2, remat=("never",))
    tried = {(t.chunks, t.program.n_stages) for t in choice.trials if t.program is not None}
    assert tried == set(by_pair)
    for trial in choice.trials:
        if trial.program is not None:
            costs = by_pair[trial.chunks, trial.program.n_stages]
            assert trial.makespan == simulate(trial.program, costs).makespan
    assert choice.best.makespan == min(t.makespan for t in choice.trials)


def test_costs_by_pairs_must_price_every_stage_count():
    with pytest.raises(ValueError, match="prices no program of 4 stages"):
        choose_schedule((2, 4), {(4, 2): Costs()})
    with pytest.raises(TypeError, match="mixes chunk counts and"):
        choose_schedule(2, {(4, 2): Costs(), 8: Costs()})
