"""Pipeline x FSDP2 on four gloo ranks (tests/fsdp_ranks.py runs them), in float64: a
GPT-like model with a tied embedding on a ("dp", "pp") = (2, 2) mesh, its stages sharded with
``fully_shard``, trained with 1F1B and interleaved 1F1B, AdamW and an LR scheduler, each
step's gradients accumulated over two calls, gives the plain module's losses and parameters;
its checkpoint, resumed on two ranks without FSDP and in the plain module, goes on as the
plain run does."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from distributed_ranks import spawn
from fsdp_ranks import CASES, DIRECTORY, MORE, STEPS, model, optimiser, plain, plain_steps

from fpipe import saving

TIGHT = dict(rtol=1e-10, atol=1e-10)
EXACT = dict(rtol=1e-12, atol=1e-12)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numpy") is None,
                                reason="DCP on several ranks needs numpy (the [saving] extra)")


def test_fsdp_pipeline_trains_accumulates_saves_and_resumes_as_the_plain_module(tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv(DIRECTORY, str(tmp_path))
    results, codes = spawn("fsdp_ranks:train_save_resume", 4, timeout=420)
    for result in results:
        assert result is not None and "crash" not in result, result
    assert codes == [0] * 4
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    losses, saved, *_ = plain(STEPS)
    more, resumed, *_ = plain(STEPS + MORE)
    for name in CASES:
        whole = {}
        for rank, result in enumerate(results):
            got = result[name]
            torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                       torch.tensor(losses, dtype=torch.float64), **TIGHT)
            whole.update(got["params"])
            # one reduce-scatter per held stage per step, none on the accumulating calls
            assert got["reduce_scatters"] == len(got["held"]) * STEPS, (name, rank)
            assert got["bytes"] < result[f"{name} replicated"]["bytes"], (name, rank)
        assert sorted(whole) == sorted(saved)  # the tie under both names
        for key, value in saved.items():
            torch.testing.assert_close(whole[key], value, **TIGHT, msg=f"{name} {key}")
    for rank, name in ((rank, name) for rank in range(4) for name in CASES):
        got = results[rank][f"{name} resumed"]  # on two ranks, no FSDP, no replicas
        torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                   torch.tensor(more[2 * STEPS:], dtype=torch.float64), **TIGHT)
        for key, value in got["params"].items():
            torch.testing.assert_close(value, resumed[key], **TIGHT, msg=f"{name} {key}")
    whole_long = {}  # the uninterrupted run's parameters, every rank's
    for result in results:
        whole_long.update(result["1f1b uninterrupted"]["params"])
    for rank, result in enumerate(results):  # resumed with FSDP2: from FSDP2, from replicas
        long = result["1f1b uninterrupted"]  # FSDP2, STEPS + MORE steps in one run
        torch.testing.assert_close(torch.tensor(long["losses"], dtype=torch.float64),
                                   torch.tensor(more, dtype=torch.float64), **TIGHT)
        torch.testing.assert_close(  # the replicated run that saved the plain checkpoint
            torch.tensor(result["1f1b plain"]["losses"], dtype=torch.float64),
            torch.tensor(losses, dtype=torch.float64), **TIGHT)
        long = {**long, "params": whole_long}
        other, same = (set(result[f"1f1b resumed{where}"]["params"])
                       for where in (" on another mesh", " sharded"))
        assert (other == same) == (rank in (0, 3))  # ranks 1 and 2 hold the other stage there
        for case, want in (("1f1b resumed sharded", long), ("1f1b plain resumed sharded", long),
                           ("1f1b resumed on another mesh", long),
                           ("interleaved resumed sharded", None)):
            got, close = result[case], EXACT if want else TIGHT
            assert got["sharded"], (case, rank)
            # Adam's moments land as the parameters are held: DTensors (the step stays plain)
            assert got["kinds"] == {("exp_avg", True), ("exp_avg_sq", True)}, (case, rank)
            torch.testing.assert_close(
                torch.tensor(got["losses"], dtype=torch.float64),
                torch.tensor(want["losses"][2 * STEPS:] if want else more[2 * STEPS:],
                             dtype=torch.float64), **close, msg=f"{case} rank {rank}")
            for key, value in got["params"].items():
                torch.testing.assert_close(value, want["params"][key] if want else resumed[key],
                                           **close, msg=f"{case} {key}")
    for name in CASES:  # the plain module
        torch.manual_seed(3)
        gpt = type(model())().double()
        optimizer, scheduler = optimiser(list(gpt.parameters()))
        saving.load_module(tmp_path / name, gpt, optimizer, extra={"scheduler": scheduler})
        got = plain_steps(gpt, optimizer, scheduler, range(STEPS, STEPS + MORE))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(more[2 * STEPS:]), **TIGHT)
        for key, value in gpt.state_dict().items():
            torch.testing.assert_close(value, resumed[key], **TIGHT, msg=f"{name} {key}")


def test_clipping_under_fsdp_by_the_whole_model_s_norm_a_tie_counted_once():
    """``pipe.clip_grad_norm`` of FSDP2-sharded gradients (DTensors) on a (2, 2) mesh, the
    embedding tied to the head across the pipeline's ranks: the norm and the clipped
    gradients of ``torch.nn.utils.clip_grad_norm_`` on the plain module (float64)."""
    from fsdp_ranks import MAX_NORM, plain_clipped
    results, codes = spawn("fsdp_ranks:clipped", 4, timeout=120)
    for result in results:
        assert result is not None and "crash" not in result, result
    assert codes == [0] * 4
    norm, grads = plain_clipped()
    assert norm > MAX_NORM  # so the gradients are scaled
    whole = {}
    for result in results:
        torch.testing.assert_close(result["norm"], norm, rtol=0, atol=1e-12)
        # the norm clipped to MAX_NORM * norm / (norm + eps), torch's rule (eps = 1e-6)
        torch.testing.assert_close(result["after"], MAX_NORM * norm / (norm + 1e-6),
                                   rtol=0, atol=1e-12)
        whole.update(result["grads"])
    assert sorted(whole) == sorted(grads)  # the tie under both names
    for name, grad in grads.items():
        torch.testing.assert_close(whole[name], grad, rtol=0, atol=1e-12, msg=name)
