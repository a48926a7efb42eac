#!/usr/bin/env bash
# Device call: the out-of-memory GPU test with blocking launches (full log), TTFT of both models, issue 5's
# start-up memory plan at one rank of TP4 (16 heads).
set -uo pipefail
OUT=${1:?output dir}
source "$(dirname "$0")/device_env.sh"
CUDA_LAUNCH_BLOCKING=1 timeout 80 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" -m gpu tests/test_engine.py \
  -k out_of_memory > "$OUT/pytest_oom.txt" 2>&1; tail -3 "$OUT/pytest_oom.txt"
for model in glm-5.2 deepseek-v3.2; do
  timeout 150 python3 -m dsv32ref ttft --model $model --out "$OUT/ttft_$model.json" 2>&1 | grep -v "^\s*$" | grep -v "TTFT, all" | tail -6
done
timeout 280 python3 -m dsv32ref capture --model glm-5.2 --heads-per-rank 16 --out "$OUT/capture_memory_glm-5.2_h16.json" 2>&1 | tail -10
