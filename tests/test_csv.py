"""CSV in torch.distributed.pipelining's layout: round trips, both spellings, torch's extras."""

import io
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_strategies import programs

from fpipe.schedules import (
    Action,
    Op,
    Program,
    from_csv,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    to_csv,
    validate,
    zero_bubble,
    zero_bubble_v,
)

actions = st.builds(Action, st.integers(0, 20), st.sampled_from(Op), st.integers(0, 30))


@given(programs())
def test_round_trip(program):
    text = to_csv(program)
    assert from_csv(text) == program
    assert len(text.splitlines()) == program.n_workers


@given(st.lists(st.lists(actions, max_size=8), min_size=1, max_size=4))
def test_round_trip_of_any_actions(workers):
    # Invalid programs too, given the spelling: "auto" would read a W without an I as old.
    program = Program.from_actions(workers)
    again = from_csv(to_csv(program), program.n_stages, program.n_microbatches, spelling="new")
    assert again == program


def test_layout():
    program = Program([["0F0", "0F1", "0I0", "0W0", "0R1", "0B1"], [], ["1F0"]], 2, 2)
    assert to_csv(program) == "0F0,0F1,0I0,0W0,0R1,0B1\n\n1F0\n"


# Two ranks, four stages (0 and 2 on rank 0, 1 and 3 on rank 1), two micro-batches, stages 2
# and 3 with a split backward; as torch writes a lowered schedule, with communication,
# resharding, a fused forward and backward, and idle steps.
NEW = """\
0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,,2RECV_F0,2F0,2SEND_F0,2RECV_F1,2F1,2SEND_F1,2RECV_B0,2I0,\
2SEND_B0,2RECV_B1,2I1,2SEND_B1,2W0,2W1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD,0RESHARD
1RECV_F0,1F0,1SEND_F0,3RECV_F0,3F0,1RECV_F1,(1F1;3I0)OVERLAP_F_B,1SEND_F1,3SEND_B0,\
3RECV_F1,3F1,3I1,3SEND_B1,3W0,3W1,,1RECV_B0,1B0,1SEND_B0,1RECV_B1,1B1,1SEND_B1
"""
OLD = re.sub(r"(\d)I(\d)", r"\1B\2", re.sub(r"(\d)B(\d)", r"\1BW\2", NEW))
EXPECTED = Program([
    ["0F0", "0F1", "2F0", "2F1", "2I0", "2I1", "2W0", "2W1", "0B0", "0B1"],
    ["1F0", "3F0", "(1F1;3I0)OVERLAP_F_B", "3F1", "3I1", "3W0", "3W1", "1B0", "1B1"],
], 4, 2)


@pytest.mark.parametrize("text, spelling", [
    (NEW, "auto"), (NEW, "new"), (OLD, "auto"), (OLD, "old"),
])
def test_torch_schedules_in_both_spellings(text, spelling):
    program = from_csv(text, spelling=spelling)
    assert program == EXPECTED
    validate(program)


def test_old_spelling_as_torch_wrote_it():
    assert "1BW0" in OLD and "2B0" in OLD and "(1F1;3B0)OVERLAP_F_B" in OLD
    assert not re.search(r"\dI\d", OLD)
    assert from_csv("0F0,0B0,0W0") == Program([["0F0", "0I0", "0W0"]], 1, 1)  # W, no I: old
    assert from_csv("0F0,0BW0") == Program([["0F0", "0B0"]], 1, 1)
    assert from_csv("0F0,0B0") == Program([["0F0", "0B0"]], 1, 1)  # no W, no BW: new
    # Forced, the new spelling reads B as a full backward (an invalid program here).
    assert from_csv("0F0,0B0,0W0", spelling="new") == Program([["0F0", "0B0", "0W0"]], 1, 1)


def test_recompute_and_counts():
    text = to_csv(Program([["0F0", "0R0", "0B0"]], 1, 1))
    assert "0R0" in text and from_csv(text).workers[0][1] == Action(0, Op.RECOMPUTE, 0)
    program = from_csv("0F0,0B0", n_stages=2, n_microbatches=3)
    assert (program.n_stages, program.n_microbatches) == (2, 3)


