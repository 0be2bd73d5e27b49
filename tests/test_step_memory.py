"""A training step's peak memory on the CPU, against torchgpipe's on the same model, balance
and chunks (remat ``except_last``, torchgpipe's default).

Measured as the process's peak resident memory during the step above what was resident before
it: the kernel's high-water mark (``VmHWM``), reset before each step, sees every thread's
allocations (torchgpipe's and fpipe's workers compute on threads of their own). Tensors from
64 KiB up are given their own pages by the C allocator (``mallopt``), so freeing one returns it
at once and the mark follows live tensor bytes, to within the small allocations' noise (well
under a megabyte here, against several megabytes per micro-batch's activations).
"""

from __future__ import annotations

import copy
import ctypes
import gc
from pathlib import Path

import pytest
import torch
from torch import nn

import fpipe
from fpipe.schedules import gpipe
from fpipe.stages import from_sequential

torchgpipe = pytest.importorskip("torchgpipe")
_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")
pytestmark = [pytest.mark.needs_extra,  # torchgpipe: the [compat] extra
              pytest.mark.skipif(not _CLEAR.exists(), reason="needs Linux's /proc peak counters")]

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
BALANCE, CHUNKS, WIDTH = [2, 2, 2, 2], 4, 128


def _resident(field: str) -> int:
    line = next(line for line in _STATUS.read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def peak_bytes(step) -> int:
    """The peak resident bytes ``step()`` added to what was resident before it."""
    gc.collect()
    _CLEAR.write_text("5")  # the high-water mark starts again from what is resident now
    before = _resident("VmRSS")
    step()
    return _resident("VmHWM") - before


def _module_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor):
    def step() -> None:
        model.zero_grad(set_to_none=True)  # gradients cleared before the baseline
        nn.functional.mse_loss(model(x), target).backward()
        model.zero_grad(set_to_none=True)
    return step


def test_a_steps_peak_is_at_most_torchgpipes():
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0,
                                                       batch_first=True) for _ in range(8)))
    x, target = torch.randn(32, 64, WIDTH), torch.randn(32, 64, WIDTH)
    cut = from_sequential(model, BALANCE, stateful=False)
    cpus = ["cpu"] * len(BALANCE)
    with fpipe.pipeline(cut.stages, cut.params, schedule=gpipe(CHUNKS),
                        loss_fn=nn.functional.mse_loss) as pipe:
        steps = {
            "torchgpipe": _module_step(torchgpipe.GPipe(
                copy.deepcopy(model), BALANCE, devices=cpus, chunks=CHUNKS), x, target),
            "fpipe.GPipe": _module_step(fpipe.GPipe(
                copy.deepcopy(model), BALANCE, devices=cpus, chunks=CHUNKS), x, target),
            "fpipe.pipeline": lambda: pipe.value_and_grad(x, target),
        }
        try:
            peaks = {name: [] for name in steps}
            for _ in range(3):  # the first round warms up (threads, pipelines built)
                for name, step in steps.items():  # interleaved
                    peaks[name].append(peak_bytes(step))
        finally:
            torch.set_num_threads(threads)
    least = {name: min(values[1:]) / 2**20 for name, values in peaks.items()}
    theirs = least.pop("torchgpipe")
    for name, ours in least.items():
        assert ours <= theirs, f"{name} peaked at {ours:.1f} MiB, torchgpipe at {theirs:.1f}"
