#!/usr/bin/env bash
# sparse_mla's kernels compiled for sm_90a offline (no GPU) under each triton release that sparse_mla_hopper
# names in SUPPORTED_TRITON, and one newer, each in a virtual environment of its own, merged into one file.
#   bash scripts/sm90_triton_versions.sh [OUT] [WORKDIR]     (default data/sparse_mla_sass.json, /tmp/sm90-triton)
# Needs PyPI (triton wheels) and the CPU torch 2.13.0 wheel; takes a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-data/sparse_mla_sass.json}
work=${2:-/tmp/sm90-triton}
versions=${TRITON_VERSIONS:-"3.6.0 3.7.1 3.8.0 3.9.0"}
mkdir -p "$work"
files=()
for v in $versions; do
  env="$work/venv-$v"
  if [ ! -x "$env/bin/python" ]; then
    python3 -m venv "$env"
    "$env/bin/pip" install -q torch==2.13.0 "numpy<2.3" safetensors matplotlib
    "$env/bin/pip" install -q --no-deps "triton==$v"
  fi
  PYTHONPATH=$PWD "$env/bin/python" scripts/sass_sparse_mla.py --out "$work/sass-$v.json"
  files+=("$work/sass-$v.json")
done
PYTHONPATH=$PWD "$work/venv-${versions%% *}/bin/python" scripts/sass_sparse_mla.py \
  --merge "${files[@]}" --out "$out"
echo "wrote $out"
