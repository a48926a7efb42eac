#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU + notebook tests, then the kernel benchmark.
# Usage (on the GPU machine, repo root): DSV32REF_GIT_COMMIT=<sha> bash scripts/gpu_session.sh OUTDIR [bench args]
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests notebooks 2>&1 | tail -25 | tee "$OUT/pytest.txt"
fi
python3 -m dsv32ref.bench.kernels --out "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -80
