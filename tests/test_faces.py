"""Parity of the two faces: the scenarios of tests/faces_ranks.py run through
``fpipe.pipeline`` (two workers, in this process) and ``fpipe.distributed.pipeline`` (two
ranks) give equal results and raise the same errors for the same bad inputs."""

from __future__ import annotations

import pytest
import torch
from distributed_ranks import data, spawn
from faces_ranks import run
from models import block, mlp_params, mse

import fpipe
from fpipe.schedules import one_f_one_b

TIGHT = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def faces():
    def build(stages, params, **options):
        return fpipe.pipeline(stages, params, schedule=one_f_one_b(chunks=2), **options)

    local = run(build, lambda x, target: (x, target), list)
    results, codes = spawn("faces_ranks:faces", 2, timeout=120)
    for result in results:
        assert result is not None and "crash" not in result, result
    assert codes == [0, 0]
    return local, results


def test_equal_results(faces):
    local, ranks = faces
    for case in ("ok", "after", "grad_dtype", "hooked", "frozen later"):
        assert local[case][0] == "ok", (case, local[case])
        loss, grads = local[case][1]
        for rank, result in enumerate(ranks):
            assert result[case][0] == "ok", (case, rank, result[case])
            got_loss, got_grads = result[case][1]
            torch.testing.assert_close(got_loss, loss, **TIGHT)
            assert list(got_grads) == [rank]
            torch.testing.assert_close(got_grads[rank], grads[rank], **TIGHT)
    torch.testing.assert_close(ranks[1]["call"][1], local["call"][1], **TIGHT)
    assert ranks[0]["call"] == ("ok", None)


@pytest.mark.parametrize("case", ["small", "nonfinite", "inference mode", "no loss",
                                  "no stages", "forgotten tie"])
def test_the_same_error_on_every_rank(faces, case):
    """Errors every rank can see for itself: the same type and message as the local face."""
    local, ranks = faces
    assert local[case][0] == "error", local[case]
    for result in ranks:
        assert result[case] == local[case]


def test_wrong_parameter_structure_per_call(faces):
    local, ranks = faces
    assert local["structure"][:2] == ("error", "ValueError")
    assert ranks[0]["structure"] == local["structure"]  # stage 0, the first the local face checks
    assert ranks[1]["structure"][:2] == ("error", "ValueError")
    assert "params[1] has structure" in ranks[1]["structure"][2]


def test_errors_seen_on_one_rank(faces):
    """A target of the wrong size (given on the last stage's rank) raises the local face's
    BatchError on every rank, before any value is exchanged (the sizes travel in the step's
    header), and the pipeline runs on; a stage raising (on its rank) raises there as in the
    local face, and the other rank raises an error naming it."""
    local, ranks = faces
    assert local["target"][:2] == ("error", "BatchError")
    assert ranks[0]["target"] == ranks[1]["target"] == local["target"]
    for after in (local["target after"], ranks[0]["target after"], ranks[1]["target after"]):
        assert after[0] == "ok", after
        torch.testing.assert_close(after[1][0], local["target after"][1][0], rtol=0, atol=0)
    # No input on the rank of stage 0: every rank says so, and the pipeline runs on.
    assert ranks[0]["no input"] == ranks[1]["no input"] == (
        "error", "BatchError", "rank 0 holds stage 0, so it needs the input x")
    assert ranks[0]["no input after"][0] == ranks[1]["no input after"][0] == "ok"
    assert ranks[0]["raises"] == local["raises"] == ("error", "ValueError",
                                                      "sample 99 is cursed")
    assert ranks[1]["raises"][1] == "StageError"
    assert "sample 99 is cursed" in ranks[1]["raises"][2]


@pytest.mark.parametrize("case, holder", [("ragged input", 0), ("unbatched target", 1)])
def test_an_input_or_target_without_one_batch_size_stops_every_rank_alike(faces, case, holder):
    """Refused in the step's header: the rank holding it raises the local face's BatchError,
    the other rank a BatchError naming that rank, and the pipeline runs on."""
    local, ranks = faces
    assert local[case][:2] == ("error", "BatchError")
    assert ranks[holder][case] == local[case]
    other = ranks[1 - holder][case]
    assert other[:2] == ("error", "BatchError") and f"on rank {holder}" in other[2], other
    for result in (local, *ranks):
        assert result["bad batch after"][0] == "ok", result["bad batch after"]



def test_a_target_of_another_batch_on_the_rank_of_stage_0_is_refused_alike():
    """Stage 0's rank begins computing before the step's header is agreed, unless what it
    holds is wrong: here it also holds the last stage's target, of another batch than the
    input's. Every rank raises the same BatchError (not a micro-batching error of that rank's
    own), and the pipeline runs on with the plain loss."""
    results, codes = spawn("faces_ranks:v_target", 2, timeout=120)
    assert codes == [0, 0], results
    for name, n in (("one", 1), ("six", 6)):
        expected = ("error", "BatchError", f"the input has 8 samples but the target has {n}")
        assert results[0][name] == results[1][name] == expected, (name, results)
    x, target = data(8, 8, seed=41)
    params = mlp_params(4)
    y = x
    for p in params:
        y = block(p, y)
    assert results[0]["good"][0] == "ok" and results[1]["good"][0] == "ok"
    torch.testing.assert_close(results[0]["good"][1], mse(y, target), rtol=1e-12, atol=0)
    torch.testing.assert_close(results[1]["good"][1], mse(y, target), rtol=1e-12, atol=0)


def test_a_cut_models_hooks_and_late_freeze_apply_in_both_faces(faces):
    """The local face is compared with plain PyTorch in test_module_idioms.py; here both faces
    show the hook (masked entries' gradients zero) and the freeze (``None``) alike."""
    local, ranks = faces
    (_, hooked), (_, frozen) = local["hooked"][1], local["frozen later"][1]
    masked = torch.arange(64).reshape(8, 8) % 3 == 0
    assert torch.count_nonzero(hooked[0]["0.weight"][masked]) == 0
    assert torch.count_nonzero(hooked[0]["0.weight"][~masked]) == (~masked).sum()
    assert frozen[1] == {"1.1.weight": None, "1.1.bias": None}
    assert frozen[0]["0.weight"] is not None
    assert ranks[1]["frozen later"][1][1] == {1: {"1.1.weight": None, "1.1.bias": None}}
