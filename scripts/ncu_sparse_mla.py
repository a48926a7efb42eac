"""One sparse_mla_paged decode call to profile under Nsight Compute (GPU), on the inputs of bench.fp8's decode.

    ncu -k regex:_sparse_mla_ws_kernel --launch-skip 2 --launch-count 1 --set full -o OUT/fp8 \
        python scripts/ncu_sparse_mla.py --cache fp8 --B 128 --heads 16 --context 8192

The call runs four times (the first compiles; skip two launches to profile a warm one). Both caches' kernels
first run once on poisoned outputs (bench.fp8.decode_calls); the script fails if their results differ, so a
profiled kernel is a correct one.
"""

from __future__ import annotations

import argparse

import torch

from dsv32ref.bench.fp8 import decode_calls, decode_inputs
from dsv32ref.bench.kernels import shapes
from dsv32ref.checks import rel_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--B", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    torch.manual_seed(0)
    z = shapes("glm-5.2")
    r = decode_inputs(z, args.B, args.context)
    _, calls, outs, lses = decode_calls(z, r, args.heads)
    for _ in range(4):
        r["rot"].i = -1
        calls[args.cache]()
    torch.cuda.synchronize()
    err = max(rel_err(outs["fp8"], outs["bf16"]), rel_err(lses["fp8"], lses["bf16"]))
    print(f"B={args.B} H={args.heads} ctx={args.context} {args.cache}: fp8 vs bf16 rel err {err:.2e}")
    if not err <= 1e-2 or outs[args.cache].isnan().any():  # the threshold of bench.fp8's decode rows
        raise SystemExit(f"the {args.cache} kernel's result is wrong: rel err {err:.2e} against the other cache's")


if __name__ == "__main__":
    main()
