"""Shared by the benchmarks: timing, the machine's description, the table and the JSON file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a run of well under a minute")
    p.add_argument("--json", metavar="PATH", help="write the results here as JSON")
    return p


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def seconds_per_call(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """The median wall time of ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def report(title: str, columns: list[str], rows: list[dict], path: str | None) -> None:
    info = machine()
    print(f"{title}\n{info['command']}\ntorch {info['torch']}, {info['cpus']} CPUs "
          f"({info['processor']}), cuda: {info['cuda']}")
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(w) for c, w in zip(columns, widths)))
    if path:
        with open(path, "w") as f:
            json.dump({"title": title, "machine": info, "rows": rows}, f, indent=2)


def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
