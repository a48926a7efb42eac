#!/usr/bin/env bash
# One device call for the graph experiments: GPU tests of the engine, then TTFT + measured ledger per model.
# Usage (GPU machine, repo root): DSV32REF_GIT_COMMIT=<sha> bash scripts/gpu_experiments.sh OUTDIR [model ...]
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" -m gpu tests/test_engine.py 2>&1 | tail -15 | tee "$OUT/pytest_engine.txt"
fi
for model in "${@:-glm-5.2}"; do
  python3 -m dsv32ref ttft --model "$model" --out "$OUT/ttft_$model.json" 2>&1 | tee "$OUT/ttft_$model.log" | grep -v "^\s*$" | tail -12
done
if [ "${CAPTURE_MEMORY:-0}" = 1 ]; then  # issue 5: start-up memory per boundary (several utilisations)
  python3 -m dsv32ref capture --model "${1:-glm-5.2}" --utilization 0.9 --utilization 0.95 \
    --out "$OUT/capture_memory.json" 2>&1 | tee "$OUT/capture_memory.log" | tail -12
fi
