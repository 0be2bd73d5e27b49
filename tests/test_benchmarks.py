"""Each benchmark's quick mode still runs and writes well-formed JSON (no timing is checked),
and a rank that fails ends a run of spawned ranks at once, with its own error."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import patience
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", [
    "dispatch_overhead.py", "simulated_vs_measured.py", "memory.py", "split_backward.py",
    "resnet101.py", "search.py", "gpu.py", "amoeba.py", "instructions.py",
    # [bench]: without numpy, torch.distributed.pipelining's rows are marked not run.
    pytest.param("cpu_scaling.py", marks=pytest.mark.needs_extra),
    pytest.param("transformer_ranks.py", marks=pytest.mark.needs_extra),
    pytest.param("rank_host.py", marks=pytest.mark.needs_extra),
    pytest.param("rank_instructions.py", marks=pytest.mark.needs_extra)])
def test_quick_mode_writes_json(script, tmp_path):
    out = tmp_path / "result.json"
    run = patience.run([sys.executable, str(BENCHMARKS / script), "--quick", "--json", str(out)],
                       300, capture_output=True, text=True, cwd=BENCHMARKS)
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
    if script == "transformer_ranks.py":  # both libraries at both batches, the same loss
        rows = {(row["batch"], row["row"]): row["check"] for row in result["rows"]}
        ran = "ok" if importlib.util.find_spec("numpy") else "not run"
        assert rows[(16, "torch Schedule1F1B")] == rows[(256, "torch Schedule1F1B")] == ran
    if script == "rank_host.py":  # both libraries on both ranks, fpipe's phases
        rows = {(row["row"], row["rank"]): row for row in result["rows"]}
        fpipe_rows = [rows[("fpipe.distributed one_f_one_b", rank)] for rank in (0, 1)]
        assert all(isinstance(row["host_us"], int) and row["actions"] > 0 for row in fpipe_rows)
        if importlib.util.find_spec("numpy"):
            assert {("torch Schedule1F1B", 0), ("torch Schedule1F1B", 1)} <= set(rows)
    if script == "rank_instructions.py":  # both ranks of each library
        rows = {(row["row"], row["rank"]) for row in result["rows"]}
        names = ["fpipe.distributed one_f_one_b"] + \
            (["torch Schedule1F1B"] if importlib.util.find_spec("numpy") else [])
        assert rows == {(name, rank) for name in names for rank in (0, 1)}
    if script == "gpu.py":  # every model has the rows (and torchgpipe's, if installed)
        rows = {(row["model"], row["row"]) for row in result["rows"]}
        faces = {"plain whole batch", "plain micro-batch loop", "fpipe.GPipe"}
        pipelines = {"fpipe.pipeline 1F1B"} | {f"fpipe.pipeline gpipe {p}"
                                               for p in ("always", "except_last", "never")}
        assert {(m, r) for m in ("transformer", "resnet", "mlp") for r in faces} <= rows
        assert {(m, r) for m in ("transformer", "mlp") for r in pipelines} <= rows
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


def _abort_in_teardown(rank, world):
    """Sends its result, then would abort in the interpreter's teardown, as a gloo worker
    thread still releasing a collective's tensors then does (rc -6, "terminate called without
    an active exception")."""
    import atexit

    atexit.register(os.abort)
    return {"rank": rank}


def test_a_rank_that_sent_its_result_ends_without_the_teardown(monkeypatch):
    """A rank's work is done once its result is sent: it exits at once, so nothing that the
    interpreter's teardown could trip over aborts it; and in a strict run a rank that sent its
    result but then exited badly is reported, not passed over."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import spawn_ranks

    assert spawn_ranks(_abort_in_teardown, 2, timeout=300, strict=True) == [
        {"rank": 0}, {"rank": 1}]


def test_spawned_ranks_are_timed_on_the_machines_fair_share(monkeypatch):
    """On a machine loaded 4 times over, a second of the ranks' clock takes 4 wall seconds,
    so a quick run's limit does not kill healthy ranks that merely wait for a core."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import common

    monkeypatch.setattr(common.os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    monkeypatch.setattr(common.os, "cpu_count", lambda: 2)
    clock = common.LoadClock()
    clock.last -= 4.0  # four wall-clock seconds ago
    assert 0.99 <= clock.now() <= 1.1
