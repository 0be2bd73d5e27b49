"""fpipe.GPipe against torchgpipe in CPU instructions per training step, counted by valgrind.

    python benchmarks/instructions.py [--quick] [--json PATH] [--steps N]

``amoeba.py`` times the two faces on the AmoebaNet-shaped model (841 parameter tensors); on a
shared 2-core machine its pair ratios spread over +-8% and its medians move by more than the
faces differ. This counts instead: each face runs in a process of its own under valgrind's
callgrind, two warm-up steps uncounted, then ``--steps`` training steps counted (forward, sum,
backward; batch 32 in 4 chunks, 2 partitions, 1 intra-op thread), Python's garbage collector
collected first and off while counting (its collections come at different steps in the two
faces: ``gc_per_step`` counts them apart, in a plain run). A count is the same from run to run
to about 0.2%, where a step's time moves by 10%. It is not a time: a cache miss costs no
instruction. *by_library* splits each count by shared object: torch's kernels
(libtorch_cpu), the Python interpreter (libpython), the C library (malloc, free).

Without valgrind (or with ``--quick``, which CI runs) the rows say "not run" and only the
collector's counts are taken.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

import torch
from amoeba import amoeba_like
from common import parser, report

FACES = ("fpipe", "torchgpipe")


def build(face: str, units: int) -> torch.nn.Module:
    import fpipe
    cls = fpipe.GPipe
    if face == "torchgpipe":
        import torchgpipe
        cls = torchgpipe.GPipe
    torch.manual_seed(0)
    return cls(amoeba_like(16, units), [12, 12], devices=["cpu", "cpu"], chunks=4)


def child(face: str, steps: int, units: int) -> None:
    """Run under callgrind with instrumentation off: warm up, then count ``steps`` steps."""
    torch.set_num_threads(1)
    model, x = build(face, units), torch.randn(32, 3, 8, 8)
    for _ in range(2):
        model(x).sum().backward()
    gc.collect()
    gc.disable()
    _instrument("on")
    for _ in range(steps):
        model(x).sum().backward()
    _instrument("off")


def _instrument(state: str) -> None:
    """Turn callgrind's counting on or off in this process (``callgrind_control`` talks to
    the valgrind core, which hears it only while this process runs: so spin, not wait)."""
    control = subprocess.Popen(["callgrind_control", "-i", state, str(os.getpid())],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while control.poll() is None:
        sum(range(1000))


def counted(face: str, steps: int, units: int) -> tuple[int, Counter]:
    """Instructions per step of ``face``, in all and by shared object."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={out}", sys.executable, __file__, "--child", face,
                        "--steps", str(steps), "--units", str(units)],
                       check=True, capture_output=True, timeout=3600)
        total, libraries = annotated(out)
    return total // steps, Counter({k: v // steps for k, v in libraries.items()})


def annotated(out: str) -> tuple[int, Counter]:
    """A callgrind output's instructions, in all and by shared object."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", out],
                          check=True, capture_output=True, text=True).stdout
    total, libraries = 0, Counter()
    for line in text.splitlines():
        match = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*)", line)
        if not match:
            continue
        n = int(match.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in match.group(2):
            total = n
            continue
        library = re.search(r"\[([^\]]*)\]\s*$", match.group(2))
        libraries[_short(library.group(1)) if library else "other"] += n
    return total, libraries


def _short(path: str) -> str:
    name = os.path.basename(path)
    for known in ("libtorch_cpu", "libpython", "libc.so", "libtorch_python", "libc10"):
        if name.startswith(known):
            return known.replace(".so", "")
    return "other"


def collections_per_step(face: str, units: int, steps: int = 20) -> float:
    """Young and full collections of Python's garbage collector per step, in a plain run."""
    torch.set_num_threads(1)
    model, x = build(face, units), torch.randn(32, 3, 8, 8)
    for _ in range(2):
        model(x).sum().backward()
    seen = [0]

    def count(phase: str, info: dict) -> None:
        seen[0] += phase == "start"

    gc.callbacks.append(count)
    try:
        for _ in range(steps):
            model(x).sum().backward()
    finally:
        gc.callbacks.remove(count)
    return seen[0] / steps


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1, help="counted steps per face")
    p.add_argument("--child", choices=FACES, help=argparse.SUPPRESS)
    p.add_argument("--units", type=int, default=9, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.units)
        return
    units = 2 if args.quick else args.units
    valgrind = None if args.quick else shutil.which("valgrind")
    faces = [f for f in FACES if f == "fpipe" or _has("torchgpipe")]
    rows, counts = [], {}
    for face in faces:
        row: dict = {"face": face, "gc_per_step": round(collections_per_step(face, units), 2)}
        if valgrind is None:
            row["instructions_M"] = "not run"
        else:
            total, libraries = counts[face] = counted(face, args.steps, units)
            row["instructions_M"] = round(total / 1e6)
            for library in ("libtorch_cpu", "libpython", "libc", "other"):
                row[f"{library}_M"] = round(libraries[library] / 1e6)
        rows.append(row)
    if len(counts) == 2:
        rows[0]["vs_torchgpipe"] = round(counts["fpipe"][0] / counts["torchgpipe"][0], 3)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    tensors = len(list(amoeba_like(16, units).parameters()))
    report(f"fpipe.GPipe vs torchgpipe: CPU instructions per training step (callgrind), "
           f"24 layers of {tensors} parameter tensors, batch 32 in 4 chunks, 2 partitions",
           columns, rows, args.json,
           notes=["instructions_M: millions of instructions per step, every thread, Python's "
                  "collector off while counting (gc_per_step: its collections in a plain run); "
                  "*_M: by shared object"])


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
