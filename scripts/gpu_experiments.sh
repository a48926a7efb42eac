#!/usr/bin/env bash
# The GPU runs behind data/, in a few device calls. Usage (GPU machine, repo root; .whl/ carried for nbval):
#   DSV32REF_GIT_COMMIT=<sha> bash scripts/gpu_experiments.sh OUTDIR STEP [STEP ...]
# Steps, in the order given (each writes OUTDIR/<file> and OUTDIR/<step>.log; data/README.md says which
# files of data/ each one records):
#   tests      every gpu-marked test (of TESTS_FILES, default tests/), 8 at once, failures again alone -> pytest_gpu.txt
#   nanplant   the NaN indexer test against a planted bug (tl.maximum for the ReLU, which drops NaN compiled):
#              it must fail; the tree is restored after                       -> nanplant.txt
#   main       the main job, `python -m dsv32ref --quick`, timed; data/ must be unchanged afterwards -> main.log
#   kernels    the kernel benchmark                                           -> kernels.json
#   ttft       TTFT + ledger of every boundary and the top-k skip (MODELS), the fused MoE's arms (FUSED, default
#              every boundary; FUSED= for none), none+fused+skinny (the floor with skinny_gemm's projections), the
#              instrument A/B and the FP8 KV cache's arms (narrow, none) for AB_MODEL (default glm-5.2)
#                                                                             -> ttft_<model>.json
#   fp8        the FP8 KV cache against bf16: decode and indexer scores       -> fp8_speed.json
#   capture    start-up memory at one TP4 rank's heads (16), every boundary   -> capture_memory_glm-5.2_h16.json
#   capture8   the same with the FP8 KV cache                                 -> capture_memory_glm-5.2_h16_fp8.json
#   regimes    TTFT against prompt length to 32k (chunked past 8k), TPOT to 128k context, every variant, with
#              the indexer's and sparse MLA's kernel time (several minutes: a call of its own; REGIMES_ARGS="--max-prompt
#              4096 --max-context 8192" for the shorter map, about 2 minutes)          -> regimes_glm-5.2.json
#   timeline   one profiled request per boundary on a time axis               -> timeline_glm-5.2.json
#   ncu        Nsight Compute's full set on one warm launch each: the pair kernel (GLM-5.2, 4096 tokens of a
#              32k request) and the FP8 decode (16 heads, 128 requests, 32k context), checked first
#              (scripts/ncu_sparse_mla.py); where their warps wait (scripts/ncu_waits.py)
#                                                       -> ncu_pairs.txt, ncu_fp8_decode.txt and their _waits.txt
#   nbval      the notebooks under nbval                                      -> nbval.txt
#   pack       every file under OUTDIR into OUTDIR/results.tgz (what a device call brings back is a few files)
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
dsv() { local limit=$1; shift; timeout "$limit" python3 -m dsv32ref "$@" 2>&1 | tr '\r' '\n' | grep -v "\] [0-9]*/[0-9]*$"; }
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tests)
      # 8 workers (compiling dominates: the whole suite in about 3 minutes on an H100); they share the GPU's memory
      # (test_indexer_topk's launch ran out of it beside the others once, and passed alone), so what failed then
      # runs again alone
      gpu_pytest() { timeout "$1" python3 -m pytest -q -o cache_dir=/tmp/pytest_gpu_cache -o addopts="" -m gpu \
        ${TESTS_FILES:-tests} ${TESTS_K:+-k "$TESTS_K"} "${@:2}" 2>&1; }
      gpu_pytest 360 -n 8 -rfE --cache-clear | tee "$OUT/pytest_gpu.txt" | tail -6
      rc=${PIPESTATUS[0]}
      if [ "$rc" = 1 ]; then  # tests failed (not a timeout, a crash or a usage error: those say so and stop)
        echo "failures, again one at a time:" | tee -a "$OUT/pytest_gpu.txt"
        gpu_pytest 150 --last-failed --last-failed-no-failures none | tee -a "$OUT/pytest_gpu.txt" | tail -4
      elif [ "$rc" != 0 ]; then
        echo "the parallel run ended with status $rc: no rerun" | tee -a "$OUT/pytest_gpu.txt"
      fi ;;
    nanplant)
      cp dsv32ref/kernels/indexer_topk.py /tmp/indexer_topk.py
      sed -i 's/part = tl.where(logits < 0.0, 0.0, logits) \* w\[None, :\]/part = tl.maximum(logits, 0.0) * w[None, :]/' \
        dsv32ref/kernels/indexer_topk.py
      timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_kernels.py -k nan_indexer \
        2>&1 | tee "$OUT/nanplant.txt" | tail -3
      cp /tmp/indexer_topk.py dsv32ref/kernels/indexer_topk.py ;;
    main)
      before=$(cat data/*.json | md5sum)
      timeout 400 python3 -m dsv32ref --quick 2>&1 | tr '\r' '\n' | grep -v "\] [0-9]*/[0-9]*$" > "$OUT/main.log"
      rc=${PIPESTATUS[0]}
      after=$(cat data/*.json | md5sum)
      echo "main job rc $rc, $(( $(date +%s) - start )) s, data/ $([ "$before" = "$after" ] && echo unchanged || echo CHANGED)" \
        | tee -a "$OUT/main.log"
      tail -28 "$OUT/main.log" ;;
    kernels)
      timeout 300 python3 -m dsv32ref kernels --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1; echo "kernels rc $?"
      grep "sparse_mla .* T=512\|^ceilings" "$OUT/kernels.log" | tail -6 ;;
    ttft)
      for model in ${MODELS:-glm-5.2 deepseek-v3.2}; do
        ab=$([ "$model" = "${AB_MODEL:-glm-5.2}" ] && echo --instrument-ab --fp8-kv narrow none)
        fused=${FUSED-wide narrow narrow_out none}
        dsv 480 ttft --model "$model" $ab ${fused:+--fused-moe $fused} --fused-skinny none --out "$OUT/ttft_$model.json" \
          > "$OUT/ttft_$model.log"
        tail -14 "$OUT/ttft_$model.log"
      done ;;
    fp8)
      timeout 300 python3 -m dsv32ref fp8-speed --out "$OUT/fp8_speed.json" > "$OUT/fp8.log" 2>&1; echo "fp8 rc $?"
      grep "B=128\|B=1 " "$OUT/fp8.log" | tail -12 ;;
    capture)
      dsv 480 capture --model glm-5.2 --heads-per-rank 16 ${CAPTURE_ARGS:---no-threshold} --out "$OUT/capture_memory_glm-5.2_h16.json" \
        > "$OUT/capture.log"; tail -10 "$OUT/capture.log" ;;
    capture8)
      dsv 480 capture --model glm-5.2 --heads-per-rank 16 --kv-cache-dtype fp8 ${CAPTURE_ARGS:---no-threshold} \
        --out "$OUT/capture_memory_glm-5.2_h16_fp8.json" > "$OUT/capture8.log"; tail -10 "$OUT/capture8.log" ;;
    regimes)
      dsv 560 regimes --model glm-5.2 ${REGIMES_ARGS:-} --out "$OUT/regimes_glm-5.2.json" > "$OUT/regimes.log"; tail -5 "$OUT/regimes.log" ;;
    timeline)
      dsv 150 timeline --model glm-5.2 --out "$OUT/timeline_glm-5.2.json" > "$OUT/timeline.log"; tail -5 "$OUT/timeline.log" ;;
    ncu)
      prof() { local name=$1 kernel=$2; shift 2; timeout 150 ncu --clock-control none --set full --import-source no \
        -k "regex:$kernel" --launch-skip 2 --launch-count 1 -f -o "/tmp/$name" python3 scripts/ncu_sparse_mla.py "$@" \
        > "$OUT/$name.log" 2>&1
        echo "ncu $name rc $?"; ncu -i "/tmp/$name.ncu-rep" --page details > "$OUT/$name.txt" 2>&1
        ncu -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass > "/tmp/$name.csv" 2>&1 \
          && python3 scripts/ncu_waits.py "/tmp/$name.csv" > "$OUT/${name}_waits.txt"
        grep -m2 "Duration\|Compute (SM) Throughput" "$OUT/$name.txt"; grep "rel err" "$OUT/$name.log"; }
      prof ncu_pairs _sparse_mla_pairs_kernel --prefill 4096 --model glm-5.2 --context 32768
      prof ncu_fp8_decode _sparse_mla_heads_n_kernel --cache fp8 --B 128 --heads 16 --context 32768 ;;
    nbval)
      timeout 400 python3 -m pytest -q -p no:cacheprovider notebooks 2>&1 | tee "$OUT/nbval.txt" | tail -6 ;;
    pack)
      (cd "$OUT" && tar czf results.tgz --exclude results.tgz -- * && find . -type f ! -name results.tgz -delete)
      ls -la "$OUT" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  echo "[$step: $(( $(date +%s) - start )) s]"
done
