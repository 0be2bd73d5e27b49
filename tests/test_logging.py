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
                         ("DEBUG", f"forward step on rank {rank}")]
        [(level, failed)] = [r for r in records if "failed" in r[1]]
        assert level == "WARNING" and failed.startswith(f"training step on rank {rank} failed")
        assert "BatchError: the input has 8 samples but the target has 3" in failed
