"""Benchmark every Triton kernel against its PyTorch path on one GPU, at DeepSeek-V3.2 and GLM-5.2 shapes.

    python -m dsv32ref.bench.kernels --out data/kernels.json [--quick]

For each case: check the kernel against the reference (outputs poisoned first), count the fewest bytes
and the FLOPs it must move/do, time the kernel and the PyTorch path (median of CUDA-event timings,
triton.testing.do_bench), and report the fraction of the bound that applies, using ceilings measured in
the same run (device-to-device copy bandwidth, bf16 GEMM rate). Writes JSON with a provenance block.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from dsv32ref.bench.linear import LINEAR_TILES, bench_projection, projection_line, projections
from dsv32ref.bench.moe import MOE_CASES, TILE_SWEEP, MoELayer, bench_moe, moe_line
from dsv32ref.checks import rel_err
from dsv32ref.config import ModelConfig
from dsv32ref.kernels.fused_norm_rope import _fused_norm_rope_kernel, fused_norm_rope
from dsv32ref.kernels import grid, sparse_mla_hopper
from dsv32ref.kernels.fused_q import _fused_q_kernel, fused_q
from dsv32ref.kernels.fused_moe import _down_kernel, _gate_up_kernel, _router_logits_kernel, default_tiles
from dsv32ref.kernels.indexer_topk import (_indexer_scores_kernel, _topk_compact_kernel, _topk_hist_kernel, _topk_kernel,
                                           indexer_scores_paged, topk_from_scores)
from dsv32ref.kernels.skinny_gemm import _skinny_gemm_kernel
from dsv32ref.kernels.sparse_mla import (DEFAULT_CONFIG, _combine_splits_kernel, _sparse_mla_kernel, kernel_choice,
                                         launch_plan, merge_splits, sparse_mla_paged)
from dsv32ref.provenance import provenance
from dsv32ref.results import run_dir, write_partial, write_result
from dsv32ref.reference import apply_rope, fp8_quantize, hadamard_transform, layer_norm, rms_norm
from dsv32ref.reference.rope import RotaryEmbedding

DEV = "cuda"
BF16 = torch.bfloat16
BLOCK_SIZE = 64  # paged-cache block (tokens)


def bench(fn, warmup=10, rep=40) -> float:
    """Median milliseconds over CUDA-event timings of eager calls (host launch cost included when it
    exceeds the kernel time: a small kernel then measures the Python launch path)."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, n_inner=10, warmup=10, rep=40) -> float | None:
    """Median milliseconds per call of `fn`, replayed from a CUDA graph holding n_inner calls: device time
    without host launch overhead. Inputs stay the same across the inner calls (warm L2 for small ones).
    None if `fn` cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n_inner):
                fn()
        ms = do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median") / n_inner
        del g
        return ms
    except Exception as e:  # noqa: BLE001 - report and fall back to eager timing
        print(f"graph capture failed ({e!r:.120}); eager timing only", flush=True)
        return None


def timed(fn, capturable: bool = True, n_inner: int = 10) -> dict:
    """{'ms': graph-replay time (eager if uncapturable), 'ms_eager': eager time, 'timing': how 'ms' was taken}.
    capturable=False: eager only, for a path that synchronises (a failed capture can leave the CUDA RNG and
    context unusable for what follows)."""
    eager = bench(fn)
    graph = bench_graph(fn, n_inner) if capturable else None
    return {"ms": graph if graph is not None else eager, "ms_eager": eager,
            "timing": "cuda-graph replay, median" if graph is not None else "eager, median"}


def graph_timed(fn, n_inner: int = 10) -> dict:
    """`timed` without the eager timing (the probes' many cases): graph replay, eager where capture fails."""
    graph = bench_graph(fn, n_inner)
    if graph is None:
        return {"ms": bench(fn), "timing": "eager, median"}
    return {"ms": graph, "timing": "cuda-graph replay, median"}


class Rotation:
    """Call i uses input copy i mod n: a graph of n_inner calls then reads n_inner different copies, so that a
    working set of 10 copies past the 50 MB L2 is read from HBM, as a layer's cache is in a real forward."""

    def __init__(self, n: int):
        self.n, self.i = n, -1

    def __call__(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


COPIES = 10  # = bench_graph's n_inner


def start_run() -> tuple[float, dict] | None:
    """A benchmark's start: None (said on stderr) without a CUDA GPU; else seeded, (start time, provenance)."""
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    torch.manual_seed(0)
    return time.time(), provenance()


# ---- ceilings --------------------------------------------------------------------------------------

def measure_copy(n: int = 1 << 30) -> dict:
    """The copy bandwidth: a device-to-device copy of n bytes (default 1 GiB: far past the 50 MB L2), read and
    written (2 n bytes a copy), median of 100."""
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src), rep=100)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "copy_bytes": 2 * n}


def measure_ceilings() -> dict:
    copy = measure_copy()
    m = 8192
    a, b = torch.randn(m, m, device=DEV, dtype=BF16), torch.randn(m, m, device=DEV, dtype=BF16)
    gemm_ms = bench(lambda: a @ b, rep=100)
    return {"copy_GBps": copy["copy_GBps"], "bf16_gemm_TFLOPs": 2 * m ** 3 / gemm_ms / 1e9,
            "copy_bytes": copy["copy_bytes"], "gemm_shape": [m, m, m]}


