#!/usr/bin/env bash
# The CUDA tests (tests/test_cuda.py: stages sharing cuda:0 on several workers, mixed CPU/CUDA
# pipelines, sleeping stages) under PyTorch's CUDA stream sanitizer, which fails a kernel that
# touches a tensor another stream used without an event between them. Needs a GPU.
#
# TORCH_CUDA_SANITIZER=1 installs the sanitizer's dispatch mode in the importing thread only;
# fpipe's workers must push it themselves (when torch.cuda._sanitizer.cuda_sanitizer.enabled,
# each worker pushes cuda_sanitizer.dispatch around its job). So besides the tests, this checks
# that the sanitizer is live (a deliberate race must be caught) and that it saw kernels launched
# by fpipe's worker threads; without them a clean run proves nothing about the workers.
#
# The sanitizer checks every kernel in Python, so the whole file runs for minutes (over 200 s
# on an H100). By default a representative subset runs, in well under 2 minutes: each
# mechanism once (the whole-batch numbers across CPU/CUDA, the dropout recompute, sleepy stages
# on three workers of one GPU, the split backward with bfloat16 on mixed devices, hand-offs
# between workers of one GPU, a side stream, autocast, stages sharing a GPU's worker).
# CUDA_SANITIZER_FULL=1 runs every CUDA test instead. Each test's name is printed as it
# starts, and the run is bounded by CUDA_SANITIZER_TIMEOUT seconds (default 110; 900 for the
# full run), so a hang ends with the name of the test that hung.
#
# Usage: scripts/cuda_sanitizer.sh [pytest args...]; the log goes to build/cuda_sanitizer.log
# (or $CUDA_SANITIZER_LOG). Exit status: non-zero on a test failure, a missed race, no worker
# kernels seen, or the time limit (124).
set -euo pipefail
cd "$(dirname "$0")/.."
log="${CUDA_SANITIZER_LOG:-build/cuda_sanitizer.log}"
timeout 60 python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
mkdir -p "$(dirname "$log")"
: > "$log"
if [[ "${CUDA_SANITIZER_FULL:-0}" == 1 ]]; then
  limit="${CUDA_SANITIZER_TIMEOUT:-900}"
  tests=(tests/test_cuda.py tests/test_gpu_workers.py)
else
  limit="${CUDA_SANITIZER_TIMEOUT:-110}"
  tests=(
    "tests/test_cuda.py::test_matches_whole_batch_on_cuda[schedule0-devices1]"
    tests/test_cuda.py::test_dropout_on_cuda_recompute_matches
    "tests/test_cuda.py::test_sleepy_stages_match_the_reference[gpipe-devices0-dtype0]"
    "tests/test_cuda.py::test_sleepy_stages_match_the_reference[zero-bubble-devices1-dtype1]"
    "tests/test_cuda.py::test_hand_offs_on_one_gpu[colocated]"
    tests/test_cuda.py::test_a_step_run_under_a_side_stream
    tests/test_cuda.py::test_the_callers_autocast_reaches_the_stages
    tests/test_gpu_workers.py::test_stages_on_one_gpu_share_a_worker_unless_a_program_says_otherwise
  )
fi
echo "the sanitizer on ${#tests[@]} test paths, at most ${limit} s" | tee -a "$log"
PYTHONUNBUFFERED=1 TORCH_CUDA_SANITIZER=1 timeout -k 10 "$limit" \
  python - "${tests[@]}" -- "$@" <<'PY' 2>&1 | tee -a "$log"
import collections
import sys
import threading
import time

import pytest
import torch
from torch.cuda import _sanitizer

sanitizer = _sanitizer.cuda_sanitizer
assert sanitizer.enabled, "TORCH_CUDA_SANITIZER=1 did not enable the sanitizer"
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")

# The canary: an unsynchronised read on a side stream must be caught, else nothing below means
# anything.
a = torch.ones(1 << 20, device="cuda")
try:
    with torch.cuda.stream(torch.cuda.Stream()):
        a.mul(2)
    sys.exit("canary: the sanitizer missed a deliberate race")
except _sanitizer.CUDASanitizerErrors:
    print("canary: the sanitizer caught the deliberate race (the report above is expected)")
torch.cuda.synchronize()

# Kernel launches the sanitizer checked, per thread: fpipe's workers are "fpipe-worker-N",
# worker 0 is the caller's thread, autograd's device threads show as "Dummy-N".
launches = collections.Counter()
handler = sanitizer.dispatch.event_handler
checked = handler._handle_kernel_launch


def counted(*args, **kwargs):
    launches[threading.current_thread().name] += 1
    return checked(*args, **kwargs)


class Starts:
    """Prints each test's name as it starts, so a slow or hung test is seen by name."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        print(f"\n[{time.monotonic() - self.start:6.1f} s] start {nodeid}", flush=True)


handler._handle_kernel_launch = counted
split = sys.argv.index("--")
tests, extra = sys.argv[1:split], sys.argv[split + 1:]
code = pytest.main(["-q", "-m", "cuda", "-p", "no:cacheprovider", *tests, *extra],
                   plugins=[Starts()])
print("kernel launches checked, per thread:")
for name, n in sorted(launches.items()):
    print(f"  {name}: {n}")
workers = sum(n for name, n in launches.items() if name.startswith("fpipe-worker-"))
if code == 0 and workers == 0:
    sys.exit("the sanitizer saw no kernel from fpipe's worker threads: each worker must push "
             "torch.cuda._sanitizer.cuda_sanitizer.dispatch while cuda_sanitizer.enabled")
print(f"pytest exit status {int(code)}; {workers} worker kernels checked")
sys.exit(int(code))
PY
