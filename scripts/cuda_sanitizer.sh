#!/usr/bin/env bash
# The CUDA tests (stages sharing cuda:0, so the compute and copy streams and their events are
# used, and a mixed CPU/CUDA pipeline) under PyTorch's CUDA stream sanitizer, which fails a
# test on any unsynchronised access of one tensor from two streams. Needs a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
TORCH_CUDA_SANITIZER=1 python -m pytest -q -m cuda tests/test_cuda.py "$@"
