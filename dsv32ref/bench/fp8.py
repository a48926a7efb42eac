"""The FP8 KV cache against the bf16 cache on one GPU: sparse MLA decode and the indexer's scores pass.

    python -m dsv32ref.bench.fp8 --out data/fp8_speed.json [--quick]
    python -m dsv32ref.bench.fp8 --sweep --out runs/fp8_sweep.json     (the FP8 decode's tiles, SWEEP_TILES)

Both caches hold the same values (the bf16 cache is the FP8 cache dequantised: an fp8 value times a power of two is
exact in bf16), so the two kernels compute the same function and are checked against each other (outputs poisoned
first). Decode: B requests of one token, each with its own ctx-token cache and index_topk random distinct visible
slots, at 16, 64 and 128 heads (a TP4, TP2 and TP1 rank of GLM-5.2/DeepSeek-V3.2's heads); the bytes each kernel
must read are its rows (1152 bf16, 656 FP8 per token) once each. The bf16 decode is also timed over a top-k that
selects nothing (no row read: its compute and hand-offs alone, and with top-k splits no partials either); where its
bytes at the copy rate take at least that long, the row says it is bound by its bytes, which is where the FP8 rows
must win. Indexer: B requests of one token at ctx keys, bf16 queries and keys (256 bytes a key) against fp8 queries
and DeepGEMM's FP8 keys (132 bytes). Caches smaller than 1 GiB rotate through copies (bench.kernels.Rotation), so
every timed call reads HBM. Times are CUDA-graph replays, medians; the copy bandwidth and GEMM rate are measured in
the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from dsv32ref.bench.kernels import (BLOCK_SIZE, COPIES, DEV, Rotation, Run, bench_graph, decode_batch, shapes, slots_of,
                                    start_run, timed)
from dsv32ref.cache import LATENT_ROW_BYTES
from dsv32ref.checks import rel_err
from dsv32ref.kernels import grid
from dsv32ref.kernels.indexer_topk import indexer_scores_paged
from dsv32ref.kernels.sparse_mla import kernel_choice, launch_plan, sparse_mla_paged
from dsv32ref.reference.fp8_cache import (dequantize_indexer_keys, dequantize_latent, quantize_indexer_keys,
                                          quantize_latent)
from dsv32ref.reference.numerics import fp8_dequantize, fp8_quantize
from dsv32ref.results import run_dir

BF16 = torch.bfloat16
CHUNK = 1 << 20  # tokens quantised at a time (bounds the fp32 temporaries)
DECODE_BATCHES, CONTEXTS, HEADS = (1, 16, 64, 128), (8192, 32768, 131072), (16, 64, 128)


def copies_for(nbytes: int) -> int:
    """Copies of a cache of nbytes that together pass 1 GiB (at most COPIES): each timed call reads HBM."""
    return max(1, min(COPIES, math.ceil((1 << 30) / nbytes)))


def latent_caches(n_tokens: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 [NB, BS, d], FP8 rows uint8 [NB, BS, 656]) holding the same values: random rows quantised, the
    bf16 cache their dequantisation."""
    nb = n_tokens // BLOCK_SIZE
    bf = torch.randn(nb, BLOCK_SIZE, d, device=DEV, dtype=BF16)
    rows = torch.empty(nb, BLOCK_SIZE, LATENT_ROW_BYTES, device=DEV, dtype=torch.uint8)
    flat_bf, flat_rows = bf.view(-1, d), rows.view(-1, LATENT_ROW_BYTES)
    for t0 in range(0, n_tokens, CHUNK):
        flat_rows[t0:t0 + CHUNK] = quantize_latent(flat_bf[t0:t0 + CHUNK])
        flat_bf[t0:t0 + CHUNK] = dequantize_latent(flat_rows[t0:t0 + CHUNK]).to(BF16)
    return bf, rows


