"""The example scripts run, and their losses go down."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script, args", [("train_mlp.py", ["--steps", "40"]),
                                          ("unet_skips.py", ["--steps", "15"]),
                                          ("custom_schedule.py", ["--steps", "30"])])
def test_example_learns(script, args):
    run = subprocess.run([sys.executable, str(EXAMPLES / script), *args], check=True,
                         timeout=300, capture_output=True, text=True)
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", run.stdout).groups())
    assert last < 0.8 * first
