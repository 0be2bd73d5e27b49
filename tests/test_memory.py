"""Memory in bytes: per-worker peaks from a program's order, budgets, and a profiling call."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import block, mlp_params
from schedule_strategies import programs

from fpipe.schedules import (
    Memory,
    ScheduleError,
    check_memory,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    peak_bytes,
    simulate,
    zero_bubble,
)
from fpipe.timeline import stage_memory


@given(programs(), st.integers(1, 1000))
def test_bytes_follow_the_live_counts(program, size):
    """A pair to be recomputed holding nothing counts like ``peak_full_activations``; holding
    as much as a kept one, like ``peak_activations``."""
    sim = simulate(program)
    assert peak_bytes(program, Memory(activations=size)) == tuple(
        size * n for n in sim.peak_full_activations)
    assert peak_bytes(program, Memory(activations=size, inputs=size)) == tuple(
        size * n for n in sim.peak_activations)


@given(st.integers(1, 6), st.integers(1, 12))
def test_state_bytes_and_what_remat_frees(K, chunks):
    memory = Memory(activations=100, inputs=10, parameters=1000, optimizer=2000)
    never = peak_bytes(gpipe(chunks, "never").program(K), memory)
    always = peak_bytes(gpipe(chunks, "always").program(K), memory)
    assert never == (4000 + 100 * chunks,) * K  # parameters, gradients, optimiser, activations
    # remat keeps each micro-batch's input and one rebuilt micro-batch at a time
    assert always == (4000 + 10 * (chunks - 1) + 100,) * K
    assert simulate(one_f_one_b(chunks).program(K), memory=memory).peak_bytes == tuple(
        4000 + 100 * min(K - k, chunks) for k in range(K))


@given(st.integers(1, 6), st.integers(1, 12))
def test_a_backward_workspace_counts_while_it_runs(K, chunks):
    memory = Memory(activations=100, workspace=30)
    assert peak_bytes(one_f_one_b(chunks).program(K), memory) == tuple(
        100 * min(K - k, chunks) + 30 for k in range(K))
    assert peak_bytes(gpipe(chunks, "never").program(K), memory) == (100 * chunks + 30,) * K
    with pytest.raises(ScheduleError) as caught:
        check_memory(gpipe(chunks, "never").program(K), memory, budget=100 * chunks + 29)
    assert caught.value.action.op.name == "BACKWARD"


def test_model_memory_is_split_over_the_program_stages():
    model = Memory(activations=800, inputs=10, parameters=4000, per="model")
    program = interleaved_one_f_one_b(8, stages_per_worker=2).program(4)
    by_hand = Memory(activations=200, inputs=10, parameters=1000)
    assert peak_bytes(program, model) == peak_bytes(program, by_hand)


def test_a_program_is_checked_against_a_budget():
    program = zero_bubble(4).program(2)
    memory = Memory(activations=(100, 50), parameters=(1000, 1000))
    assert peak_bytes(program, memory) == (2000 + 200, 2000 + 100)
    assert check_memory(program, memory, budget=2200) is program
    with pytest.raises(ScheduleError, match="worker 0 needs 2,200 bytes at its peak") as \
            caught:
        check_memory(program, memory, budget=2199)
    assert caught.value.rule == "memory-budget" and caught.value.worker == 0
    assert str(caught.value.action) == "0F1"  # the second live micro-batch goes over
    with pytest.raises(ScheduleError, match="its stages' state alone is 10,000"):
        check_memory(program, Memory(parameters=5000), budget=9999)


@pytest.mark.parametrize("memory, message", [
    (dict(per="bytes"), "memory.per must be"),
    (dict(activations=(1, 2), per="model"), "single number with per=model"),
    (dict(inputs=-1), "must be a non-negative number"),
])
def test_bad_memory_refused(memory, message):
    with pytest.raises(ValueError, match=message):
        Memory(**memory)


def test_bad_memory_uses_refused():
    program = one_f_one_b(2).program(3)
    with pytest.raises(ValueError, match="memory.activations has 2 entries"):
        peak_bytes(program, Memory(activations=(1, 2)))
    with pytest.raises(TypeError, match="must be a Memory value"):
        peak_bytes(program, {"activations": 1})
    with pytest.raises(ValueError, match="budget must be"):
        check_memory(program, Memory(), budget=-1)
    assert Memory(activations=(2, 4), inputs=1, parameters=8).scaled(0.5) == Memory(
        activations=(1, 2), inputs=0.5, parameters=8)


def test_stage_memory_measures_what_the_graph_saves():
    """``tanh(x @ w + b)`` saves its input (for w's gradient) and its output (for tanh's): two
    micro-batch-sized tensors; a recomputed pair keeps the input only."""
    params = mlp_params(2, width=8, dtype=torch.float32)
    x = torch.randn(12, 8)[:4]  # a view: counted by its own elements
    memory = stage_memory([block, block], params, x, optimizer=2)
    per_tensor = 4 * 8 * 4
    assert memory.activations == (2 * per_tensor, 2 * per_tensor)
    assert memory.inputs == (per_tensor, per_tensor)
    assert memory.parameters == memory.gradients == ((8 * 8 + 8) * 4,) * 2
    assert memory.optimizer == (2 * (8 * 8 + 8) * 4,) * 2
