"""Compile a Triton or Gluon kernel for sm_90a without a GPU, and read what ptxas made of it.

Uses the ptxas and cuobjdump that ship with triton's NVIDIA backend. `compile_sm90` specialises the kernel as a
launch with 16-byte aligned pointers and integer arguments would (what the GPU build specialises on);
`ptxas_report` assembles its PTX: registers, spilled bytes and the SASS. The CPU tests build sm_90's kernels
this way (a kernel that needs more shared memory than an H100/H200 block may take, or spills, fails there before
any GPU sees it); scripts/sass_sparse_mla.py counts their loops' instructions. The build needs triton's compiler,
not its interpreter: under TRITON_INTERPRET=1 (the CPU tests) run it in a process of its own,

    python -m dsv32ref.kernels.sm90_offline dsv32ref.kernels.sparse_mla_pairs:_sparse_mla_pairs_kernel \
        '{"D_LAT": 512, "D_ROPE": 64, "VALID_FIRST": false, "NUM_SPLITS": 1, "num_warps": 4}' --gluon

which prints the report (without the SASS: its instruction counts by opcode) as JSON; `--pointers` retypes
pointer arguments (`'{"cache_ptr": "*u8"}'` for FlashMLA's FP8 rows).
"""

from __future__ import annotations

import argparse
import collections
import importlib
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

__all__ = ["MAX_SHARED_BYTES", "SM90", "SPARSE_MLA_POINTERS", "compile_sm90", "have_ptxas", "ptxas_report"]

SM90 = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may take on sm_90
# the pointer arguments of sparse_mla's kernels (bf16 cache; FlashMLA's FP8 rows are "*u8")
SPARSE_MLA_POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_table_ptr": "*i32", "req_ptr": "*i32",
                       "seq_lens_ptr": "*i32", "idx_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
                       "rows_ptr": "*i32"}
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def have_ptxas() -> bool:
    """Whether this triton ships the tools (ptxas, cuobjdump) the offline build needs."""
    return all(os.path.exists(os.path.join(_BIN, tool)) for tool in ("ptxas", "cuobjdump"))


def compile_sm90(fn, constexprs: dict, pointers: dict, num_warps: int, gluon: bool = False,
                 floats: tuple = ("sm_scale_log2",), **options):
    """fn (a @triton.jit or @gluon.jit kernel) compiled for sm_90a: pointers maps pointer arguments to their
    types ("*bf16"), `floats` names the fp32 scalars, every other argument not in constexprs is an int32;
    options (num_stages) go to triton.compile."""
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    else:
        source_cls = ASTSource
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else pointers.get(p, "fp32" if p in floats else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p] not in ("constexpr", "fp32")}
    src = source_cls(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=SM90, options=dict(options, num_warps=num_warps))


def ptxas_report(kernel) -> dict:
    """{"registers", "spill_store_bytes", "shared_bytes", "sass"} of a compiled kernel, its PTX assembled for
    sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([os.path.join(_BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs, spill = re.search(r"Used (\d+) registers", report), re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(regs.group(1)), "spill_store_bytes": int(spill.group(1)) if spill else 0,
            "shared_bytes": kernel.metadata.shared, "sass": sass}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", help="module:function, e.g. dsv32ref.kernels.sparse_mla_pairs:_sparse_mla_pairs_kernel")
    ap.add_argument("constexprs",
                    help="JSON object: the kernel's constexpr arguments, and the launch's num_warps and num_stages")
    ap.add_argument("--gluon", action="store_true", help="a @gluon.jit kernel")
    ap.add_argument("--pointers", default="{}",
                    help="JSON object: pointer arguments' types over SPARSE_MLA_POINTERS, e.g. {\"cache_ptr\": \"*u8\"}")
    args = ap.parse_args(argv)
    retyped = json.loads(args.pointers)
    if not isinstance(retyped, dict) or not all(isinstance(t, str) and t.startswith("*") for t in retyped.values()):
        raise ValueError(f"--pointers: expected a JSON object of pointer types like \"*u8\", got {args.pointers!r}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("the offline build needs triton's compiler: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    module, _, name = args.kernel.partition(":")
    fn = getattr(importlib.import_module(module), name)
    const = json.loads(args.constexprs)
    options = {key: const.pop(key) for key in ("num_warps", "num_stages") if key in const}  # launch options
    pointers = dict(SPARSE_MLA_POINTERS, **retyped)
    report = ptxas_report(compile_sm90(fn, const, pointers, options.pop("num_warps", 4), gluon=args.gluon, **options))
    ops = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", report.pop("sass"), re.M)
    print(json.dumps(dict(report, opcodes=dict(collections.Counter(ops)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