def roofline(flops: float, nbytes: float, ms: float, ceil: dict) -> dict:
    t_flop = flops / (ceil["bf16_gemm_TFLOPs"] * 1e12) * 1e3
    t_mem = nbytes / (ceil["copy_GBps"] * 1e9) * 1e3
    bound = "compute" if t_flop >= t_mem else "memory"
    floor = max(t_flop, t_mem)
    return {"flops": flops, "bytes": nbytes, "bound": bound, "floor_ms": floor, "fraction_of_bound": floor / ms,
            "fraction_of_compute": t_flop / ms, "fraction_of_memory": t_mem / ms,
            "achieved_TFLOPs": flops / ms / 1e9, "achieved_GBps": nbytes / ms / 1e6}


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Program p sums elements [p TILES BLOCK, (p + 1) TILES BLOCK) of x: TILES independent loads in flight."""
    base = tl.program_id(0) * (TILES * BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(TILES):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def bench_read_floor(nbytes: int, ceil: dict) -> dict:
    """What one kernel reading nbytes of bf16 from HBM (COPIES copies rotating, as the indexer's keys) takes
    under graph replay: the best of a few tilings. It prices the launch, ramp and tail that a kernel of that
    size pays whatever it computes; the scores pass is held to the copy rate of a 2 GiB copy."""
    n = nbytes // 2
    xs = [torch.randn(n, device=DEV, dtype=BF16) for _ in range(COPIES)]
    out = torch.empty(triton.cdiv(n, 1024), device=DEV)
    best = None
    for block, tiles, warps in ((4096, 4, 8), (8192, 2, 8), (2048, 8, 4), (4096, 8, 8)):
        rot = Rotation(COPIES)
        grid = (triton.cdiv(n, block * tiles),)
        fn = lambda: _read_kernel[grid](xs[rot()], out, n, BLOCK=block, TILES=tiles, num_warps=warps)
        ms = timed(fn)["ms"]
        if best is None or ms < best["ms"]:
            best = {"ms": ms, "block": block, "tiles": tiles, "num_warps": warps}
    return {"kernel": "read_floor", "bytes": nbytes, **best, "GBps": nbytes / best["ms"] / 1e6,
            "fraction_of_copy": nbytes / best["ms"] / 1e6 / ceil["copy_GBps"]}


# ---- shapes ----------------------------------------------------------------------------------------

def shapes(name: str) -> dict:
    c = ModelConfig.preset(name)
    return dict(name=name, config=c, H=c.num_attention_heads, d_lat=c.kv_lora_rank, rope=c.qk_rope_head_dim,
                q_lora=c.q_lora_rank, nope=c.qk_nope_head_dim, h_i=c.index_n_heads, d_i=c.index_head_dim,
                k=c.index_topk, interleaved=c.indexer_rope_interleave)


def one_request(ctx_len: int, T: int):
    """A request whose last T tokens are the query, with ctx_len tokens in a shuffled paged cache."""
    nblocks = -(-ctx_len // BLOCK_SIZE)
    table = torch.randperm(nblocks, device=DEV, dtype=torch.int32)[None, :]
    positions = torch.arange(ctx_len - T, ctx_len, device=DEV)
    return dict(nblocks=nblocks, block_table=table, seq_lens=torch.tensor([ctx_len], device=DEV, dtype=torch.int32),
                req=torch.zeros(T, device=DEV, dtype=torch.int32), positions=positions)


def decode_batch(B: int, ctx_len: int):
    """B requests of one query token each (their last position), each with ctx_len tokens of its own cache:
    no two tokens share a latent row, so every gathered row is an HBM read."""
    per = -(-ctx_len // BLOCK_SIZE)
    table = torch.randperm(B * per, device=DEV, dtype=torch.int32).view(B, per)
    return dict(nblocks=B * per, block_table=table, req=torch.arange(B, device=DEV, dtype=torch.int32),
                seq_lens=torch.full((B,), ctx_len, device=DEV, dtype=torch.int32),
                positions=torch.full((B,), ctx_len - 1, device=DEV))


def slots_of(table, pos, req=None):
    """Flat cache rows of positions pos [T, ...] of requests req [T] (default: request 0)."""
    blocks = table[0].long()[pos // BLOCK_SIZE] if req is None else table.long()[req.long().view(-1, *([1] * (pos.dim() - 1))), pos // BLOCK_SIZE]
    return blocks * BLOCK_SIZE + pos % BLOCK_SIZE


def gather_rows(cache, table, pos, req=None):
    """cache [NB, BS, D], positions [T, ...] of requests req [T] (default: request 0) -> rows [T, ..., D]."""
    return cache.view(-1, cache.shape[-1])[slots_of(table, pos, req)]


# ---- sparse_mla ------------------------------------------------------------------------------------

def torch_sparse_mla(q, cache, r, topk, scale, d_lat):
    rows = gather_rows(cache, r["block_table"], topk.long().clamp_min(0), r["req"])  # (T, k, 576)
    s = torch.matmul(q, rows.transpose(1, 2)).float() * scale  # (T, H, k)
    s = s.masked_fill((topk < 0)[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p.to(q.dtype), rows[..., :d_lat])


def ref_sparse_mla_chunked(q, cache, r, topk, scale, d_lat, chunk=128):
    out = torch.empty(q.shape[0], q.shape[1], d_lat, device=DEV, dtype=torch.float32)
    lse = torch.empty(q.shape[0], q.shape[1], device=DEV, dtype=torch.float32)
    for t0 in range(0, q.shape[0], chunk):
        sl = slice(t0, t0 + chunk)
        rows = gather_rows(cache, r["block_table"], topk[sl].long().clamp_min(0), r["req"][sl]).float()
        s = torch.einsum("thd,tkd->thk", q[sl].float(), rows) * scale
        s = s.masked_fill((topk[sl] < 0)[:, None, :], float("-inf"))
        lse[sl] = torch.logsumexp(s, -1)
        out[sl] = torch.einsum("thk,tkd->thd", torch.softmax(s, -1), rows[..., :d_lat])
    return out, lse


def bench_sparse_mla(z, T, ctx, ceil, config=None, check=True, torch_path=True, sort_indices=False, batch=False,
                     warp_specialized=False):
    """T tokens at the end of a ctx-token request (batch: T decode requests, decode_batch). `config`: tiles of
    the Triton kernel over its defaults (None: what the library picks; the result says which kernel and why).
    warp_specialized: sparse_mla_hopper (each consumer warpgroup 32 keys of a step) launched itself over the bf16
    rows, where the library runs sparse_mla_pairs, to time the two schedules. ceil None: no roofline (a run
    under a profiler)."""
    r = decode_batch(T, ctx) if batch else one_request(ctx, T)
    D = z["d_lat"] + z["rope"]
    cache = torch.randn(r["nblocks"], BLOCK_SIZE, D, device=DEV, dtype=BF16)
    q = torch.randn(T, z["H"], D, device=DEV, dtype=BF16)
    vis = r["positions"] + 1  # (T,)
    topk = (torch.rand(T, z["k"], device=DEV) * vis[:, None]).long().int()  # random visible keys (repeats possible)
    if sort_indices:
        topk = torch.sort(topk, dim=-1).values
    scale = z["config"].softmax_scale
    out = torch.empty(T, z["H"], z["d_lat"], device=DEV, dtype=BF16)
    lse = torch.empty(T, z["H"], device=DEV, dtype=torch.float32)
    run = lambda: sparse_mla_paged(q, cache, r["block_table"], r["req"], r["seq_lens"], topk, scale, out, lse,
                                   config)
    cfg, _, splits, _ = launch_plan(q, z["d_lat"], z["k"], config, grid.num_sms(q.device, None, "bench_sparse_mla"))
    impl, why = kernel_choice(q, z["d_lat"], splits, config)
    if warp_specialized:
        if impl != "sm_90 key pairs" or splits != 1:
            raise ValueError(f"bench_sparse_mla: warp_specialized times sparse_mla_hopper where the library runs "
                             f"sparse_mla_pairs without splits, here {impl} with {splits} split(s)")
        outputs = (out, out.stride(0), out.stride(1), lse, lse.stride(0))
        run = lambda: sparse_mla_hopper.sparse_mla_hopper(q, cache, r["block_table"], r["req"], r["seq_lens"], topk,
                                                          scale, outputs, 1)
        impl, why = "sm_90 warp-specialized", "32 keys a consumer warpgroup, launched by the benchmark"
    res = {"kernel": "sparse_mla", "impl": impl, "why": why, "model": z["name"], "T": T, "context": ctx,
           "topk": z["k"], "config": config or {}, "config_full": cfg, "splits": splits,
           "shape": "decode batch" if batch else "one request"}
    if check:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        run()
        ro, rl = ref_sparse_mla_chunked(q, cache, r, topk, scale, z["d_lat"])
        res["rel_err_out"], res["rel_err_lse"] = rel_err(out, ro), rel_err(lse, rl)
        res["ok"] = res["rel_err_out"] <= 1e-2 and res["rel_err_lse"] <= 1e-2 and not out.isnan().any().item()
    res.update(timed(run))
    flops = 2 * T * z["H"] * z["k"] * (D + z["d_lat"])
    # The fewest bytes: each distinct latent row once (tokens of one request share rows; L2 can serve the
    # repeats), plus q, out and the indices. The gathers themselves move every token's k rows to the SMs.
    distinct = torch.unique(slots_of(r["block_table"], topk.long(), r["req"])).numel()
    nbytes = 2 * (distinct * D + T * z["H"] * (D + z["d_lat"])) + 4 * T * z["k"]
    res["bytes_gathered"] = 2 * (T * z["k"] * D + T * z["H"] * (D + z["d_lat"])) + 4 * T * z["k"]
    if ceil is not None:
        res.update(**roofline(flops, nbytes, res["ms"], ceil))
    if torch_path and T * z["k"] * D * 2 <= 2.5e9:
        tp = timed(lambda: torch_sparse_mla(q, cache, r, topk, scale, z["d_lat"]))
        res.update(torch_ms=tp["ms"], torch_ms_eager=tp["ms_eager"])
    return res


def bench_combine(z, T, splits):
    """The split path's second launch alone: merge `splits` fp32 partial outputs per (token, head)."""
    H, d = z["H"], z["d_lat"]
    part_o = torch.randn(T, H, splits, d, device=DEV)
    part_lse = torch.randn(T, H, splits, device=DEV)
    out = torch.empty(T, H, d, device=DEV, dtype=BF16)
    lse = torch.empty(T, H, device=DEV)
    run = lambda: merge_splits((part_o, 0, 0, part_lse, 0), out, lse)
    res = {"kernel": "sparse_mla_merge", "model": z["name"], "T": T, "splits": splits, "probe": "splits"}
    res.update(timed(run))
    nbytes = part_o.numel() * 4 + part_lse.numel() * 4 + out.numel() * 2 + lse.numel() * 4
    res.update(bytes=nbytes, achieved_GBps=nbytes / res["ms"] / 1e6)
    return res


# ---- indexer top-k ---------------------------------------------------------------------------------

def lean_indexer_topk(q, w, keys, positions, scale, k):
    """The lean PyTorch path: keys already contiguous [S, D], bf16 einsum, relu, weighted sum, torch.topk."""
    logits = torch.einsum("thd,sd->ths", q, keys)  # (T, H_I, S) bf16
    scores = torch.bmm((w * scale).to(q.dtype)[:, None, :], torch.relu(logits))[:, 0]  # (T, S)
    if q.shape[0] > 1:  # causal (one decode token at the last position sees every key)
        scores = scores.masked_fill(torch.arange(keys.shape[0], device=DEV)[None, :] > positions[:, None], float("-inf"))
    return torch.topk(scores, min(k, keys.shape[0]), dim=-1).indices


def bench_indexer(z, T, ctx, ceil, torch_path=True, scores_kw=None, topk_kw=None, scores_only=False):
    """T query tokens at the end of a ctx-token request. COPIES copies of the key cache rotate (Rotation): the
    keys come from HBM. The scores pass is reported against the copy bandwidth of the same run, the top-k
    against its own bytes (the scores read once, the indices written)."""
    scores_fn, topk_fn = indexer_scores_paged, topk_from_scores
    r = one_request(ctx, T)
    icaches = [torch.randn(r["nblocks"], BLOCK_SIZE, z["d_i"], device=DEV, dtype=BF16) for _ in range(COPIES)]
    q = torch.randn(T, z["h_i"], z["d_i"], device=DEV, dtype=BF16)
    w = torch.randn(T, z["h_i"], device=DEV) * z["h_i"] ** -0.5
    scale = z["d_i"] ** -0.5
    scores = torch.empty(T, ctx, device=DEV)
    out = torch.empty(T, z["k"], device=DEV, dtype=torch.int32)
    rot = Rotation(COPIES)
    score = lambda: scores_fn(q, w, icaches[rot()], r["block_table"], r["req"], r["positions"], scale, scores,
                              **(scores_kw or {}))
    select = lambda: topk_fn(scores, r["positions"], out, **(topk_kw or {}))
    res = {"kernel": "indexer_scores" if scores_only else "indexer_topk", "model": z["name"], "T": T, "context": ctx,
           "topk": z["k"], "scores_kw": scores_kw or {}, "topk_kw": topk_kw or {}, "key_copies": COPIES}
    scores.fill_(float("nan"))
    out.fill_(-7)
    rot.i = -1
    score()
    select()
    keys = gather_rows(icaches[0], r["block_table"], torch.arange(ctx, device=DEV))  # (S, D) in position order
    worst, ok = 0.0, True
    for t0 in range(0, T, 64):
        sl = slice(t0, t0 + 64)
        ref = (w[sl, :, None] * torch.relu(torch.einsum("thd,sd->ths", q[sl].float(), keys.float()) * scale)).sum(1)
        ref = ref.masked_fill(torch.arange(ctx, device=DEV)[None, :] > r["positions"][sl, None], float("-inf"))
        vis = torch.isfinite(ref)
        worst = max(worst, rel_err(scores[sl][vis], ref[vis]))
        if scores_only:
            continue
        kth = torch.topk(ref, z["k"], dim=-1).values[:, -1:]
        sel = out[sl].long()
        slack = 2e-2 * ref.masked_fill(~vis, 0).abs().amax(-1, keepdim=True)
        ok &= bool((sel >= 0).all() and (ref.gather(1, sel.clamp_min(0)) >= kth - slack).all())
        ok &= bool((sel.diff(dim=-1) > 0).all())  # distinct, increasing
    res.update(rel_err_scores=worst, ok=ok and worst <= 1e-2)
    S_vis = float(r["positions"].float().add(1).sum())  # total (token, visible key) pairs
    key_bytes = 2 * ctx * z["d_i"]  # every key once (the tokens of one request share them)
    scores_bytes = key_bytes + 2 * T * z["h_i"] * z["d_i"] + 4 * T * z["h_i"] + 4 * S_vis
    t_scores = timed(score)
    res.update(ms_scores=t_scores["ms"], scores_bytes=scores_bytes,
               scores_GBps=scores_bytes / t_scores["ms"] / 1e6,
               scores_fraction_of_copy=scores_bytes / t_scores["ms"] / 1e6 / ceil["copy_GBps"])
    if scores_only:
        return res
    t_topk = timed(select)
    topk_bytes = 4 * S_vis + 4 * T * z["k"]
    res.update(ms_topk=t_topk["ms"], topk_bytes=topk_bytes, topk_GBps=topk_bytes / t_topk["ms"] / 1e6,
               topk_fraction_of_copy=topk_bytes / t_topk["ms"] / 1e6 / ceil["copy_GBps"])
    res.update(timed(lambda: (score(), select())))
    flops = 2 * z["h_i"] * z["d_i"] * S_vis
    nbytes = scores_bytes + 4 * T * z["k"]
    res.update(**roofline(flops, nbytes, res["ms"], ceil))
    if torch_path and T * ctx * z["h_i"] * 2 <= 4.3e9:
        res.update(_time_lean_indexer(q, w, icaches, r, scale, z["k"], ctx))
    return res


def _time_lean_indexer(q, w, icaches, r, scale, k, ctx) -> dict:
    """The lean PyTorch path on the same rotating key copies, gathered contiguous first (not timed)."""
    lean_keys = [gather_rows(c, r["block_table"], torch.arange(ctx, device=DEV)) for c in icaches]
    rot = Rotation(COPIES)
    tp = timed(lambda: lean_indexer_topk(q, w, lean_keys[rot()], r["positions"], scale, k))
    return {"torch_ms": tp["ms"], "torch_ms_eager": tp["ms_eager"],
            "torch_path": "lean: contiguous keys, bf16 einsum, relu, weighted sum (bmm), torch.topk"}


# ---- fused_norm_rope and fused_q -------------------------------------------------------------------

def bench_norm_rope(z, T, ceil):
    r = one_request(max(T, 4096), T)
    cos, sin = RotaryEmbedding(z["config"]).to(DEV)(torch.arange(r["positions"].max().item() + 1, device=DEV))
    f = dict(device=DEV, dtype=BF16)
    q_c, kv, ik = torch.randn(T, z["q_lora"], **f), torch.randn(T, z["d_lat"] + z["rope"], **f), torch.randn(T, z["d_i"], **f)
    wq, wkv, kw, kb = (torch.randn(n, **f) for n in (z["q_lora"], z["d_lat"], z["d_i"], z["d_i"]))
    q_out = torch.empty_like(q_c)
    latent = torch.empty(r["nblocks"], BLOCK_SIZE, z["d_lat"] + z["rope"], **f)
    icache = torch.empty(r["nblocks"], BLOCK_SIZE, z["d_i"], **f)
    slots = (r["block_table"][0].long()[r["positions"] // BLOCK_SIZE] * BLOCK_SIZE + r["positions"] % BLOCK_SIZE)
    run = lambda: fused_norm_rope(q_c, wq, q_out, kv, wkv, latent, r["positions"], slots, cos, sin, 1e-6,
                                  ik, kw, kb, icache, indexer_interleaved=z["interleaved"])

    def torch_path():
        c, s = cos[r["positions"]], sin[r["positions"]]
        qo = rms_norm(q_c, wq, 1e-6)
        row = torch.cat((rms_norm(kv[:, : z["d_lat"]], wkv, 1e-6), apply_rope(kv[:, z["d_lat"]:], c, s, True)), -1)
        latent.view(-1, row.shape[-1]).index_copy_(0, slots, row)
        k = layer_norm(ik, kw, kb, 1e-6)
        k = torch.cat((apply_rope(k[:, : z["rope"]], c, s, z["interleaved"]), k[:, z["rope"]:]), -1)
        icache.view(-1, k.shape[-1]).index_copy_(0, slots, k)
        return qo

    latent.fill_(float("nan"))
    icache.fill_(float("nan"))
    run()
    got_lat, got_idx = latent.view(-1, latent.shape[-1])[slots].clone(), icache.view(-1, z["d_i"])[slots].clone()
    got_q = q_out.clone()
    want_q = torch_path()
    res = {"kernel": "fused_norm_rope", "model": z["name"], "T": T,
           "rel_err": max(rel_err(got_q, want_q), rel_err(got_lat, latent.view(-1, latent.shape[-1])[slots]),
                          rel_err(got_idx, icache.view(-1, z["d_i"])[slots]))}
    res["ok"] = res["rel_err"] <= 1e-2 and not got_lat.isnan().any().item()
    res.update(timed(run))
    tp = timed(torch_path)
    nbytes = 2 * 2 * T * (z["q_lora"] + z["d_lat"] + z["rope"] + z["d_i"]) + 16 * T
    res.update(torch_ms=tp["ms"], torch_ms_eager=tp["ms_eager"],
               **roofline(10 * T * (z["q_lora"] + z["d_lat"] + z["d_i"]), nbytes, res["ms"], ceil))
    return res


def bench_fused_q(z, T, ceil, fp8=False):
    """fp8: deployed numerics, the indexer query Hadamard-rotated and quantised to fp8 (scale into the weights)."""
    f = dict(device=DEV, dtype=BF16)
    pos = torch.randint(0, 100_000, (T,), device=DEV)
    cos, sin = RotaryEmbedding(z["config"]).to(DEV)(torch.arange(100_000, device=DEV))
    q_lat, q = torch.randn(T, z["H"], z["d_lat"], **f), torch.randn(T, z["H"], z["nope"] + z["rope"], **f)
    # the weights as the engine passes them: weights_proj's columns of the A-projections' bf16 output
    q_idx, w = torch.randn(T, z["h_i"], z["d_i"], **f), torch.randn(T, z["d_i"] + z["h_i"], **f)[:, z["d_i"]:]
    q_mqa = torch.empty(T, z["H"], z["d_lat"] + z["rope"], **f)
    qi_out = torch.empty_like(q_idx, dtype=torch.float8_e4m3fn if fp8 else BF16)
    w_out = torch.empty(T, z["h_i"], device=DEV)
    run = lambda: fused_q(q_lat, q, q_mqa, pos, cos, sin, q_idx, qi_out, w, w_out, z["interleaved"])

    def torch_path():
        c, s = cos[pos], sin[pos]
        a = torch.cat((q_lat, apply_rope(q[..., z["nope"]:], c, s, True)), -1)
        b = torch.cat((apply_rope(q_idx[..., : z["rope"]], c, s, z["interleaved"]), q_idx[..., z["rope"]:]), -1)
        if fp8:
            b8, scale = fp8_quantize(hadamard_transform(b), block=z["d_i"])
            return a, b8, w.float() * z["h_i"] ** -0.5 * scale[..., 0]
        return a, b, w.float() * z["h_i"] ** -0.5

    q_mqa.fill_(float("nan"))
    qi_out.fill_(float("nan"))
    w_out.fill_(float("nan"))
    run()
    a, b, c = torch_path()
    res = {"kernel": "fused_q_fp8" if fp8 else "fused_q", "model": z["name"], "T": T}
    if fp8:  # fp8 values: equal to the reference's but for rare rounding flips (bounded in test_kernels.py)
        res["rel_err"] = max(rel_err(q_mqa, a), rel_err(w_out, c))
        res["fp8_equal_fraction"] = (qi_out.float() == b.float()).float().mean().item()
        res["ok"] = res["rel_err"] <= 1e-2 and res["fp8_equal_fraction"] >= 0.99
    else:
        res["rel_err"] = max(rel_err(q_mqa, a), rel_err(qi_out, b), rel_err(w_out, c))
        res["ok"] = res["rel_err"] <= 1e-2
    res.update(timed(run))
    tp = timed(torch_path, capturable=not fp8)  # the reference fp8 quantiser checks its input on the host
    out_i = 1 if fp8 else 2  # bytes per indexer-query element written
    nbytes = (2 * T * (z["H"] * (z["d_lat"] + z["rope"] + z["d_lat"] + z["rope"]) + z["h_i"] * z["d_i"])
              + out_i * T * z["h_i"] * z["d_i"] + 6 * T * z["h_i"] + 8 * T)  # weights: bf16 in, fp32 out
    flops = 6 * T * (z["H"] + z["h_i"]) * z["rope"] + (2 * T * z["h_i"] * z["d_i"] * (z["d_i"].bit_length() - 1) if fp8 else 0)
    res.update(torch_ms=tp["ms"], torch_ms_eager=tp["ms_eager"], **roofline(flops, nbytes, res["ms"], ceil))
    return res


# ---- compiler resource report ------------------------------------------------------------------------

def resource_report() -> list[dict]:
    rows = []
    for fn in (_sparse_mla_kernel, _combine_splits_kernel, _indexer_scores_kernel, _topk_kernel,
               _topk_hist_kernel, _topk_compact_kernel, _fused_norm_rope_kernel, _fused_q_kernel, _gate_up_kernel,
               _down_kernel, _router_logits_kernel, _skinny_gemm_kernel):
        caches = getattr(fn, "device_caches", {})
        for entry in caches.values():
            kernels = entry[0] if isinstance(entry, tuple) else entry
            for ck in kernels.values():
                try:
                    ck._init_handles()
                except Exception:  # noqa: BLE001 - best effort, report what exists
                    pass
                meta = getattr(ck, "metadata", None)
                ttgir = (getattr(ck, "asm", {}) or {}).get("ttgir", "")
                rows.append({"kernel": fn.__name__, "n_regs": getattr(ck, "n_regs", None),
                             "wgmma": "warp_group_dot" in ttgir, "cp_async": "async_copy_global_to_local" in ttgir,
                             "mma_v2": "#ttg.nvidia_mma<{versionMajor = 2" in ttgir,
                             "n_spills": getattr(ck, "n_spills", None),
                             "shared_bytes": getattr(meta, "shared", None), "num_warps": getattr(meta, "num_warps", None),
                             "num_stages": getattr(meta, "num_stages", None),
                             "constants": {k: v for k, v in (getattr(meta, "constants", {}) or {}).items()
                                           if isinstance(v, (int, str))} if meta is not None else None})
    return rows


SPARSE_CONFIGS = [  # the library's pick, then the Triton kernel at its default and other tiles
    {}, dict(DEFAULT_CONFIG), dict(BLOCK_N=32, num_stages=3), dict(BLOCK_N=32, num_stages=4),
    dict(BLOCK_N=16, num_stages=6), dict(num_warps=16), dict(num_stages=1),
]
INDEXER_CASES = [(ctx, T) for ctx in (4096, 32768, 131072) for T in (1, 16, 64, 256, 1024)]  # (context, tokens)
INDEXER_PROBE = (  # ((tokens, context), scores kwargs or top-k kwargs): one decode token
    [((1, 131072), dict(tiles=t, num_stages=st, num_warps=w)) for t in (2, 4) for st in (2, 3) for w in (4, 8)]
    + [((1, 32768), dict(tiles=1, num_stages=st)) for st in (2, 3)]
    + [((1, 131072), dict(chunk=ch, num_warps=w)) for ch in (2048, 4096, 8192) for w in (8, 16)]
    + [((1, 32768), dict(chunk=ch, num_warps=w)) for ch in (1024, 2048) for w in (4, 8, 16)])


class Run:
    """One benchmark run: its ceilings, its results, and a partial file after every case."""

    def __init__(self, out: str, prov: dict, t_start: float):
        self.out, self.prov, self.t_start = out, prov, t_start
        self.ceil = measure_ceilings()
        self.ceil_runs = [dict(self.ceil, when="start")]
        self.results, self.sweep = [], []
        print(f"ceilings: copy {self.ceil['copy_GBps']:.0f} GB/s, bf16 GEMM {self.ceil['bf16_gemm_TFLOPs']:.0f} "
              f"TFLOP/s", flush=True)

    def add(self, r: dict, line: str = "") -> dict:
        self.results.append(r)
        if line:
            print(line, flush=True)
        self.save()
        return r

    def save(self, complete: bool = False) -> None:
        out = {"provenance": self.prov, "ceilings": self.ceil, "ceilings_measured": self.ceil_runs,
               "sparse_mla_tile_sweep": self.sweep, "results": self.results, "resources": resource_report(),
               "wall_s": time.time() - self.t_start}
        (write_result if complete else write_partial)(self.out, out)

    def finish(self) -> int:
        """The ceilings again (the GEMM rate moves with clocks and temperature: every case is held to the higher
        of the two, the conservative roof), the fractions recomputed, the result written."""
        end = measure_ceilings()
        self.ceil_runs.append(dict(end, when="end"))
        self.ceil = dict(self.ceil, copy_GBps=max(self.ceil["copy_GBps"], end["copy_GBps"]),
                         bf16_gemm_TFLOPs=max(self.ceil["bf16_gemm_TFLOPs"], end["bf16_gemm_TFLOPs"]))
        for r in self.results + self.sweep:
            if "flops" in r and "ms" in r:
                r.update(roofline(r["flops"], r["bytes"], r["ms"], self.ceil))
            for part in ("scores", "topk"):
                if f"{part}_GBps" in r:
                    r[f"{part}_fraction_of_copy"] = r[f"{part}_GBps"] / self.ceil["copy_GBps"]
        self.save(complete=True)
        print(f"ceilings at the end: copy {end['copy_GBps']:.0f} GB/s, bf16 GEMM {end['bf16_gemm_TFLOPs']:.0f} "
              f"TFLOP/s; fractions against the higher", flush=True)
        return 0 if all(r.get("ok", True) for r in self.results) else 1


def _sparse_line(r: dict) -> str:
    return (f"sparse_mla {r['model']} {r['shape']} T={r['T']}: {r['impl']} ({r['why']}), {r['ms']:.3f} ms, "
            f"{r['fraction_of_compute']:.0%} of the GEMM rate, ok={r.get('ok')}")


def _indexer_line(r: dict) -> str:
    topk = f", top-k {r['ms_topk'] * 1e3:.1f} us" if "ms_topk" in r else ""
    return (f"indexer {r['model']} T={r['T']} ctx={r['context']} {r['scores_kw'] or r['topk_kw'] or ''}: scores "
            f"{r['ms_scores'] * 1e3:.1f} us ({r['scores_fraction_of_copy']:.0%} of copy){topk}; lean PyTorch "
            f"{(r.get('torch_ms') or float('nan')) * 1e3:.1f} us; ok={r['ok']}")


def probe_compare(run: Run, models, configs) -> None:
    """sparse_mla under each config at 64, 128 and 512 tokens of one request and a 64-request decode batch."""
    for z in models:
        for T, batch in ((64, False), (128, False), (512, False), (64, True)):
            for cfg in configs:
                r = bench_sparse_mla(z, T, 32768, run.ceil, config=cfg, torch_path=False, batch=batch)
                run.add(dict(r, probe="compare"), _sparse_line(r))


def probe_indexer(run: Run, models) -> None:
    """How a scores program walks its keys, and which top-k path few rows take (INDEXER_PROBE)."""
    for (T, ctx), kw in INDEXER_PROBE:
        r = bench_indexer(models[0], T, ctx, run.ceil, torch_path=False, scores_only="chunk" not in kw,
                          **({"topk_kw": kw} if "chunk" in kw else {"scores_kw": kw}))
        run.add(dict(r, probe="indexer"), _indexer_line(r))


def probe_splits(run: Run, models) -> None:
    """What splitting the top-k costs when the programs would not fill the GPU, and the merge launch alone."""
    for z in models:
        for batch in (False, True):
            for splits in (1, 2, 4, 8):
                r = bench_sparse_mla(z, 64, 32768, run.ceil, config={"NUM_SPLITS": splits}, torch_path=False,
                                     batch=batch)
                run.add(dict(r, probe="splits"), _sparse_line(r))
        for splits in (2, 4, 8):
            run.add(bench_combine(z, 64, splits))


def tile_sweep(run: Run, z, sort_probe: bool = False) -> dict:
    """sparse_mla at 512 tokens under each SPARSE_CONFIGS entry; returns the fastest correct Triton config."""
    for cfg in SPARSE_CONFIGS:
        try:
            r = bench_sparse_mla(z, 512, 32768, run.ceil, config=cfg, torch_path=False)
        except Exception as e:  # noqa: BLE001 - a tile that fails to compile is a result too
            r = {"kernel": "sparse_mla", "model": z["name"], "config": cfg, "error": repr(e)[:300]}
        run.sweep.append(r)
        run.save()
        print(f"sweep {z['name']} {cfg}: {r.get('ms', float('nan')):.3f} ms ({r.get('impl')}) ok={r.get('ok')}",
              flush=True)
    good = [r for r in run.sweep if r["model"] == z["name"] and r.get("ok") and r["impl"] == "triton" and r["config"]]
    best = min(good, key=lambda r: r["ms"])["config"] if good else dict(DEFAULT_CONFIG)
    if sort_probe:  # does gather locality matter? the same work with each token's indices sorted
        r = bench_sparse_mla(z, 512, 32768, run.ceil, config=best, torch_path=False, sort_indices=True)
        run.sweep.append(dict(r, probe="sorted top-k indices"))
    return best


def sparse_mla_cases(run: Run, z, quick: bool) -> None:
    """What the library runs at each size, and beside it the Triton kernel where the library picked sm_90's, and the
    warp-specialized kernel where it picked the pair kernel (the schedule the pair kernel replaced)."""
    cases = [(T, False) for T in ([1, 64, 512] if quick else [1, 8, 64, 128, 256, 512, 2048, 8192])] + \
        [(T, True) for T in ([64] if quick else [8, 64, 128])]
    for T, batch in cases:
        ctx = 32768 if T < 8192 else 65536
        r = run.add(bench_sparse_mla(z, T, ctx, run.ceil, torch_path=not batch, batch=batch))
        print(_sparse_line(r), flush=True)
        if r["impl"] != "triton":
            t = bench_sparse_mla(z, T, ctx, run.ceil, config=dict(DEFAULT_CONFIG), torch_path=False, batch=batch)
            run.add(dict(t, probe="the Triton kernel"), "  " + _sparse_line(t))
        if r["impl"] == "sm_90 key pairs" and r["splits"] == 1:  # the schedule it replaced, on the same inputs
            w = bench_sparse_mla(z, T, ctx, run.ceil, torch_path=False, warp_specialized=True)
            run.add(dict(w, probe="the warp-specialized kernel"), "  " + _sparse_line(w))


def indexer_cases(run: Run, z, quick: bool) -> None:
    cases = [(c, t) for c, t in INDEXER_CASES if c <= 32768 and t in (1, 64)] if quick else INDEXER_CASES
    for ctx, T in cases:
        r = bench_indexer(z, T, ctx, run.ceil)
        run.add(r, _indexer_line(r))


def fused_cases(run: Run, z, quick: bool) -> None:
    for T in ([1, 1024] if quick else [1, 64, 1024, 8192]):
        run.add(bench_norm_rope(z, T, run.ceil))
        run.add(bench_fused_q(z, T, run.ceil))
        run.add(bench_fused_q(z, T, run.ceil, fp8=True))


def _moe_layers(cases):
    """(MoELayer, [T, ...]) for each (model, experts) of cases, one layer's weights on the GPU at a time (the
    caller keeps no reference past its loop body)."""
    for model, experts in dict.fromkeys((m, e) for m, e, _ in cases):
        torch.cuda.empty_cache()
        yield MoELayer(model, experts), [T for m, e, T in cases if (m, e) == (model, experts)]


def moe_cases(run: Run, quick: bool) -> None:
    cases = [c for c in MOE_CASES if c[2] == 8] if quick else MOE_CASES
    for layer, Ts in _moe_layers(cases):
        for T in Ts:
            r = bench_moe(layer, T, timed)
            run.add(r, moe_line(r))
        del layer


def probe_moe_tiles(run: Run) -> None:
    """fused_moe with each TILE_SWEEP entry for one of its grouped GEMMs (the other at its default), at the TTFT
    protocol's reduced MoE and a served model's 256 experts, decode-sized steps."""
    cases = [("glm-5.2", "reduced", 8), ("glm-5.2", "full", 8), ("glm-5.2", "full", 64),
             ("deepseek-v3.2", "reduced", 8)]
    up0, down0 = default_tiles(16)  # every case is decode-sized: blocks of 16 pairs
    for layer, Ts in _moe_layers(cases):
        for T in Ts:
            r = bench_moe(layer, T, graph_timed)
            run.add(dict(r, probe="moe tiles: default"), moe_line(r))
            for which, t in TILE_SWEEP:
                tiles = (t, down0) if which == "gate_up" else (up0, t)
                try:
                    r = dict(bench_moe(layer, T, graph_timed, tiles), probe=f"moe tiles: {which}")
                except Exception as e:  # noqa: BLE001 - a tile that fails to compile is a result too
                    r = {"kernel": "fused_moe", "model": layer.model, "experts": layer.experts, "T": T,
                         "probe": f"moe tiles: {which}", "tiles": dataclasses.asdict(t), "error": repr(e)[:300]}
                run.add(r, moe_line(r) if "ms" in r else f"fused_moe {which} {t}: {r['error'][:120]}")
        del layer


def linear_cases(run: Run, quick: bool) -> None:
    """The attention's projections at 1 and 8 tokens: skinny_gemm at its default tiles beside torch's GEMMs."""
    for model in (["glm-5.2"] if quick else ["deepseek-v3.2", "glm-5.2"]):
        for p in projections(model):
            for T in (1, 8):
                r = bench_projection(model, p, T, timed)
                run.add(r, projection_line(r))


def probe_linear_tiles(run: Run) -> None:
    """skinny_gemm under each LINEAR_TILES entry at GLM-5.2's attention projections, 8 tokens."""
    for p in projections("glm-5.2"):
        if p.name == "lm_head":
            continue
        for tiles in LINEAR_TILES:
            try:
                r = dict(bench_projection("glm-5.2", p, 8, graph_timed, tiles), probe="linear tiles")
            except Exception as e:  # noqa: BLE001 - a tile that fails to compile is a result too
                r = {"kernel": "skinny_gemm", "projection": p.name, "tiles": tiles, "probe": "linear tiles",
                     "error": repr(e)[:300]}
            run.add(r, projection_line(r) if "ms" in r else f"skinny_gemm {p.name} {tiles}: {r['error'][:120]}")


def print_table(results: list[dict]) -> None:
    print(f"\n{'kernel':<16}{'model':<15}{'T':>6}{'ctx':>8}{'ms':>9}{'eager':>9}{'torch':>9}{'bound':>8}{'frac':>7}"
          f"{'cmp':>7}  ok  impl")
    for r in results:
        if "fraction_of_bound" not in r:
            continue
        print(f"{r['kernel']:<16}{r['model']:<15}{r['T']:>6}{r.get('context', ''):>8}{r['ms']:>9.4f}{r['ms_eager']:>9.4f}"
              f"{r.get('torch_ms') or float('nan'):>9.4f}{r['bound']:>8}{r['fraction_of_bound']:>7.1%}"
              f"{r['fraction_of_compute']:>7.1%}  {r.get('ok')}  {r.get('impl', '')}")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default: runs/<UTC time>/kernels.json (data/ is what was recorded)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--sweep-only", action="store_true", help="only the sparse_mla tile sweep (and a sorted-index probe)")
    ap.add_argument("--splits-probe", action="store_true",
                    help="only sparse_mla at 64 tokens with 1, 2, 4, 8 top-k splits, and the merge launch alone")
    ap.add_argument("--indexer-probe", action="store_true",
                    help="only the indexer at one decode token (32k, 128k context): the scores pass's tiles per "
                         "program, stages and warps; the top-k's chunk length and warps")
    ap.add_argument("--indexer-only", action="store_true", help="only the indexer (scores + top-k) cases")
    ap.add_argument("--linear-probe", action="store_true",
                    help="only skinny_gemm: each tiling at GLM-5.2's attention projections, 8 tokens")
    ap.add_argument("--moe-probe", action="store_true",
                    help="only fused_moe: each grouped GEMM's tiles (the other's at the default) at decode-sized steps")
    ap.add_argument("--compare", metavar="JSON",
                    help="only sparse_mla: each config of this JSON list (over the defaults) at 64, 128 and 512 tokens "
                         "of one request and a 64-request decode batch, both models")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    if (start := start_run()) is None:
        return 2
    run = Run(args.out or os.path.join(run_dir(), "kernels.json"), start[1], start[0])
    models = [shapes("deepseek-v3.2"), shapes("glm-5.2")]
    if args.compare or args.indexer_probe or args.splits_probe or args.moe_probe or args.linear_probe:
        if args.moe_probe:
            probe_moe_tiles(run)
        if args.linear_probe:
            probe_linear_tiles(run)
        if args.compare:
            probe_compare(run, models, json.loads(args.compare))
        if args.indexer_probe:
            probe_indexer(run, models)
        if args.splits_probe:
            probe_splits(run, models)
        run.save(complete=True)
        return 0 if all(r.get("ok", True) for r in run.results) else 1
    for z in models:
        if not args.indexer_only:
            tile_sweep(run, z, sort_probe=args.sweep_only)
        if args.sweep_only:
            continue
        if not args.indexer_only:
            sparse_mla_cases(run, z, args.quick)
        indexer_cases(run, z, args.quick)
        if not args.indexer_only:
            fused_cases(run, z, args.quick)
    if not (args.indexer_only or args.sweep_only):
        moe_cases(run, args.quick)
        linear_cases(run, args.quick)
    status = run.finish()
    print_table(run.results)
    return status


if __name__ == "__main__":
    sys.exit(main())