def key_caches(n_tokens: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 keys [NB, BS, d], DeepGEMM's FP8 blocks uint8 [NB, BS, d + 4]) holding the same values."""
    nb = n_tokens // BLOCK_SIZE
    keys = torch.randn(nb, BLOCK_SIZE, d, device=DEV, dtype=BF16)
    blocks = torch.empty(nb, BLOCK_SIZE, d + 4, device=DEV, dtype=torch.uint8)
    per = max(1, CHUNK // BLOCK_SIZE)
    for b0 in range(0, nb, per):
        q = quantize_indexer_keys(keys[b0:b0 + per])  # (n, BS, 1, d + 4)
        blocks[b0:b0 + per] = q.view(-1, BLOCK_SIZE, d + 4)
        keys[b0:b0 + per] = dequantize_indexer_keys(q).to(BF16)
    return keys, blocks


def _fractions(r: dict, copy_GBps: float) -> dict:
    """r with each arm's bytes / time as a fraction of the copy bandwidth; for a decode row, also what bounds the
    bf16 decode: "bytes" where its bytes at the copy rate take at least as long as the same call over a top-k that
    selects nothing (its MMAs, softmax and hand-offs, no row read), else "compute"."""
    for f in ("bf16", "fp8"):
        r[f"fraction_of_copy_{f}"] = r[f"bytes_{f}"] / r[f"ms_{f}"] / 1e6 / copy_GBps
    if "ms_bf16_no_rows" in r:
        r["ms_bf16_bytes_at_copy"] = r["bytes_bf16"] / 1e6 / copy_GBps
        r["bf16_bound_by"] = "bytes" if r["ms_bf16_bytes_at_copy"] >= r["ms_bf16_no_rows"] else "compute"
    return r


def _speedup_row(kind: str, case: dict, t_bf: dict, t_fp8: dict, bytes_bf: float, bytes_fp8: float, ceil: dict) -> dict:
    row = dict(case, kernel=kind, ms_bf16=t_bf["ms"], ms_fp8=t_fp8["ms"], bytes_bf16=bytes_bf, bytes_fp8=bytes_fp8,
               speedup=t_bf["ms"] / t_fp8["ms"], timing_bf16=t_bf["timing"], timing_fp8=t_fp8["timing"])
    return _fractions(row, ceil["copy_GBps"])


def decode_inputs(z: dict, B: int, ctx: int) -> dict:
    """B requests of one token at ctx tokens each: their block tables, the bf16 and FP8 caches (copies of them,
    so that each timed call reads HBM), index_topk random distinct visible positions per request and the number
    of distinct rows they select."""
    d_lat, D, k = z["d_lat"], z["d_lat"] + z["rope"], z["k"]
    r = decode_batch(B, ctx)
    n = copies_for(r["nblocks"] * BLOCK_SIZE * D * 2)
    r["caches"] = [latent_caches(r["nblocks"] * BLOCK_SIZE, D) for _ in range(n)]
    r["topk"] = torch.rand(B, ctx, device=DEV).topk(min(k, ctx), dim=-1).indices.int()  # (B, k) distinct positions
    r["distinct"] = torch.unique(slots_of(r["block_table"], r["topk"].long(), r["req"])).numel()
    r["rot"] = Rotation(n)
    return r


def decode_calls(z: dict, r: dict, H: int, configs: dict | None = None) -> tuple[torch.Tensor, dict, dict, dict]:
    """q [B, H, D] and one sparse_mla_paged call per arm, each run once on poisoned outputs -> (q, calls, outs,
    lses). Arms: "bf16" and "fp8" (the library's choice of kernel and tiles), and one per entry of configs
    (name -> tile config over the FP8 cache); a config that fails to launch is said and left out."""
    B, d_lat, D = r["req"].shape[0], z["d_lat"], z["d_lat"] + z["rope"]
    arms = {"bf16": (0, None), "fp8": (1, None)} | {name: (1, cfg) for name, cfg in (configs or {}).items()}
    q = torch.randn(B, H, D, device=DEV, dtype=BF16)
    outs = {a: torch.empty(B, H, d_lat, device=DEV, dtype=BF16) for a in arms}
    lses = {a: torch.empty(B, H, device=DEV) for a in arms}
    rot = r["rot"]
    calls = {a: (lambda a=a, j=j, cfg=cfg: sparse_mla_paged(q, r["caches"][rot()][j], r["block_table"], r["req"],
                                                            r["seq_lens"], r["topk"], z["config"].softmax_scale,
                                                            outs[a], lses[a], config=cfg))
             for a, (j, cfg) in arms.items()}
    for a in list(calls):
        outs[a].fill_(float("nan"))
        rot.i = -1
        try:
            calls[a]()
        except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is a result of the sweep
            if a in ("bf16", "fp8"):
                raise
            print(f"  {a} {configs[a]}: {e!r:.160}", flush=True)
            del calls[a]
    return q, calls, outs, lses


def selects_nothing(out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Whether a sparse MLA result is that of tokens that select no key: every out exactly 0, every lse +inf."""
    return bool((out == 0).all().item() and torch.isposinf(lse).all().item())


def no_rows_call(z: dict, r: dict, q: torch.Tensor):
    """The bf16 decode of q over a top-k that selects nothing (every entry -1), run once and checked -> (the call,
    whether it gave out 0 and lse +inf exactly). Its time is what the decode costs besides its rows' bytes (and,
    with top-k splits, besides the fp32 partials, which an empty split neither writes nor the merge reads)."""
    B, H = q.shape[:2]
    none = torch.full_like(r["topk"], -1)
    out = torch.full((B, H, z["d_lat"]), float("nan"), device=DEV, dtype=BF16)
    lse = torch.full((B, H), float("nan"), device=DEV)

    def call():
        sparse_mla_paged(q, r["caches"][r["rot"]()][0], r["block_table"], r["req"], r["seq_lens"], none,
                         z["config"].softmax_scale, out, lse)

    r["rot"].i = -1
    call()
    return call, selects_nothing(out, lse)


def bench_decode(z: dict, B: int, ctx: int, heads: tuple, ceil: dict) -> list[dict]:
    """sparse_mla_paged decode at B requests x ctx tokens, each head count in `heads`, bf16 against FP8 rows."""
    d_lat, D, k = z["d_lat"], z["d_lat"] + z["rope"], z["k"]
    r = decode_inputs(z, B, ctx)
    rows = []
    for H in heads:
        q, calls, outs, lse = decode_calls(z, r, H)
        sms = grid.num_sms(q.device, None, "bench_fp8")
        plan = {f: launch_plan(q, d_lat, k, None, sms, fp8=f == "fp8") for f in calls}
        case = {"model": z["name"], "B": B, "context": ctx, "heads": H, "topk": k, "copies": r["rot"].n,
                "impl": {f: kernel_choice(q, d_lat, plan[f][2], None, fp8=f == "fp8")[0] for f in calls},
                "splits": {f: plan[f][2] for f in calls},
                "rel_err_fp8_vs_bf16": max(rel_err(outs["fp8"], outs["bf16"]), rel_err(lse["fp8"], lse["bf16"])),
                "flops": 2 * B * H * k * (D + d_lat)}
        calls["no_rows"], case["no_rows_ok"] = no_rows_call(z, r, q)
        case["ok"] = (case["rel_err_fp8_vs_bf16"] <= 1e-2 and not outs["fp8"].isnan().any().item()
                      and case["no_rows_ok"])
        t = {}
        for f in ("bf16", "fp8", "no_rows") * 2:  # interleaved: the second of each is kept
            r["rot"].i = -1
            t[f] = timed(calls[f])
        case["ms_bf16_no_rows"], case["timing_bf16_no_rows"] = t["no_rows"]["ms"], t["no_rows"]["timing"]
        rows.append(_speedup_row("sparse_mla_decode", case, t["bf16"], t["fp8"],
                                 r["distinct"] * D * 2 + _fixed(z, B, H),
                                 r["distinct"] * LATENT_ROW_BYTES + _fixed(z, B, H), ceil))
    del r["caches"]
    return rows


def _fixed(z: dict, B: int, H: int) -> int:
    """Bytes a decode call moves besides the cache rows: q, out, the indices, lse."""
    return 2 * B * H * (2 * z["d_lat"] + z["rope"]) + 4 * B * z["k"] + 4 * B * H


# The FP8 decode tiles tried by --sweep: heads per program, keys per step, warps, pipeline stages; each at the
# launcher's top-k split count and at four times it (more programs in flight per SM).
SWEEP_TILES = [dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=4 if bh <= 32 else 8, num_stages=st)
               for bh in (16, 64) for bn, st in ((32, 2), (32, 4), (64, 2), (64, 3))]
SWEEP_SHAPES = [(B, H) for B in (1, 32, 128) for H in (16, 128)]


def sweep_decode(run: Run, z: dict, ctx: int = 32768) -> None:
    """Every SWEEP_TILES config of the FP8 decode at each SWEEP_SHAPES (B, H), beside the library's bf16 and
    FP8 choices; each config checked against bf16 on poisoned outputs. Graph-replay medians into run.sweep."""
    d_lat = z["d_lat"]
    for B in sorted({B for B, _ in SWEEP_SHAPES}):
        r = decode_inputs(z, B, ctx)
        for H in [H for b, H in SWEEP_SHAPES if b == B]:
            q = torch.empty(B, H, 1, device=DEV, dtype=BF16)
            sms = grid.num_sms(q.device, None, "bench_fp8")
            configs = {}
            for i, tile in enumerate(SWEEP_TILES):
                auto = launch_plan(q, d_lat, z["k"], tile, sms, fp8=True)[2]
                for splits in sorted({auto, min(16, 4 * auto)}):
                    configs[f"tile{i}/s{splits}"] = dict(tile, NUM_SPLITS=splits)
            q, calls, outs, lses = decode_calls(z, r, H, configs)
            row_bytes = {"bf16": 2 * (d_lat + z["rope"])}  # every other arm reads the FP8 rows
            nbytes = {a: r["distinct"] * row_bytes.get(a, LATENT_ROW_BYTES) + _fixed(z, B, H) for a in calls}
            for a in calls:
                r["rot"].i = -1
                ms = bench_graph(calls[a])
                err = max(rel_err(outs[a], outs["bf16"]), rel_err(lses[a], lses["bf16"]))
                row = {"kernel": "sparse_mla_decode_sweep", "model": z["name"], "B": B, "context": ctx, "heads": H,
                       "arm": a, "config": configs.get(a), "ms": ms, "bytes": nbytes[a], "rel_err_vs_bf16": err,
                       "ok": err <= 1e-2 and not outs[a].isnan().any().item(),
                       "fraction_of_copy": nbytes[a] / ms / 1e6 / run.ceil["copy_GBps"] if ms else None}
                run.sweep.append(row)
                us = ms * 1e3 if ms else float("nan")
                print(f"sweep B={B:<3} H={H:<3} {a:<10} {str(row['config'] or ''):<80} {us:7.1f} us ok={row['ok']}",
                      flush=True)
            run.save()
        del r["caches"]
        torch.cuda.empty_cache()


def bench_scores(z: dict, B: int, ctx: int, ceil: dict) -> dict:
    """indexer_scores_paged for B decode tokens (one per request, at its last of ctx positions), as the engine
    runs it over each cache: bf16 queries and keys against fp8 queries (one scale per head, in the weights) and
    FP8 keys. The same values: the bf16 queries are the fp8 ones dequantised. Each request's keys are its own."""
    d, h = z["d_i"], z["h_i"]
    r = decode_batch(B, ctx)
    n = copies_for(r["nblocks"] * BLOCK_SIZE * d * 2)
    caches = [key_caches(r["nblocks"] * BLOCK_SIZE, d) for _ in range(n)]
    q8, q_scale = fp8_quantize(torch.randn(B, h, d, device=DEV), block=d)  # (B, h, d) fp8, (B, h, 1)
    w = torch.randn(B, h, device=DEV) * h ** -0.5
    queries = {"bf16": (fp8_dequantize(q8, q_scale, block=d).to(BF16), w), "fp8": (q8, w * q_scale[..., 0])}
    scores = {f: torch.empty(B, ctx, device=DEV) for f in ("bf16", "fp8")}
    rot = Rotation(n)
    calls = {f: (lambda f=f, j=j: indexer_scores_paged(*queries[f], caches[rot()][j], r["block_table"], r["req"],
                                                       r["positions"], d ** -0.5, scores[f], tokens=1))
             for j, f in enumerate(("bf16", "fp8"))}
    for f in calls:
        scores[f].fill_(float("nan"))
        rot.i = -1
        calls[f]()
    case = {"model": z["name"], "B": B, "context": ctx, "index_n_heads": h, "copies": n,
            "rel_err_fp8_vs_bf16": rel_err(scores["fp8"], scores["bf16"])}
    case["ok"] = case["rel_err_fp8_vs_bf16"] <= 1e-2 and not scores["fp8"].isnan().any().item()
    t = {}
    for f in ("bf16", "fp8", "bf16", "fp8"):
        rot.i = -1
        t[f] = timed(calls[f])
    fixed = 4 * B * h + 4 * B * ctx  # the weights, the scores written
    del caches
    return _speedup_row("indexer_scores", case, t["bf16"], t["fp8"], B * ctx * d * 2 + 2 * B * h * d + fixed,
                        B * ctx * (d + 4) + B * h * d + fixed, ceil)


def _line(r: dict) -> str:
    what = f"H={r['heads']}" if "heads" in r else f"H_I={r['index_n_heads']}"
    bound = f"  bf16 {r['bf16_bound_by']}-bound" if "bf16_bound_by" in r else ""
    return (f"{r['kernel']:<18} B={r['B']:<4} ctx={r['context']:<7} {what:<6} bf16 {r['ms_bf16'] * 1e3:8.1f} us "
            f"({r['fraction_of_copy_bf16']:4.0%} of copy)  fp8 {r['ms_fp8'] * 1e3:8.1f} us "
            f"({r['fraction_of_copy_fp8']:4.0%})  x{r['speedup']:.2f}{bound}  ok={r['ok']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default: runs/<UTC time>/fp8_speed.json (data/ is what was recorded)")
    ap.add_argument("--quick", action="store_true", help="two batch sizes, two contexts (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="only the FP8 decode's tiles (SWEEP_TILES) at SWEEP_SHAPES")
    args = ap.parse_args(argv)
    if (start := start_run()) is None:
        return 2
    run = Run(args.out or os.path.join(run_dir(), "fp8_speed.json"), start[1], start[0])
    z = shapes("glm-5.2")
    if args.sweep:
        sweep_decode(run, z)
        run.save(complete=True)
        return 0
    batches, contexts = ((1, 64), (8192, 131072)) if args.quick else (DECODE_BATCHES, CONTEXTS)
    for ctx in contexts:
        for B in batches:
            for r in bench_decode(z, B, ctx, HEADS, run.ceil):
                run.add(r, _line(r))
            r = bench_scores(z, B, ctx, run.ceil)
            run.add(r, _line(r))
            torch.cuda.empty_cache()
    status = run.finish()
    for r in run.results:  # against the copy rate finish() settled on
        _fractions(r, run.ceil["copy_GBps"])
    run.save(complete=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
