#!/usr/bin/env bash
# The GPU check in one call (docs/gpu-checklist.md): the benchmark against torchgpipe, the CUDA
# tests, then the stream sanitizer's subset, each bounded by `timeout`, within 9 minutes in
# all on one H100. Logs and JSON go to $OUT (default build/gpu-check); a part that fails or
# runs out of time is recorded in $OUT/summary.txt and the next part still runs.
#
# Usage: scripts/gpu_check.sh          (python: the first on PATH, a CUDA build of torch)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-build/gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
summary="$out/summary.txt"
: > "$summary"

part() {  # part NAME SECONDS COMMAND...: run COMMAND under a time limit, log to $out/NAME.log
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS
  echo "== $name (at most $limit s): $*"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local code=$?
  local verdict=$([[ $code == 0 ]] && echo ok || ([[ $code == 124 ]] && echo "timed out" || echo "failed ($code)"))
  echo "$name: $verdict in $((SECONDS - start)) s" | tee -a "$summary"
  tail -n 25 "$out/$name.log"
}

part environment 60 python -c "
import importlib.util, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())
for name in ('optree', 'pytest', 'hypothesis', 'torchgpipe'):
    print(name, 'installed' if importlib.util.find_spec(name) else 'MISSING')"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >> "$out/environment.log" 2>&1
part benchmark 200 python benchmarks/gpu.py --json "$out/gpu.json"
part cuda-tests 180 python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py \
  tests/test_gpu_workers.py tests/test_distributed_cuda.py
CUDA_SANITIZER_LOG="$out/cuda_sanitizer.log" CUDA_SANITIZER_TIMEOUT=110 \
  part sanitizer 130 scripts/cuda_sanitizer.sh
cat "$summary"
! grep -qv ": ok in" "$summary"
