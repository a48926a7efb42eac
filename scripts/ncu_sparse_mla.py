"""One sparse_mla_paged call to profile under Nsight Compute (GPU): a decode batch on the inputs of bench.fp8's
decode, or (--prefill T) T tokens of one request on the inputs of the kernel benchmark's sparse MLA rows.

    ncu -k regex:_sparse_mla_heads_n_kernel --launch-skip 2 --launch-count 1 --set full -o OUT/fp8 \
        python scripts/ncu_sparse_mla.py --cache fp8 --B 128 --heads 16 --context 8192
    ncu -k regex:_sparse_mla_pairs_kernel --launch-skip 2 --launch-count 1 --set full -o OUT/pairs \
        python scripts/ncu_sparse_mla.py --prefill 4096 --model glm-5.2 --context 32768

Decode: the call runs four times (the first compiles; skip two launches to profile a warm one), and both
caches' kernels first run once on poisoned outputs (bench.fp8.decode_calls). Prefill: the kernel benchmark's row
(its checked launch on poisoned outputs, then its timing launches). The script fails if a result is wrong, so a
profiled kernel is a correct one.
"""

from __future__ import annotations

import argparse

import torch

from dsv32ref.bench.fp8 import decode_calls, decode_inputs
from dsv32ref.bench.kernels import bench_sparse_mla, shapes
from dsv32ref.checks import rel_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--B", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=0, help="T query tokens of one request (0: the decode batch)")
    ap.add_argument("--model", default="glm-5.2")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.prefill:
        res = bench_sparse_mla(shapes(args.model), args.prefill, args.context, None, torch_path=False)
        print(f"{args.model} T={args.prefill} ctx={args.context} {res['impl']}: rel err out {res['rel_err_out']:.2e}")
        if not res["ok"]:
            raise SystemExit(f"the {res['impl']} kernel's result is wrong: {res}")
        return
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
