#!/usr/bin/env bash
# One device call for the graph experiments: GPU tests of the engine, then TTFT + measured ledger per model.
# Usage (GPU machine, repo root): DSV32REF_GIT_COMMIT=<sha> bash scripts/gpu_experiments.sh OUTDIR [model ...]
#   SKIP_TESTS=1 skips the engine GPU tests; SKIP_TTFT=1 the TTFT runs;
#   CAPTURE_MEMORY=1 runs issue 5's start-up memory plan for the first model, at every head count in
#   CAPTURE_HEADS (default "64 16": one GPU, and one rank of TP4).
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" -m gpu tests/test_engine.py 2>&1 | tail -15 | tee "$OUT/pytest_engine.txt"
fi
if [ "${SKIP_TTFT:-0}" != 1 ]; then
  for model in "${@:-glm-5.2}"; do
    python3 -m dsv32ref ttft --model "$model" --out "$OUT/ttft_$model.json" 2>&1 | tee "$OUT/ttft_$model.log" | grep -v "^\s*$" | tail -12
  done
fi
if [ "${CAPTURE_MEMORY:-0}" = 1 ]; then
  for heads in ${CAPTURE_HEADS:-64 16}; do
    python3 -m dsv32ref capture --model "${1:-glm-5.2}" --heads-per-rank "$heads" \
      --out "$OUT/capture_memory_${1:-glm-5.2}_h$heads.json" 2>&1 | tee "$OUT/capture_memory_h$heads.log" | tail -14
  done
fi
