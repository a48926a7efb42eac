#!/usr/bin/env bash
# One device call for the graph experiments. Usage (GPU machine, repo root, .whl/ carried):
#   DSV32REF_GIT_COMMIT=<sha> bash scripts/gpu_experiments.sh OUTDIR [model ...]
# Steps, each switchable:
#   NOTEBOOKS=1        every notebook under nbval first
#   SKIP_TESTS=1       skip the engine's GPU tests (replay = eager per variant and mode, the out-of-memory test)
#   SKIP_TTFT=1        skip TTFT + measured ledger of each model                     -> OUTDIR/ttft_<model>.json
#   TP=4               TTFT with 4 ranks (tensor parallel attention/MLP, expert parallel MoE; needs 4 GPUs,
#                      NVLink multicast off)                                          -> OUTDIR/ttft_<model>_tp4.json
#   CAPTURE_MEMORY=1   issue 5's start-up memory for the first model at each head count in CAPTURE_HEADS
#                      (default "16": one rank of TP4), plan CAPTURE_PLAN (default | history)
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
if [ "${NOTEBOOKS:-0}" = 1 ]; then
  timeout 260 python3 -m pytest -q -p no:cacheprovider notebooks 2>&1 | tail -8 | tee "$OUT/pytest_notebooks.txt"
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" -m gpu tests/test_engine.py 2>&1 | tail -15 | tee "$OUT/pytest_engine.txt"
fi
if [ "${SKIP_TTFT:-0}" != 1 ]; then
  tp=${TP:-1}; tag=$([ "$tp" -gt 1 ] && echo "_tp$tp")
  for model in "${@:-glm-5.2}"; do
    timeout 300 python3 -m dsv32ref ttft --model "$model" --tp "$tp" --out "$OUT/ttft_$model$tag.json" 2>&1 | tee "$OUT/ttft_$model$tag.log" \
      | grep -v "^\s*$" | grep -v "TTFT, all" | tail -8
  done
fi
if [ "${CAPTURE_MEMORY:-0}" = 1 ]; then
  plan=${CAPTURE_PLAN:-default}
  for heads in ${CAPTURE_HEADS:-16}; do
    tag=_h$heads$([ "$plan" = history ] && echo _history)
    timeout 300 python3 -m dsv32ref capture --model "${1:-glm-5.2}" --heads-per-rank "$heads" --plan "$plan" \
      --out "$OUT/capture_memory_${1:-glm-5.2}$tag.json" 2>&1 | tee "$OUT/capture_memory$tag.log" | tail -14
  done
fi