def test_files(tmp_path):
    path = tmp_path / "schedule.csv"
    program = Program([["0F0", "0B0"], ["1F0", "1B0"]], 2, 1)
    assert to_csv(program, path) == path.read_text()
    assert from_csv(path) == from_csv(str(path)) == program
    path.write_text("\ufeff" + NEW, encoding="utf-8")  # a byte-order mark, as Excel writes
    assert from_csv(path) == EXPECTED
    path.write_bytes(NEW.replace("\n", "\r\n").encode())  # csv.writer's line ends, as torch's
    assert from_csv(path) == EXPECTED
    with pytest.raises(FileNotFoundError):
        from_csv(str(tmp_path / "missing.csv"))


@pytest.mark.parametrize("text, spelling, message", [
    ("0F0,0X0", "auto", r"cannot read '0X0' at row 1 \(worker 0\), cell 2"),
    ("0F0\n1F0,,F1", "auto", r"cannot read 'F1' at row 2 \(worker 1\), cell 3"),
    ("0F0,0F", "auto", r"'0F' at row 1 \(worker 0\), cell 2: a compute action needs a micro"),
    ("0F0,1F0 0F1", "auto", "cannot read '1F0 0F1'"),
    ("0F0,0BW0\n1I0", "auto", r"mixes the two spellings.*'0BW0' at row 1.*'1I0' at row 2"),
    ("0F0,0I0", "old", r"'0I0' at row 1 \(worker 0\), cell 2 is not in the old spelling"),
    ("0F0,0BW0", "new", "'0BW0' at row 1 .* is not in the new spelling"),
    ("0F0", "newest", "spelling must be one of 'auto', 'new', 'old'"),
    # one mistyped index among two micro-batches: named, not "0F2 is missing"
    ("0F0,0F1,0B1,0B0\n1F0,1F2,1B1,1B0", "auto",
     r"'1F2' at row 2 \(worker 1\), cell 2 is out of range: micro-batches are numbered 0 to 1"),
])
def test_errors_name_row_and_cell(text, spelling, message):
    with pytest.raises(ValueError, match=message):
        from_csv(text, spelling=spelling)


def test_indices_beyond_given_counts_are_named():
    with pytest.raises(ValueError, match=r"'0B3' at row 1 .* out of range: .* 0 to 2 "
                                         r"\(n_microbatches=3\)"):
        from_csv("0F0,0B3", n_microbatches=3)
    with pytest.raises(ValueError, match=r"'2F0' at row 2 .* stages are numbered 0 to 1"):
        from_csv("0F0\n2F0", n_stages=2)
    with pytest.raises(ValueError, match="n_microbatches must be a positive integer"):
        from_csv("0F0", n_microbatches=0)


def torch_lowered_csv(program):
    """``program`` lowered by torch's own passes (FSDP unshard/reshard, the gradient
    reduction, sends and receives: what ``_PipelineScheduleRuntime`` runs and its
    ``_dump_csv`` writes), written row by row as ``_dump_csv`` writes it."""
    import csv as csv_module

    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_reduce_grad,
        _add_send_recv,
        _add_unshard_reshard,
    )

    placement = program.placement
    lowered = {rank: _add_reduce_grad(_add_unshard_reshard(
        [_Action.from_str(str(a)) for a in actions]), program.n_microbatches)
        for rank, actions in enumerate(program.workers)}
    lowered = _add_send_recv(lowered, stage_to_rank=lambda s: placement[s],
                             num_stages=program.n_stages)
    buffer = io.StringIO()
    writer = csv_module.writer(buffer)
    for rank in lowered:
        writer.writerow(lowered[rank])
    return buffer.getvalue()


@pytest.mark.parametrize("schedule, n_stages", [
    (gpipe(4, "never"), 3), (one_f_one_b(4), 3), (zero_bubble(5), 2), (zero_bubble_v(4), 4),
    (interleaved_one_f_one_b(4, 2), 4)])
def test_what_torch_writes_after_lowering_reads_back(schedule, n_stages):
    program = schedule.program(n_stages)
    text = torch_lowered_csv(program)
    assert "REDUCE_GRAD" in text and "SEND_F" in text and "RECV_B" in text
    assert "UNSHARD" in text and "RESHARD" in text
    assert from_csv(text, spelling="new") == program
