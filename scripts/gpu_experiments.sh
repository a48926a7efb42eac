#!/usr/bin/env bash
# The GPU runs behind every result in data/, in one device call or a few. Usage (GPU machine, repo root,
# .whl/ carried for the notebooks):
#   DSV32REF_GIT_COMMIT=<sha> bash scripts/gpu_experiments.sh OUTDIR STEP [STEP ...]
# Steps, in the order given:
#   ttft       TTFT + measured ledger of every boundary, with the instrument A/B   -> OUTDIR/ttft_<model>.json
#              (MODELS, default "glm-5.2 deepseek-v3.2")
#   kernels    the kernel benchmark                                                -> OUTDIR/kernels.json
#   capture    start-up memory at one TP4 rank's heads (16), every boundary        -> OUTDIR/capture_memory_glm-5.2_h16.json
#   history    the same with the allocator's history, narrow_copy                  -> OUTDIR/capture_memory_glm-5.2_h16_history.json
#   regimes    TTFT against prompt length, decode TPOT, every variant              -> OUTDIR/regimes_glm-5.2.json
#   timeline   one profiled request per boundary on a time axis (MODELS)         -> OUTDIR/timeline_<model>.json
#   hostcosts  the TTFT model's host costs, per-region times included (MODELS)     -> OUTDIR/host_costs_<model>.json
#   main       the main job, `python -m dsv32ref --quick`, timed; what it writes to data/ goes to OUTDIR/main/
#              and data/ is put back as it was                                     -> OUTDIR/main.log
#   indexerab  the indexer of BASES (default "4cdf2a7 fd85443") beside the library's, with the probe
#              (needs the history: carry out/repo.bundle, made here by `git bundle create out/repo.bundle --all`)
#                                                                                  -> OUTDIR/indexer_ab.json
#   tests      every gpu-marked test                                               -> OUTDIR/pytest_gpu.txt
#   suite      the full suite, notebooks under nbval                               -> OUTDIR/pytest_suite.txt
# Each step's log goes to OUTDIR/<step>.log; the last lines print.
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
for step in "$@"; do
  case $step in
    ttft)
      for model in ${MODELS:-glm-5.2 deepseek-v3.2}; do
        timeout 400 python3 -m dsv32ref ttft --model "$model" ${TTFT_ARGS---instrument-ab} --out "$OUT/ttft_$model.json" 2>&1 \
          | grep -v "TTFT, all" | tee "$OUT/ttft_$model.log" | tail -9
      done ;;
    kernels)
      timeout 400 python3 -m dsv32ref kernels --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1; echo "kernels rc $?"
      tail -4 "$OUT/kernels.log" ;;
    capture)
      timeout 420 python3 -m dsv32ref capture --model glm-5.2 --heads-per-rank 16 \
        --out "$OUT/capture_memory_glm-5.2_h16.json" 2>&1 | tee "$OUT/capture.log" | tail -12 ;;
    history)
      timeout 300 python3 -m dsv32ref capture --model glm-5.2 --heads-per-rank 16 --plan history \
        --out "$OUT/capture_memory_glm-5.2_h16_history.json" 2>&1 | tee "$OUT/history.log" | tail -4 ;;
    regimes)
      timeout 420 python3 -m dsv32ref regimes --model glm-5.2 --out "$OUT/regimes_glm-5.2.json" 2>&1 \
        | tr '\r' '\n' | grep -v "all variants.*\] [0-9]*/" | tee "$OUT/regimes.log" | tail -6 ;;
    timeline)
      for model in ${MODELS:-glm-5.2}; do
        timeout 240 python3 -m dsv32ref timeline --model "$model" --out "$OUT/timeline_$model.json" 2>&1 \
          | tee "$OUT/timeline_$model.log" | tail -6
      done ;;
    hostcosts)
      for model in ${MODELS:-glm-5.2 deepseek-v3.2}; do
        timeout 240 python3 -m dsv32ref hostcosts --model "$model" --out "$OUT/host_costs_$model.json" 2>&1 \
          | tee "$OUT/host_costs_$model.log" | tail -7
      done ;;
    main)
      keep=$(mktemp -d); cp -r data "$keep/"
      start=$(date +%s)
      timeout 420 python3 -m dsv32ref --quick 2>&1 | tr '\r' '\n' | grep -v "\] [0-9]*/" > "$OUT/main.log"; rc=${PIPESTATUS[0]}
      echo "main job rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/main.log"
      mkdir -p "$OUT/main"
      for f in data/*.json; do cmp -s "$f" "$keep/$f" || cp "$f" "$OUT/main/"; done
      rm -rf data; cp -r "$keep/data" data
      tail -30 "$OUT/main.log" ;;
    indexerab)
      if [ ! -d .git ] && [ -f out/repo.bundle ]; then
        rm -rf /tmp/dsv32ref-history && git clone -q out/repo.bundle /tmp/dsv32ref-history && export GIT_DIR=/tmp/dsv32ref-history/.git
      fi
      timeout 400 python3 -m dsv32ref.bench.indexer_ab $(for b in ${BASES:-4cdf2a7 fd85443}; do echo --base "$b"; done) --probe \
        --out "$OUT/indexer_ab.json" > "$OUT/indexerab.log" 2>&1; echo "indexer_ab rc $?"
      grep "library\|floor" "$OUT/indexerab.log" | tail -40 ;;
    tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests 2>&1 \
        | tee "$OUT/pytest_gpu.txt" | tail -8 ;;
    suite)
      timeout 540 python3 -m pytest -q -p no:cacheprovider tests notebooks 2>&1 | tee "$OUT/pytest_suite.txt" | tail -12 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
