"""``logging.getLogger("fpipe")``: silent by default; when configured, the pipeline built, each
step, a failed step and a step much slower than the recent ones."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from models import block, mlp_params, mse

import fpipe
from fpipe._runtime import log


def data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 8, generator=g, dtype=torch.float64),
            torch.randn(8, 8, generator=g, dtype=torch.float64))


def test_silent_by_default():
    """No logging configured: nothing reaches stderr, not even a failed step's warning
    record (Python warnings are silenced: torch warns without numpy, which is not logging)."""
    code = ("import torch, fpipe\n"
            "def boom(p, x):\n    raise ValueError('no')\n"
            "pipe = fpipe.pipeline([boom], [{}], schedule=fpipe.gpipe(chunks=1))\n"
            "try:\n    pipe(torch.ones(2, 2))\nexcept ValueError:\n    pass\n")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, check=True)
    assert done.stderr == ""


def test_what_is_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="fpipe")
    x, t = data()
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=fpipe.one_f_one_b(chunks=4),
                        loss_fn=mse) as pipe:
        pipe.value_and_grad(x, t)
        pipe(x)
        with pytest.raises(fpipe.BatchError):
            pipe(x[:2])  # refused before any step runs: nothing logged for it
    messages = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "fpipe"]
    assert messages[0][0] == "INFO" and "2 workers and 4 micro-batches" in messages[0][1]
    assert [level for level, m in messages if "step took" in m] == ["DEBUG", "DEBUG"]
    assert ("INFO", "started 1 worker threads") in messages  # the caller's thread is the other
    assert messages[-1] == ("INFO", "stopped 1 worker threads")


def test_a_failed_step_is_logged(caplog):
    def boom(p, x):
        raise KeyError("boom")

    with fpipe.pipeline([block, boom], mlp_params(2), schedule=fpipe.gpipe(chunks=2)) as pipe:
        with pytest.raises(KeyError):
            pipe(data()[0])
    [record] = [r for r in caplog.records if r.name == "fpipe" and r.levelname == "WARNING"]
    assert "forward step failed" in record.getMessage() and "KeyError" in record.getMessage()


def test_a_slow_step_is_logged(caplog, monkeypatch):
    """Durations come from a clock the test drives: five 10 ms steps, then one of 50 ms."""
    clock = iter([0.0, 0.01] * 5 + [0.0, 0.05])
    monkeypatch.setattr(log.time, "perf_counter", lambda: next(clock))
    times = log.StepTimes()
    for _ in range(6):
        with times.step("training step"):
            pass
    [record] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "training step took 50.0 ms, 5.0x the median" in record.getMessage()


def test_a_distributed_pipeline_logs_as_the_local_one():
    from distributed_ranks import spawn

    results, codes = spawn("logged", 2)
    assert codes == [0, 0], results
    for rank, result in enumerate(results):
        records = result["records"]
        assert records[0][0] == "INFO"
        assert records[0][1].startswith(f"DistributedPipeline(rank {rank}, worker {rank} of 2")
        steps = [(level, m.split(" took")[0]) for level, m in records if " took " in m]
        assert steps == [("DEBUG", f"training step on rank {rank}"),
                         ("DEBUG", f"forward step on rank {rank}"),
                         ("DEBUG", f"training step on rank {rank}")]
        [(level, failed)] = [r for r in records if "failed" in r[1]]
        assert level == "WARNING" and failed.startswith(f"training step on rank {rank} failed")
        assert "BatchError: the input has 8 samples but the target has 3" in failed
        trained, forward, after_failure, recorded = result["figures"]
        what, seconds, samples, per_second, tokens, bubble = trained
        assert (what, samples, bubble) == (f"training step on rank {rank}", 8, None)
        assert per_second == samples / seconds
        assert tokens == (64 if rank == 1 else None)  # given on rank 1; rank 0's x is float
        assert forward[2] == 8 and 0 <= forward[5] < 1  # this rank's worker's bubble
        assert after_failure == forward  # a failed step leaves the last figures
        timeline = result["timeline"]  # this rank's worker's spans, the other's none
        assert [bool(spans) for spans in timeline] == [w == rank for w in (0, 1)]
        mine = timeline[rank]
        busy = sum(span.end - span.start for span in mine)
        assert recorded[5] == 1.0 - busy / max(span.end for span in mine)


def test_each_step_s_figures_are_consistent_and_logged(caplog):
    """pipe.last_step: the batch's samples, samples/s = samples / seconds, the tokens of an
    integer input of token ids (or the count given), no bubble unless asked; the figures'
    line at the step_log's level."""
    caplog.set_level(logging.DEBUG, logger="fpipe")
    x, t = data()
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=fpipe.gpipe(chunks=2),
                        loss_fn=mse) as pipe:
        assert pipe.last_step is None
        pipe.value_and_grad(x, t)
        step = pipe.last_step
        assert (step.what, step.samples, step.tokens, step.bubble) == ("training step", 8,
                                                                       None, None)
        assert step.seconds > 0 and step.samples_per_second == 8 / step.seconds
        assert step.peak_memory == {}  # the CPU's is not measured
        pipe(x, tokens=96)
        assert pipe.last_step.what == "forward step"
        assert pipe.last_step.tokens_per_second == 96 / pipe.last_step.seconds
        pipe.step_log = fpipe.StepLog(level=logging.INFO)
        pipe(x)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if " took " in r.getMessage()]
    assert [level for level, _ in lines] == ["DEBUG", "DEBUG", "INFO"]
    assert lines[0][1] == str(step) and ", 8 samples (" in lines[0][1]
    assert "96 tokens" in lines[1][1]

    embed = {"e": torch.randn(10, 8, dtype=torch.float64)}
    ids = torch.randint(0, 10, (8, 5))
    with fpipe.pipeline([lambda p, i: p["e"][i].sum(1), block], [embed, mlp_params(2)[1]],
                        schedule=fpipe.gpipe(chunks=2)) as pipe:
        pipe(ids)
        assert (pipe.last_step.samples, pipe.last_step.tokens) == (8, 40)  # 8 x 5 token ids
        with pytest.raises(ValueError, match="tokens= must be a count"):
            pipe(ids, tokens=-1)


def test_the_bubble_is_measured_from_the_step_s_timeline():
    """Idle over total on the workers: in [0, 1), larger for GPipe with 1 micro-batch (only
    one of the 4 workers busy at a time) than with 8."""
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(128, 128, generator=g, dtype=torch.float64) * 0.1,
               "b": torch.zeros(128, dtype=torch.float64)} for _ in range(4)]
    x = torch.randn(64, 128, generator=g, dtype=torch.float64)
    bubbles = {}
    for chunks in (1, 8):
        with fpipe.pipeline([block] * 4, params, schedule=fpipe.gpipe(chunks=chunks),
                            loss_fn=mse) as pipe:
            pipe.step_log = fpipe.StepLog(bubble=True)
            pipe.value_and_grad(x, x)
            bubbles[chunks] = pipe.last_step.bubble
            recorder = fpipe.Recorder()
            pipe.step_log = fpipe.StepLog()
            pipe.value_and_grad(x, x, record=recorder)  # a recorded step has its bubble anyway
            assert pipe.last_step.bubble == fpipe.timeline.bubble(recorder.timeline)
    assert all(0 <= b < 1 for b in bubbles.values()), bubbles
    assert bubbles[1] > bubbles[8], bubbles
