"""Compile sparse_mla for sm_90a without a GPU and count what its main loop issues per step.

    python scripts/sass_sparse_mla.py --out data/sparse_mla_sass.json
        the library's kernel (rows resolved before the loop, the warpgroups split QK^T's keys, the next
        step's rows loaded one step ahead), and the variants of dsv32ref.bench.sparse_mla_variants: without
        the rows ahead, the chained build (QK^T chained into PV: both warpgroups compute all of S), and with
        the chained QK^T the two other ways to resolve key addresses (in the loop, one step ahead);
        DeepSeek-V3.2 sizes

        and sm_90's warp-specialized Gluon kernel (dsv32ref.kernels.sparse_mla_hopper): the consumers' loop and
        the producer's

Uses the ptxas and cuobjdump that ship with triton. The loop is the backward branch whose body holds the
most HGMMA instructions (the producer's: the most LDGSTS); the counts are of instructions in that body (one
step of the loop):
LDG = global loads into registers (indices, block-table entries), LDGSTS = cp.async copies (the gather),
HGMMA = warpgroup MMAs, BAR = CTA barriers. ptxas also reports registers and spills.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from dsv32ref.bench.sparse_mla_variants import LIBRARY, _variant_kernel
from dsv32ref.kernels.sparse_mla import _sparse_mla_kernel
from dsv32ref.kernels.sparse_mla_hopper import _sparse_mla_ws_kernel
from dsv32ref.provenance import provenance

POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_table_ptr": "*i32", "req_ptr": "*i32",
            "seq_lens_ptr": "*i32", "idx_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "rows_ptr": "*i32"}
VARIANT_ONLY = ("SLOTS", "PREFETCH", "SPLIT_QK", "Q_RELOAD")


def compile_sm90(config: dict, variant: bool = False):
    """The library's kernel at DeepSeek-V3.2 sizes (or, with `variant`, the sweep's kernel) for sm_90a."""
    cfg = dict(LIBRARY, **config)
    fn = _variant_kernel if variant else _sparse_mla_kernel
    const = dict(D_LAT=512, D_ROPE=64, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], PRECISION="tf32")
    const.update({k: cfg[k] for k in VARIANT_ONLY} if variant else dict(NUM_SPLITS=1, VALID_FIRST=False))
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in const else POINTERS.get(p, "fp32" if p == "sm_scale_log2" else "i32") for p in params}
    # As at a launch with 16-byte aligned pointers and strides (what the GPU build specialises on).
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p] not in ("constexpr", "fp32")}
    src = ASTSource(fn, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def compile_hopper_sm90():
    """sm_90's warp-specialized kernel at DeepSeek-V3.2 sizes, as sparse_mla_paged launches it."""
    const = dict(D_LAT=512, D_ROPE=64, VALID_FIRST=False, num_warps=8)
    params = list(inspect.signature(_sparse_mla_ws_kernel.fn).parameters)
    sig = {p: "constexpr" if p in const else POINTERS.get(p, "fp32" if p == "sm_scale_log2" else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p] not in ("constexpr", "fp32")}
    src = GluonASTSource(_sparse_mla_ws_kernel, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))


def loop_counts(config: dict, variant: bool = False, kernel=None, loop: str = "HGMMA") -> dict:
    """Registers, spills and one step's instructions of the loop whose body holds the most `loop` instructions."""
    kernel = kernel or compile_sm90(config, variant)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    instrs = []  # (address, opcode, operands)
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in instrs:
        t = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and t and int(t.group(1), 16) < addr:
            body = [o for a, o, _ in instrs if int(t.group(1), 16) <= a <= addr]
            loops.append((sum(o.startswith(loop) for o in body), body))
    body = max(loops, key=lambda x: x[0])[1]
    kinds = collections.Counter(o.split(".")[0] for o in body)
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    name = kernel.name if config is None else _variant_kernel.__name__ if variant else _sparse_mla_kernel.__name__
    return {"kernel": name, "config": None if config is None else dict(LIBRARY, **config), "registers": int(regs.group(1)), "spill_store_bytes": int(spill.group(1)),
            "shared_bytes": kernel.metadata.shared, "loop_instructions": len(body),
            "per_step": {k: kinds[k] for k in ("LDG", "LDGSTS", "LDS", "STS", "HGMMA", "BAR", "MUFU", "IMAD")}}


VARIANTS = {  # name: (config over the library's, compiled from the variants module)
    "SLOTS, split QK^T, rows one step ahead (the Triton kernel)": ({}, False),
    "SLOTS, split QK^T (SPLIT_QK)": ({"PREFETCH": False}, True),
    "SLOTS, chained QK^T": ({"SPLIT_QK": False, "PREFETCH": False}, True),
    "in the loop, chained QK^T": ({"SLOTS": False, "PREFETCH": False, "SPLIT_QK": False}, True),
    "one step ahead, chained QK^T": ({"SLOTS": False, "PREFETCH": True, "SPLIT_QK": False}, True),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the counts with their provenance as JSON")
    args = ap.parse_args(argv)
    prov = provenance()  # before --out is opened: rewriting a tracked file would mark the tree dirty
    rows = {}
    hopper = compile_hopper_sm90()
    runs = [(name, lambda cfg=cfg, variant=variant: loop_counts(cfg, variant)) for name, (cfg, variant) in VARIANTS.items()]
    runs += [("sm_90 warp-specialized: the consumers' loop", lambda: loop_counts(None, kernel=hopper)),
             ("sm_90 warp-specialized: the producer's loop", lambda: loop_counts(None, kernel=hopper, loop="LDGSTS"))]
    for name, run in runs:
        rows[name] = r = run()
        print(f"{name:<46} regs {r['registers']}, spills {r['spill_store_bytes']} B, shared {r['shared_bytes']} B, "
              f"{r['loop_instructions']} instructions per step: " + ", ".join(f"{k} {v}" for k, v in r["per_step"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": dict(prov, target="sm_90a (compiled offline, no GPU needed)"),
                       "sizes": "DeepSeek-V3.2 (D_LAT 512, D_ROPE 64)",
                       "variants": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
