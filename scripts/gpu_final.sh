#!/usr/bin/env bash
# Device call: every notebook under nbval on the H200, the out-of-memory GPU test, then the allocator-history
# runs of narrow_copy (issue 5) at one rank of TP4.
set -uo pipefail
OUT=${1:?output dir}
source "$(dirname "$0")/device_env.sh"
timeout 260 python3 -m pytest -q -p no:cacheprovider notebooks 2>&1 | tail -8 | tee "$OUT/pytest_notebooks.txt"
timeout 70 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" -m gpu tests/test_engine.py -k out_of_memory 2>&1 \
  | tail -4 | tee "$OUT/pytest_oom.txt"
timeout 110 python3 -m dsv32ref capture --model glm-5.2 --heads-per-rank 16 --plan history \
  --out "$OUT/capture_memory_glm-5.2_h16_history.json" 2>&1 | tail -4
