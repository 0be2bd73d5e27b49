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
# Usage: scripts/cuda_sanitizer.sh [pytest args...]; the log goes to build/cuda_sanitizer.log
# (or $CUDA_SANITIZER_LOG). Exit status: non-zero on a test failure, a missed race or no worker
# kernels seen.
set -euo pipefail
cd "$(dirname "$0")/.."
log="${CUDA_SANITIZER_LOG:-build/cuda_sanitizer.log}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
mkdir -p "$(dirname "$log")"
: > "$log"
TORCH_CUDA_SANITIZER=1 python - "$@" <<'PY' 2>&1 | tee -a "$log"
import collections
import sys
import threading

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


handler._handle_kernel_launch = counted
code = pytest.main(["-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_cuda.py",
                    *sys.argv[1:]])
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
