"""Actions and programs: plain values that print, parse, compare and hash."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpipe.schedules import Action, Op, Program

actions = st.builds(Action, st.integers(0, 50), st.sampled_from(Op), st.integers(0, 200))
worker_lists = st.lists(st.lists(actions, max_size=12), min_size=1, max_size=5)


@given(actions)
def test_action_print_parse_roundtrip(action):
    assert Action.parse(str(action)) == action
    assert hash(Action.parse(str(action))) == hash(action)


def test_op_shortcuts_are_exported():
    import fpipe.schedules as schedules

    shortcuts = {name: getattr(schedules, name) for name in "FRBIW"}
    assert shortcuts == {op.value: op for op in Op}
    assert set("FRBIW") <= set(schedules.__all__)
    assert str(Action(2, shortcuts["I"], 3)) == "2I3"


def test_action_spelling():
    assert str(Action(2, Op.FORWARD, 0)) == "2F0"
    assert Action.parse(" 12W3 ") == Action(12, Op.BACKWARD_WEIGHT, 3)
    assert repr(Action(1, Op.RECOMPUTE, 4)) == "Action(1R4)"


@pytest.mark.parametrize("text", ["", "F0", "0X0", "0F", "-1F0", "0F0 1F0"])
def test_action_parse_rejects(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


@given(worker_lists)
def test_program_print_parse_roundtrip(workers):
    program = Program.from_actions(workers)
    assert Program.parse(str(program), program.n_stages, program.n_microbatches) == program
    assert Program.parse(str(program)) == program


@given(worker_lists)
def test_program_is_a_hashable_value(workers):
    one = Program.from_actions(workers)
    two = Program.from_actions([[str(a) for a in w] for w in workers])
    assert one == two and hash(one) == hash(two)
    assert len({one, two}) == 1


def test_program_counts_and_placement():
    program = Program([["0F0", "1F0"], [], ["2F0"]], n_stages=4, n_microbatches=2)
    assert program.n_workers == 3
    assert program.placement == (0, 0, 2, None)
    assert program.program(4) is program
    with pytest.raises(ValueError, match="4 stages but the pipeline has 3"):
        program.program(3)


def test_forward_only_keeps_forwards_in_order():
    program = Program([["0F0", "0F1", "0R0", "0B0", "0I1", "0W1"]], 1, 2)
    assert program.forward_only() == Program([["0F0", "0F1"]], 1, 2)


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "2"])
def test_program_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="n_stages must be a positive integer"):
        Program([["0F0"]], bad, 1)
    with pytest.raises(ValueError, match="n_microbatches must be a positive integer"):
        Program([["0F0"]], 1, bad)


def test_program_parse_rejects_misnumbered_lines():
    with pytest.raises(ValueError, match="should start with 'worker 1:'"):
        Program.parse("worker 0: 0F0\nworker 2: 1F0")


def test_a_pickled_program_hashes_as_one_built_in_another_process(tmp_path):
    """A program computes its hash once; an op's hash (its name's) differs between processes,
    so the cached hash must not travel: unpickled under another hash seed, the program is found
    as a dict key by an equal program built there."""
    import pickle
    import subprocess
    import sys

    program = Program([["0F0", "0B0"], ["1F0", "1B0"]], 2, 1)
    hash(program)
    (tmp_path / "p.pkl").write_bytes(pickle.dumps(program))
    code = ("import pickle, sys; from fpipe.schedules import Program; "
            "loaded = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "fresh = Program([['0F0', '0B0'], ['1F0', '1B0']], 2, 1); "
            "print({fresh: 'found'}.get(loaded), hash(loaded) == hash(fresh))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.pkl")],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.split() == ["found", "True"], out
