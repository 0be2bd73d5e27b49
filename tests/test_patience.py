"""The tests' waits for their processes run on a load-scaled clock (tests/patience.py): a busy
machine lengthens them, a hang is still found, and the user's factor applies."""

import subprocess
import sys
import time

import patience
import pytest


def test_the_clock_runs_at_the_machines_fair_share(monkeypatch):
    monkeypatch.setattr(patience, "load", lambda: 4.0)  # four runnable tasks per core
    waited = patience.Patience(0.2)
    start = time.monotonic()
    while not waited.spent():
        time.sleep(0.05)
    assert time.monotonic() - start >= 0.8  # 0.2 s of a quarter of a core each


def test_the_scale_multiplies_every_limit_and_must_be_a_positive_number(monkeypatch):
    monkeypatch.setattr(patience, "load", lambda: 2.0)
    monkeypatch.setenv(patience.SCALE_ENV, "3")
    assert patience.limit(10) == 60 and patience.Patience(10).budget == 30
    for bad in ("0", "-1", "fast"):
        monkeypatch.setenv(patience.SCALE_ENV, bad)
        with pytest.raises(ValueError, match=f"{patience.SCALE_ENV}='{bad}': expected a positive"):
            patience.scale()


def test_run_returns_what_subprocess_run_would_and_stops_a_hang(monkeypatch):
    done = patience.run([sys.executable, "-c", "print('hi')"], 60, capture_output=True,
                        text=True)
    assert (done.returncode, done.stdout) == (0, "hi\n")
    with pytest.raises(subprocess.CalledProcessError):
        patience.run([sys.executable, "-c", "raise SystemExit(3)"], 60, check=True)
    monkeypatch.setattr(patience, "load", lambda: 1.0)
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        patience.run([sys.executable, "-c", "import time; time.sleep(60)"], 1)
    assert time.monotonic() - start < 30
