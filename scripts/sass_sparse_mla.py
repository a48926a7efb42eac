"""Compile sparse_mla's kernels for sm_90a without a GPU and count what their main loops issue per step.

    python scripts/sass_sparse_mla.py --out sass-3.6.0.json            (under one triton)
    python scripts/sass_sparse_mla.py --merge sass-*.json --out data/sparse_mla_sass.json

The Triton kernel (dsv32ref.kernels.sparse_mla) and sm_90's warp-specialized Gluon kernels (sparse_mla_hopper,
sparse_mla_heads_n at 16 heads, and sparse_mla_pairs, FlashMLA's pair schedule, over bf16 rows only: the consumers'
loop and the producer's), each over the bf16 cache and over FlashMLA's FP8 rows, at DeepSeek-V3.2 sizes, as
sparse_mla_paged launches them. A kernel that does not compile under this triton is a result too (its error is
recorded). scripts/sm90_triton_versions.sh runs this under each triton release and merges the files.

Built by dsv32ref.kernels.sm90_offline (triton's ptxas and cuobjdump). The loop is the innermost backward branch
whose body holds the most HGMMA instructions (the producer's: the most LDGSTS, or LDG over FP8 rows); the counts
are of instructions in that body (one step of the loop: 64 keys, a pair of 64-key blocks in sparse_mla_pairs):
LDG = global loads into registers, LDGSTS = cp.async copies (the gather), HGMMA = warpgroup MMAs, BAR = CTA
barriers. ptxas also reports registers and spills.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

import triton

from dsv32ref.kernels.sm90_offline import SPARSE_MLA_POINTERS as POINTERS
from dsv32ref.kernels.sm90_offline import compile_sm90, ptxas_report
from dsv32ref.kernels.sparse_mla import DEFAULT_CONFIG, FP8_CONFIG, _sparse_mla_kernel
from dsv32ref.kernels.sparse_mla_heads_n import _sparse_mla_heads_n_kernel
from dsv32ref.kernels.sparse_mla_hopper import _sparse_mla_ws_kernel
from dsv32ref.kernels.sparse_mla_pairs import _sparse_mla_pairs_kernel
from dsv32ref.provenance import provenance

def compile_triton_kernel(fp8: bool = False):
    """The Triton kernel over the bf16 cache, or (fp8) over FlashMLA's FP8 rows, with its tiles."""
    cfg = FP8_CONFIG if fp8 else DEFAULT_CONFIG
    const = dict(D_LAT=512, D_ROPE=64, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], PRECISION="tf32",
                 NUM_SPLITS=1, VALID_FIRST=False, FP8=fp8, FLAG_NAN=False)
    pointers = dict(POINTERS, cache_ptr="*u8") if fp8 else POINTERS
    return compile_sm90(_sparse_mla_kernel, const, pointers, cfg["num_warps"], num_stages=cfg["num_stages"])


def compile_hopper_kernel(fp8: bool = False, heads_n: bool = False, pairs: bool = False):
    """sm_90's 64-head kernel (or, heads_n, the one with 16 heads as the MMA's N; pairs, the one with FlashMLA's
    pair schedule, bf16 rows only) over the bf16 cache, or (fp8) over FlashMLA's FP8 rows; one top-k split."""
    warps = 4 if heads_n or pairs else 8
    const = dict(D_LAT=512, D_ROPE=64, VALID_FIRST=False, NUM_SPLITS=1, num_warps=warps)
    if not pairs:
        const["FP8"] = fp8
    if heads_n:
        const["HB"] = 16
    pointers = dict(POINTERS, cache_ptr="*u8") if fp8 else POINTERS
    fn = _sparse_mla_pairs_kernel if pairs else _sparse_mla_heads_n_kernel if heads_n else _sparse_mla_ws_kernel
    return compile_sm90(fn, const, pointers, warps, gluon=True)


def loop_counts(kernel, loop: str = "HGMMA") -> dict:
    """Registers, spills and one step's instructions of the loop whose body holds the most `loop` instructions."""
    report = ptxas_report(kernel)
    instrs = []  # (address, opcode, operands)
    for line in report["sass"].splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2), m.group(3)))
    spans = []  # (first, last address) of each backward branch's body that holds `loop` instructions
    for addr, op, rest in instrs:
        t = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and t and int(t.group(1), 16) < addr:
            first = int(t.group(1), 16)
            if any(o.startswith(loop) for a, o, _ in instrs if first <= a <= addr):
                spans.append((first, addr))
    # innermost: a span around another one is a partition's prologue or the kernel, not one step
    inner = [(f, l) for f, l in spans if not any(f <= f2 and l2 <= l and (f2, l2) != (f, l) for f2, l2 in spans)]
    bodies = [[o for a, o, _ in instrs if f <= a <= l] for f, l in inner]
    body = max(bodies, key=lambda b: sum(o.startswith(loop) for o in b))
    kinds = collections.Counter(o.split(".")[0] for o in body)
    return {"kernel": kernel.name, "registers": report["registers"], "spill_store_bytes": report["spill_store_bytes"],
            "shared_bytes": report["shared_bytes"], "loop_instructions": len(body),
            "per_step": {k: kinds[k] for k in ("LDG", "LDGSTS", "LDS", "STS", "HGMMA", "BAR", "MUFU", "IMAD")}}


def _attempt(fn) -> dict:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a kernel that does not build under this triton is the result
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:400]}


def counts() -> dict:
    rows = {"the Triton kernel": _attempt(lambda: loop_counts(compile_triton_kernel())),
            "the Triton kernel, fp8 cache": _attempt(lambda: loop_counts(compile_triton_kernel(fp8=True)))}
    # the producer's loop: over bf16 rows it gathers with cp.async; over FP8 rows it loads into registers
    kernels = ((False, False, "sm_90 warp-specialized"), (True, False, "sm_90 heads as N (16)"),
               (False, True, "sm_90 key pairs"))
    for heads_n, pairs, kernel in kernels:
        for fp8, producer_op in ((False, "LDGSTS"), (True, "LDG"))[:1 if pairs else 2]:
            hopper = _attempt(lambda: compile_hopper_kernel(fp8, heads_n, pairs))
            cache = ", fp8 cache" if fp8 else ""
            for name, loop in ((f"{kernel}{cache}: the consumers' loop", "HGMMA"),
                               (f"{kernel}{cache}: the producer's loop", producer_op)):
                rows[name] = hopper if isinstance(hopper, dict) else _attempt(lambda: loop_counts(hopper, loop))
    for name, r in rows.items():
        print(f"triton {triton.__version__} {name:<44} " + (r["error"] if "error" in r else
              f"regs {r['registers']}, spills {r['spill_store_bytes']} B, shared {r['shared_bytes']} B, "
              f"{r['loop_instructions']} instructions per step: " + ", ".join(f"{k} {v}" for k, v in r["per_step"].items())))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the counts with their provenance as JSON")
    ap.add_argument("--merge", nargs="+", help="files of single triton releases to merge into --out")
    args = ap.parse_args(argv)
    prov = dict(provenance(), target="sm_90a (compiled offline, no GPU needed)")
    if args.merge:
        runs = [json.load(open(f)) for f in args.merge]
        result = {"provenance": dict(prov, triton=[r["provenance"]["triton"] for r in runs]),
                  "sizes": "DeepSeek-V3.2 (D_LAT 512, D_ROPE 64)",
                  "by_triton": {r["provenance"]["triton"]: r["kernels"] for r in runs}}
    else:
        result = {"provenance": prov, "sizes": "DeepSeek-V3.2 (D_LAT 512, D_ROPE 64)", "kernels": counts()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
