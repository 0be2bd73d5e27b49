"""Each benchmark's quick mode still runs and writes well-formed JSON (no timing is checked),
and a rank that fails ends a run of spawned ranks at once, with its own error."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", [
    "dispatch_overhead.py", "simulated_vs_measured.py", "memory.py", "split_backward.py",
    "resnet101.py", "search.py", "amoeba.py",
    # [bench]: without numpy, torch.distributed.pipelining's rows are marked not run.
    pytest.param("cpu_scaling.py", marks=pytest.mark.needs_extra)])
def test_quick_mode_writes_json(script, tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", "--json", str(out)],
                         timeout=300, capture_output=True, text=True, cwd=BENCHMARKS)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["rows"] and result["machine"]["torch"]
    assert all(isinstance(row, dict) and row for row in result["rows"])
    if script == "cpu_scaling.py":  # every driver has its rows, failed or not
        drivers = {row["driver"] for row in result["rows"]}
        assert {"naive-1", "fpipe local", "fpipe distributed", "torch pipelining"} <= drivers
        ran = "ok" if importlib.util.find_spec("numpy") else "not run"
        assert {row["check"] for row in result["rows"]
                if row["driver"] == "torch pipelining"} == {ran}
    if script == "memory.py":  # the second table: the largest model in a budget
        (budget,) = result["tables"].values()
        assert budget and all(row["layers"] > 0 for row in budget)


def _fail_on_rank_1(rank, world, how):
    """Rank 1 fails; rank 0 waits for a message from it that never comes."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        if how == "raises":
            raise ValueError("rank 1 broke")
        os._exit(3)
    dist.recv(torch.empty(1), src=1)  # would wait out the group's timeout (120 s)


@pytest.mark.parametrize("how", ["raises", "exits"])
def test_a_failing_rank_stops_the_others_at_once(how, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import RankFailed, spawn_ranks

    start = time.monotonic()
    said = "ValueError: rank 1 broke" if how == "raises" else "rank 1 exited with code 3"
    with pytest.raises(RankFailed, match=f"rank 1 of 2 failed(.|\n)*{said}"):
        spawn_ranks(_fail_on_rank_1, 2, how, timeout=300, strict=True)
    assert time.monotonic() - start < 60
