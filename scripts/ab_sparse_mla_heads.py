"""sm_90's two sparse-MLA decode schedules side by side, in one process, on bench.fp8's decode inputs (GPU).

    python scripts/ab_sparse_mla_heads.py [--heads 16 32] [--batches 1 16 64 128] [--context 32768 ...] [--out F.json]
                                          [--schedules heads_n hopper] [--against FILE ...]
                                          [--rows selected none repeated]

At a few heads per token sparse_mla_paged runs dsv32ref.kernels.sparse_mla_heads_n (the keys as the MMA's M, the
heads as its N); dsv32ref.kernels.sparse_mla_hopper (64 heads a program on M) runs any head count too. Each is
launched here over the bf16 and the FP8 cache, with the top-k splits sparse_mla_paged would use and its merge of
them; every arm first runs on poisoned outputs and is checked against the float64 reference of a few tokens, then
the arms are timed interleaved (CUDA-graph replays, medians, caches rotated so that each call reads HBM).

`--against FILE` adds an arm per file: a copy of dsv32ref/kernels/sparse_mla_heads_n.py or sparse_mla_hopper.py
from another revision (`git show REV:dsv32ref/kernels/sparse_mla_heads_n.py > FILE`), named by the file's stem, its
sha256 and schedule in the output's provenance, so that a change to a kernel is timed against what it changes in
one process, from a clean commit. A copy imports what it shares from the tree's sparse_mla_hopper (a copy of
sparse_mla_heads_n.py: its bf16 producer among them), so a change to those helpers is not isolated by it.

`--rows` says what the top-k selects (ROWS): the decode's distinct random rows (read from HBM), no row at all
(every entry -1: no cache row is read, so a step costs what its compute and hand-offs do), or one row, each
request's first, in every top-k slot (every load an L2 hit). A step's time over selected rows against its time
over none shows how much of the loads the schedule hides behind its compute. "A step" is the time over the
programs' waves and their steps of 64 keys (`steps_and_waves`): with few steps a program (one request, or top-k
splits) it carries the launch, the set-up and the write-out too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import pathlib

import torch

from dsv32ref.bench.fp8 import decode_inputs, selects_nothing
from dsv32ref.bench.kernels import DEV, gather_rows, measure_ceilings, shapes, timed
from dsv32ref.checks import rel_err
from dsv32ref.kernels import sparse_mla, sparse_mla_heads_n, sparse_mla_hopper
from dsv32ref.provenance import provenance

ROWS = {"selected": "the decode's distinct random rows", "none": "every entry -1: no row is read",
        "repeated": "each request's first row, over and over: L2 hits"}
SCHEDULES = {"heads_n": sparse_mla_heads_n.sparse_mla_heads_n,  # the keys as the MMA's M, the heads as its N
             "hopper": sparse_mla_hopper.sparse_mla_hopper}  # 64 heads a program on M


def load_copy(path: str):
    """FILE, a copy of sparse_mla_heads_n.py or sparse_mla_hopper.py -> (its launcher, the file's sha256, the
    schedule it is a copy of)."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"--against: expected a copy of a kernel module, got {path!r}, which is not a file")
    spec = importlib.util.spec_from_file_location(f"against_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for schedule, launcher in (("heads_n", "sparse_mla_heads_n"), ("hopper", "sparse_mla_hopper")):
        kernel = getattr(module, launcher, None)
        if callable(kernel):
            return kernel, hashlib.sha256(file.read_bytes()).hexdigest(), schedule
    raise ValueError(f"--against {path}: expected a module defining sparse_mla_heads_n or sparse_mla_hopper, "
                     "found neither")


def rows_topk(mode: str, topk: torch.Tensor) -> torch.Tensor:
    """The top-k [T, K] a mode of ROWS selects, from the decode's own (distinct positions)."""
    if mode not in ROWS:
        raise ValueError(f"--rows: expected some of {list(ROWS)}, got {mode!r}")
    return topk if mode == "selected" else torch.full_like(topk, -1) if mode == "none" else torch.zeros_like(topk)


def call(kernel, q, cache, r, topk, scale, splits, out, lse):
    """kernel into out and lse as sparse_mla_paged launches it: fp32 partials and their merge with splits > 1."""
    outputs = sparse_mla._kernel_outputs(out, lse, splits)
    kernel(q, cache, r["block_table"], r["req"], r["seq_lens"], topk, scale, outputs, splits)
    if splits > 1:
        sparse_mla.merge_splits(outputs, out, lse)


def reference(q, bf16_cache, r, topk, scale, d_lat, tokens=4):
    """float64 out and lse of the first `tokens` tokens over the bf16 cache (the FP8 one dequantised); when no
    token selects a row (the none mode), out 0 and lse +inf."""
    if (topk < 0).all():
        T = min(tokens, q.shape[0])
        return (q.new_zeros(T, q.shape[1], d_lat, dtype=torch.float64),
                q.new_full((T, q.shape[1]), float("inf"), dtype=torch.float64))
    rows = gather_rows(bf16_cache, r["block_table"], topk[:tokens].long(), r["req"][:tokens]).double()
    s = torch.einsum("thd,tkd->thk", q[:tokens].double(), rows) * scale
    return torch.einsum("thk,tkd->thd", torch.softmax(s, -1), rows[..., :d_lat]), torch.logsumexp(s, -1)


def arms_on_m(kernels: dict, copies: dict) -> list[str]:
    """The arms that put 64 heads a program on M: the tree's hopper schedule and every copy of it, whatever the
    copy's name."""
    return [name for name in kernels if copies.get(name, {"schedule": name})["schedule"] == "hopper"]


def choose_arms(schedules: list[str], against: list[str]) -> tuple[dict, dict]:
    """The tree's schedules by name and each --against copy by its file's stem -> (name -> launcher, name ->
    {file, sha256, schedule} of the copies)."""
    kernels, copies = {name: SCHEDULES[name] for name in schedules}, {}
    for path in against:
        name = pathlib.Path(path).stem
        if name in kernels:
            raise ValueError(f"--against {path}: its arm's name {name!r} is taken; rename the file")
        kernels[name], sha256, schedule = load_copy(path)
        copies[name] = {"file": path, "sha256": sha256, "schedule": schedule}
    if not kernels:
        raise ValueError("--schedules and --against: expected at least one arm, got none")
    return kernels, copies


def check(out, lse, ref, ref_lse, tokens=4) -> tuple[float, bool]:
    """(relative error, ok): the first `tokens` tokens within 1e-2 of the reference and no output NaN; or, when no
    token selects a row (the reference's lse all +inf), every token's out exactly 0 and lse exactly +inf."""
    if torch.isposinf(ref_lse).all():
        ok = selects_nothing(out, lse)
        return 0.0 if ok else float("inf"), ok
    err = max(rel_err(out[:tokens], ref), rel_err(lse[:tokens], ref_lse))
    return err, err <= 1e-2 and not out.isnan().any().item()


def steps_and_waves(B: int, H: int, K: int, splits: int, heads_per_program: int, sms: int) -> tuple[int, int]:
    """(steps of BLOCK_N keys a program walks, waves of programs over the SMs) of a launch over B tokens of H heads
    and K top-k slots in `splits` splits: both sm_90 schedules walk sparse_mla_hopper.BLOCK_N keys a step and hold
    one program an SM (their shared memory)."""
    programs = B * -(-H // heads_per_program) * splits
    return -(-K // (sparse_mla_hopper.BLOCK_N.value * splits)), -(-programs // sms)


def case(z, B, H, ctx, ceil, kernels: dict, mode: str, on_m: list[str]) -> list[dict]:
    """Each of `kernels` (name -> launcher) over both caches at B decode tokens of H heads, ctx keys, the top-k
    selecting `mode`'s rows (ROWS): checked, timed. on_m names the arms that put 64 heads a program on M."""
    r = decode_inputs(z, B, ctx)
    d_lat, D, k = z["d_lat"], z["d_lat"] + z["rope"], r["topk"].shape[1]
    q = torch.randn(B, H, D, device=DEV, dtype=torch.bfloat16)
    scale = z["config"].softmax_scale
    topk = rows_topk(mode, r["topk"])
    distinct = {"selected": r["distinct"], "none": 0, "repeated": B}[mode]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = {f: sparse_mla.launch_plan(q, d_lat, k, None, sms, fp8=f == "fp8")[2] for f in ("bf16", "fp8")}
    ref, ref_lse = reference(q, r["caches"][0][0], r, topk, scale, d_lat)
    arms, rows = {}, []
    for name, kernel in kernels.items():
        for j, f in enumerate(("bf16", "fp8")):
            out = torch.full((B, H, d_lat), float("nan"), device=DEV, dtype=torch.bfloat16)
            lse = torch.full((B, H), float("nan"), device=DEV)
            fn = (lambda kernel=kernel, j=j, f=f, out=out, lse=lse:
                  call(kernel, q, r["caches"][r["rot"]()][j], r, topk, scale, splits[f], out, lse))
            r["rot"].i = -1
            fn()
            err, ok = check(out, lse, ref, ref_lse)
            arms[(name, f)] = fn
            rows.append(dict(kernel=name, cache=f, rows=mode, B=B, heads=H, context=ctx, splits=splits[f],
                             rel_err=err, ok=ok, bytes=distinct * (2 * D if f == "bf16" else 656)))
    times = {}
    for _ in range(2):  # interleaved: the second round is kept
        for key, fn in arms.items():
            r["rot"].i = -1
            times[key] = timed(fn)["ms"]
    for row in rows:
        row["us"] = times[(row["kernel"], row["cache"])] * 1e3
        heads = 64 if row["kernel"] in on_m else sparse_mla_heads_n.heads_per_program(H)
        steps, waves = steps_and_waves(B, H, k, row["splits"], heads, sms)
        row["us_per_step"] = row["us"] / (waves * steps)
        row["fraction_of_copy"] = row["bytes"] / (row["us"] * 1e3) / ceil["copy_GBps"]
        row["TFLOPs"] = 2 * B * H * k * (D + d_lat) / row["us"] / 1e6
    del r["caches"]
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--context", type=int, nargs="+", default=[32768])
    ap.add_argument("--schedules", nargs="*", choices=sorted(SCHEDULES), default=sorted(SCHEDULES))
    ap.add_argument("--against", nargs="+", default=[], metavar="FILE")
    ap.add_argument("--rows", nargs="+", default=["selected"],
                    help="what the top-k selects: " + "; ".join(f"{mode}, {what}" for mode, what in ROWS.items()))
    ap.add_argument("--out")
    args = ap.parse_args()
    for mode in args.rows:
        rows_topk(mode, torch.empty(0, dtype=torch.int32))  # refused before anything runs
    kernels, against = choose_arms(args.schedules, args.against)
    on_m = arms_on_m(kernels, against)
    torch.manual_seed(0)
    z = shapes("glm-5.2")
    ceil = measure_ceilings()
    print(f"copy {ceil['copy_GBps']:.0f} GB/s, bf16 GEMM {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s", flush=True)
    results = []
    for H, ctx, B, mode in itertools.product(args.heads, args.context, args.batches, args.rows):
        for row in case(z, B, H, ctx, ceil, kernels, mode, on_m):
            results.append(row)
            print(f"H={H:<3} ctx={ctx:<6} B={B:<4} {mode:<8} {row['kernel']:<10} {row['cache']:<5} splits "
                  f"{row['splits']:<2} {row['us']:8.1f} us ({row['us_per_step']:5.2f} a step)  "
                  f"{row['fraction_of_copy']:5.0%} of copy  {row['TFLOPs']:6.1f} TFLOP/s  err {row['rel_err']:.1e} "
                  f"ok={row['ok']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance() | {"against": against}, "ceilings": ceil, "results": results}, f,
                      indent=1)
    if not all(row["ok"] for row in results):
        raise SystemExit("an arm's result is wrong")


if __name__ == "__main__":
    main()
