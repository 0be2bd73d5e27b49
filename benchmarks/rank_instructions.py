"""fpipe.distributed 1F1B against Schedule1F1B in CPU instructions per step and rank, counted
by valgrind.

    python benchmarks/rank_instructions.py [--quick] [--json PATH] [--batch 16] [--steps N]

``transformer_ranks.py`` times the two libraries on 2 ranks; at a small batch their pair
ratios spread over +-15% on a shared 2-core machine. This counts instead: the same model,
stages and batch (its ``fpipe_step`` and ``torch_step``), one library at a time, each rank a
process of its own under valgrind's callgrind (gloo on 127.0.0.1), three warm-up steps
uncounted, then ``--steps`` steps counted with Python's collector off. A rank waiting on the
other blocks in the kernel, which counts nothing, so a count is the rank's own work: the same
from run to run to about 0.3%. ``--quick`` (CI) runs one uncounted step of each library and
says "not run".
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from common import parser, report
from instructions import _instrument, annotated
from residual import TORCH_PIPELINING_MISSING

LIBRARIES = ("fpipe", "torch")
NAMES = {"fpipe": "fpipe.distributed one_f_one_b", "torch": "torch Schedule1F1B"}


def child(library: str, batch: int, steps: int, counted: bool) -> None:
    """One rank (``RANK`` in the environment): warm up, then run ``steps`` steps, counted
    where ``counted``."""
    import torch.distributed as dist
    from transformer_ranks import fpipe_step, torch_step

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    step = (fpipe_step if library == "fpipe" else torch_step)(rank, dist.group.WORLD, batch)
    for _ in range(3 if counted else 1):
        step()
        dist.barrier()
    gc.collect()
    gc.disable()
    if counted:
        _instrument("on")
    for _ in range(steps):
        step()
    if counted:
        _instrument("off")
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(library: str, batch: int, steps: int, port: int, valgrind: bool) -> list:
    """Both ranks of ``library``: instructions per step of each (``None`` uncounted)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for rank in (0, 1):
            out = os.path.join(tmp, f"rank{rank}.out")
            command = [sys.executable, __file__, "--child", library, "--batch", str(batch),
                       "--steps", str(steps)]
            if valgrind:
                command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                           f"--callgrind-out-file={out}", *command, "--counted"]
            env = {**os.environ, "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
            outs.append(out)
        errors = [p.communicate(timeout=3600)[1] for p in procs]
        for p, err in zip(procs, errors):
            if p.returncode != 0:
                raise RuntimeError(f"a {library} rank failed:\n{err[-3000:]}")
        if not valgrind:
            return [None, None]
        return [annotated(out)[0] // steps for out in outs]


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="counted steps per library")
    p.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    p.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.batch, args.steps, args.counted)
        return
    valgrind = not args.quick and shutil.which("valgrind") is not None
    steps = args.steps if valgrind else 1
    libraries = [lib for lib in LIBRARIES if lib == "fpipe" or not TORCH_PIPELINING_MISSING]
    counts = {lib: run_ranks(lib, args.batch, steps, 29600 + i, valgrind)
              for i, lib in enumerate(libraries)}
    rows = []
    for lib, ranks in counts.items():
        for rank, n in enumerate(ranks):
            row = {"row": NAMES[lib], "rank": rank, "batch": args.batch,
                   "instructions_M": "not run" if n is None else round(n / 1e6, 2)}
            other = counts.get("torch")
            if lib == "fpipe" and n is not None and other is not None:
                row["fpipe/torch"] = round(n / other[rank], 3)
            rows.append(row)
    report(f"fpipe.distributed 1F1B vs Schedule1F1B: CPU instructions per step and rank "
           f"(callgrind), transformer_ranks.py's model, batch {args.batch} in 4 micro-batches",
           list(dict.fromkeys(k for row in rows for k in row)), rows, args.json,
           notes=["instructions_M: millions of instructions per step on the rank, every thread "
                  "of its process, Python's collector off while counting"])


if __name__ == "__main__":
    main()
