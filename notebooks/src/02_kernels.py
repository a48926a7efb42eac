# %% [markdown]
# # The Triton kernels of the sparse path, checked and measured
#
# vLLM's pull request "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region" keeps the indexer and the sparse
# attention eager and moves the rest of the attention's small kernels into CUDA graphs. These are those
# kernels. DeepSeek-V3.2's attention needs four kinds of GPU work besides the GEMMs: per-token normalisation,
# rotation and cache writes; query assembly; the indexer's scores and top-k; and sparse attention over
# the top-k. `dsv32ref.kernels` has one Triton kernel (or a pair) for each:
#
# | kernel | what it fuses | launches per layer | graph-safe |
# |---|---|---|---|
# | `fused_norm_rope` | RMSNorm(q_c); RMSNorm(c_kv) + interleaved RoPE(k_pe) + latent-cache write; LayerNorm + RoPE + indexer-cache write | 1 | yes |
# | `fused_q` | RoPE(q_pe) + MQA query assembly [q̃ ∣ q_pe]; indexer-query RoPE; indexer weights × H_I^-½ (deployed numerics: + Hadamard, fp8 e4m3, scale folded into the weights) | 1 | yes |
# | `indexer_topk` | scores Σ_h w·ReLU(q·k) over the paged key cache, then a radix-select top-k (one launch; five for few long rows: four radix passes over all chunks, then a compaction, chained by programmatic dependent launch) | 2 or 6 | yes |
# | `sparse_mla` | gather the top-k latent rows, QKᵀ, online softmax, PV, lse (+ a combine launch when split) | 1–2 | yes |
#
# Graph-safe means: grids depend only on shapes, sequence lengths and block tables are read on the
# device, outputs go to caller-owned buffers. This notebook runs each kernel against the PyTorch
# reference on a small shape (interpreted on a CPU, compiled on a GPU), then plots what the H200
# measured (`data/kernels.json`; the indexer's rows from `data/indexer_ab.json`).

# %%
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # run the Triton kernels on CPU tensors

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from dsv32ref import AttentionMetadata, ModelConfig
from dsv32ref.cache import gather_tokens
from dsv32ref.kernels import fused_norm_rope, fused_q, indexer_topk_paged, sparse_mla_paged
from dsv32ref.reference import (apply_rope, fp8_quantize, hadamard_transform, indexer_scores, layer_norm, rms_norm,
                                sparse_mla, topk_indices)
from dsv32ref.reference.rope import RotaryEmbedding
from dsv32ref.report import OKABE_ITO, GREY, show, table
from dsv32ref.testing import compare

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


# A small shape that is legal for compiled kernels too (tensor-core tiles need dims >= 16).
H, D_LAT, ROPE, Q_LORA, NOPE, H_I, D_I, K, BS = 16, 64, 16, 96, 32, 16, 32, 24, 8
config = ModelConfig.preset("tiny-deepseek-v3.2").replace(qk_rope_head_dim=ROPE, index_head_dim=D_I)
cos, sin = RotaryEmbedding(config).to(device)(torch.arange(256, device=device))
meta = AttentionMetadata.build(context_lens=[40, 0], query_lens=[3, 30],
                               block_tables=[[5, 0, 7, 2, 9, 11], [1, 3, 4, 6]], block_size=BS, device=device)
T = meta.num_tokens
f = dict(device=device, dtype=torch.float32)
print("query tokens:", T, " sequence lengths:", meta.seq_lens_cpu)


def check(name, got, want, tol=64, row_dims=1):
    """Per element, against the reference (dsv32ref.testing.compare): fp32 within `tol` units of 2^-23."""
    c = compare(name, got, want, dtype=got.dtype, rtol=tol, atol=tol, row_dims=row_dims)
    print(f"{name:<21}: {'matches' if c.ok else 'DIFFERS'} ({got.numel()} values, {c.rows} rows, {tol} eps)")
    return c.ok

# %% [markdown]
# ## `fused_norm_rope`: one launch per layer for every per-token step after the A-projections
# The q_c output is filled with NaN first, the caches hold stale rows: anything the kernel forgets to
# write fails the check.

# %%
q_c, kv, k_idx_raw = torch.randn(T, Q_LORA, **f), torch.randn(T, D_LAT + ROPE, **f), torch.randn(T, D_I, **f)
w_q, w_kv = 1 + 0.1 * torch.randn(Q_LORA, **f), 1 + 0.1 * torch.randn(D_LAT, **f)
k_w, k_b = 1 + 0.1 * torch.randn(D_I, **f), 0.1 * torch.randn(D_I, **f)
q_c_out = torch.full_like(q_c, float("nan"))
# Request 0 has 40 tokens of earlier context: random rows stand in for them; this step's slots must be
# overwritten with exactly the reference values.
latent = torch.randn(12, BS, D_LAT + ROPE, **f)
index_cache = torch.randn(12, BS, D_I, **f)
fused_norm_rope(q_c, w_q, q_c_out, kv, w_kv, latent, meta.positions, meta.slot_mapping, cos, sin, 1e-6,
                k_idx_raw, k_w, k_b, index_cache, indexer_interleaved=False)
c, s = cos[meta.positions], sin[meta.positions]
want_latent = torch.cat((rms_norm(kv[:, :D_LAT], w_kv, 1e-6), apply_rope(kv[:, D_LAT:], c, s, True)), -1)
k_ln = layer_norm(k_idx_raw, k_w, k_b, 1e-6)
want_index = torch.cat((apply_rope(k_ln[:, :ROPE], c, s, False), k_ln[:, ROPE:]), -1)
slots = meta.slot_mapping
check("q_c normalised", q_c_out, rms_norm(q_c, w_q, 1e-6))
check("latent rows written", latent.view(-1, D_LAT + ROPE)[slots], want_latent)
check("indexer keys written", index_cache.view(-1, D_I)[slots], want_index)

# %% [markdown]
# ## `fused_q`: the MQA query [q̃ | RoPE(q_pe)] and the indexer query, one launch

# %%
q_lat, q = torch.randn(T, H, D_LAT, **f), torch.randn(T, H, NOPE + ROPE, **f)
q_idx_raw, w_raw = torch.randn(T, H_I, D_I, **f), torch.randn(T, H_I, **f)
q_mqa = torch.full((T, H, D_LAT + ROPE), float("nan"), **f)
q_idx, w_idx = torch.full_like(q_idx_raw, float("nan")), torch.full_like(w_raw, float("nan"))
fused_q(q_lat, q, q_mqa, meta.positions, cos, sin, q_idx_raw, q_idx, w_raw, w_idx, indexer_interleaved=False)
want_q = torch.cat((q_lat, apply_rope(q[..., NOPE:], c, s, True)), -1)
want_qi = torch.cat((apply_rope(q_idx_raw[..., :ROPE], c, s, False), q_idx_raw[..., ROPE:]), -1)
check("MQA query", q_mqa, want_q, row_dims=2)
check("indexer q", q_idx, want_qi, row_dims=2)
check("weights", w_idx, w_raw * H_I ** -0.5, tol=2)

# %% [markdown]
# Under deployed numerics (DeepSeek's inference code) the indexer query is also rotated by a Hadamard
# transform and stored as fp8 e4m3 with one power-of-two (ue8m0) scale per head; the scale moves into the
# head's weight, which is exact because ReLU(s q·k) = s ReLU(q·k) for s > 0. The kernel does this when
# its output tensor is fp8. The reference is `fp8_quantize(hadamard_transform(RoPE(q)))`.

# %%
q_idx8, w_idx8 = torch.empty(T, H_I, D_I, device=device, dtype=torch.float8_e4m3fn), torch.empty_like(w_raw)
fused_q(q_lat, q, q_mqa, meta.positions, cos, sin, q_idx_raw, q_idx8, w_raw, w_idx8, indexer_interleaved=False)
want8, want_scale = fp8_quantize(hadamard_transform(want_qi), block=D_I)
print("fp8 values equal the reference's :", f"{(q_idx8.float() == want8.float()).float().mean().item():.1%}")
print("scales folded into the weights   :", torch.equal(w_idx8, w_raw * H_I ** -0.5 * want_scale[..., 0]))

# %% [markdown]
# ## `indexer_topk`: scores without the [T, H_I, S] intermediate, then a radix select
# The kernel returns the selected positions in increasing order (a set); the reference sorts by score.
# Same set, same -1 padding.

# %%
scores = torch.full((T, 64), float("nan"), device=device)
topk = torch.full((T, K), -7, dtype=torch.int32, device=device)
indexer_topk_paged(q_idx, w_idx, index_cache, meta.block_table, meta.req_indices, meta.positions, D_I ** -0.5,
                   scores, topk)
same_scores, same_sets = True, True
for b in range(meta.num_reqs):
    t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
    keys = gather_tokens(index_cache, meta.block_table[b], meta.seq_lens_cpu[b])
    ref = indexer_scores(q_idx[t0:t1].double(), keys.double(), w_idx[t0:t1].double(), D_I ** -0.5)
    # products of both signs cancel (in q.k and across heads): the error bound is the same sum over |terms|
    mag = indexer_scores(q_idx[t0:t1].double().abs(), keys.double().abs(), w_idx[t0:t1].double().abs(), D_I ** -0.5)
    ref_topk = topk_indices(ref, meta.positions[t0:t1], K)
    for i, t in enumerate(range(t0, t1)):
        n = int(meta.positions[t]) + 1
        same_scores &= bool(((scores[t, :n].double() - ref[i, :n]).abs() <= 1e-5 * mag[i, :n]).all())
        same_sets &= sorted(topk[t].tolist()) == sorted(ref_topk[i].tolist())
print("scores match the reference:", same_scores)
print("top-k sets match          :", same_sets)
print("selected per query (request 1, first 8 tokens):", (topk[3:11] >= 0).sum(1).tolist())

# %% [markdown]
# ## `sparse_mla`: attention over the selected latent rows
# One program per (token, block of heads) loads each gathered row once for all its heads and uses it
# twice: in QKᵀ (576 values) and as V (the first 512). With few query tokens the top-k is split across
# programs and merged by a second launch (flash-decoding); both paths are checked.

# %%
out = torch.full((T, H, D_LAT), float("nan"), **f)
lse = torch.full((T, H), float("nan"), device=device)
ok = {}
for splits in (1, 4):
    out.fill_(float("nan"))
    sparse_mla_paged(q_mqa, latent, meta.block_table, meta.req_indices, meta.seq_lens, topk, 0.2, out, lse,
                     config={"NUM_SPLITS": splits}, valid_first=True)
    good = True
    for b in range(meta.num_reqs):
        t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        rows = gather_tokens(latent, meta.block_table[b], meta.seq_lens_cpu[b])
        ref_o, ref_lse = sparse_mla(q_mqa[t0:t1].double(), rows.double(), topk[t0:t1], 0.2, D_LAT)
        good &= compare("out", out[t0:t1], ref_o, dtype=out.dtype, rtol=64, atol=64, row_dims=2).ok
        good &= compare("lse", lse[t0:t1], ref_lse, dtype=lse.dtype, rtol=64, atol=64).ok
    ok[splits] = good
print("one program per (token, head block):", ok[1])
print("top-k split 4 ways + combine       :", ok[4])

# %% [markdown]
# ## What the H200 measured
# `data/kernels.json` comes from `python -m dsv32ref.bench.kernels` on one H200 (provenance below).
# Times are medians of CUDA-graph replays (device time; the eager time with Python launch cost is in the
# file too). Each case also records the fewest bytes and the FLOPs, and the fraction of the bound that
# applies, against the copy bandwidth and bf16 GEMM rate measured in the same run.

# %%
with open("../data/kernels.json") as fh:
    data = json.load(fh)
# where sm_90's warp-specialized kernel ran, the run timed the Triton kernel beside it: those rows apart
triton_k = {(r["model"], r["shape"], r["T"]): r for r in data["results"]
            if r.get("probe") == "the Triton kernel"}
data["results"] = [r for r in data["results"] if not r.get("probe")]
ab = json.load(open("../data/indexer_ab.json"))  # the indexer: this library's beside earlier commits', one run
ab_cases = [r for r in ab["results"] if r["kernel"] == "indexer_topk" and not r.get("probe")]
lean = {(r["model"], r["T"], r["context"]): r["torch_ms"] for r in ab_cases if r.get("torch_ms")}  # timed once a case
idx = [dict(r, torch_ms=lean.get((r["model"], r["T"], r["context"]))) for r in ab_cases
       if r["implementation"] == "library"]
prov, ceil = data["provenance"], data["ceilings"]
print(f"{prov['device']}, driver {prov['driver']}, torch {prov['torch']}, triton {prov['triton']}, {prov['date'][:10]}")
for c in data["ceilings_measured"]:
    print(f"ceilings measured at the {c['when']:<5}: copy {c['copy_GBps']:.0f} GB/s, bf16 GEMM {c['bf16_gemm_TFLOPs']:.0f} TFLOP/s")
print(f"fractions below are of the higher: copy {ceil['copy_GBps']:.0f} GB/s, bf16 GEMM {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s")
print(f"every case matched its reference: {all(r['ok'] for r in data['results'])} ({len(data['results'])} cases)")

# %%
LABELS = {"ms": "ms", "torch_ms": "torch ms", "ms_topk": "top-k ms", "ms_scores": "scores ms",
          "scores_fraction_of_copy": "scores of copy", "fraction_of_bound": "of bound",
          "fraction_of_compute": "of compute", "fraction_of_memory": "of HBM", "achieved_TFLOPs": "TFLOP/s",
          "achieved_GBps": "GB/s", "context": "context", "T": "T", "bound": "bound", "shape": "shape", "impl": "kernel"}


def kernel_table(kernel, cols):
    def fmt(c, v):
        if v is None:
            return None
        return f"{v:.1%}" if "fraction" in c else f"{v:.4g}" if isinstance(v, float) else v

    rows = [r for r in data["results"] if r["kernel"] == kernel]
    table(["model"] + [LABELS[c] for c in cols], [[r["model"]] + [fmt(c, r.get(c)) for c in cols] for r in rows])


kernel_table("sparse_mla", ["shape", "T", "impl", "ms", "torch_ms", "bound", "fraction_of_bound",
                            "fraction_of_compute", "achieved_TFLOPs"])

# %%
# the indexer's rows come from data/indexer_ab.json (the A/B run; kernels.json holds the same build's)
table(["model"] + [LABELS[c] for c in ("T", "context", "ms", "ms_scores", "ms_topk", "scores_fraction_of_copy")]
      + ["lean PyTorch (ms)"],
      [[r["model"], r["T"], r["context"], f"{r['ms']:.4g}", f"{r['ms_scores']:.4g}", f"{r['ms_topk']:.4g}",
        f"{r['scores_fraction_of_copy']:.1%}", f"{r['torch_ms']:.4g}" if r.get("torch_ms") else None] for r in idx])

# %%
for k in ("fused_norm_rope", "fused_q", "fused_q_fp8"):
    display(Markdown(f"`{k}`"))
    kernel_table(k, ["T", "ms", "torch_ms", "fraction_of_bound", "achieved_GBps"])

# %% [markdown]
# ## Roofline
# Each point is one (kernel, shape): arithmetic intensity (FLOPs over the fewest bytes) against the
# achieved rate. The lines are the measured ceilings. Points far below the roof are latency- or
# occupancy-bound, not bandwidth- or compute-bound.

# %%
fig, ax = plt.subplots(figsize=(8.5, 5.5))
ai = [10 ** (x / 10) for x in range(-20, 41)]
peak, bw = ceil["bf16_gemm_TFLOPs"], ceil["copy_GBps"] / 1e3  # TFLOP/s, TB/s
ax.plot(ai, [min(peak, bw * a) for a in ai], color="black", lw=1, label="measured roof (copy, bf16 GEMM)")
ridge = peak / bw
ax.axvline(ridge, color=GREY, ls=":", lw=1)
ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak), textcoords="offset points", xytext=(5, -14), fontsize=8)
markers = {"sparse_mla": "o", "indexer_topk": "s", "fused_norm_rope": "^", "fused_q": "v"}
palette = [c for c in OKABE_ITO if c != "#F0E442"] + [GREY]  # no yellow on white
for (kernel, model), color in zip([(k, m) for k in markers for m in ("deepseek-v3.2", "glm-5.2")], palette):
    rows = [r for r in (idx if kernel == "indexer_topk" else data["results"]) if r["kernel"] == kernel
            and r["model"] == model]
    xs, ys = [r["flops"] / r["bytes"] for r in rows], [r["achieved_TFLOPs"] for r in rows]
    ax.scatter(xs, ys, marker=markers[kernel], color=color, label=f"{kernel} ({model})", s=30)
    if model == "deepseek-v3.2":  # label each kernel once, at its best point
        top = max(range(len(rows)), key=lambda i: ys[i])
        ax.annotate(kernel, (xs[top], ys[top]), textcoords="offset points", xytext=(-10, 8), fontsize=8)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (FLOP / byte of the fewest bytes)")
ax.set_ylabel("achieved TFLOP/s")
ax.set_title("H200: kernels against the measured roofline")
ax.legend(fontsize=7, loc="lower right")
show(fig)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, model in zip(axes, ("deepseek-v3.2", "glm-5.2")):
    rows = [r for r in data["results"] if r["kernel"] == "sparse_mla" and r["model"] == model]
    for shape, style in (("one request", "o-"), ("decode batch", "d-")):
        sel = [r for r in rows if r["shape"] == shape]
        ax.plot([r["T"] for r in sel], [r["ms"] for r in sel], style, label=f"sparse_mla_paged ({shape})")
    tk = sorted((r for k, r in triton_k.items() if k[0] == model and k[1] == "one request"), key=lambda r: r["T"])
    ax.plot([r["T"] for r in tk], [r["ms"] for r in tk], "x:", label="the Triton kernel alone (one request)")
    tr = [r for r in rows if r.get("torch_ms")]
    ax.plot([r["T"] for r in tr], [r["torch_ms"] for r in tr], "s--", label="PyTorch gather + matmul (one request)")
    one = [r for r in rows if r["shape"] == "one request"]
    ax.plot([r["T"] for r in one], [r["floor_ms"] for r in one], ":", color="gray", label="roofline floor (one request)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("query tokens")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"sparse_mla, {model} (top-k {ModelConfig.preset(model).index_topk})")
    ax.legend(fontsize=7)
show(fig)

# %% [markdown]
# ## Which bound applies to `sparse_mla`
# FLOPs per query token are 2·H·k·(576 + 512). The bytes are the fewest the kernel must move from HBM:
# each distinct latent row once, plus q, out and the indices. In one request the query tokens pick from
# the same cache, so the distinct rows are far fewer than the rows gathered (the gathers move every
# token's k rows to the SMs, mostly from L2); in a batch of decode requests every row is distinct.
# Whichever floor is higher is the bound.

# %%
for r in [r for r in data["results"] if r["kernel"] == "sparse_mla" and r["T"] in (64, 512)]:
    print(f"{r['model']:<14} {r['shape']:<13} T={r['T']:<4} FLOP per distinct byte {r['flops'] / r['bytes']:6.0f}"
          f"  per gathered byte {r['flops'] / r['bytes_gathered']:4.0f}  -> {r['bound']}-bound")
print(f"ridge of the measured ceilings: {ceil['bf16_gemm_TFLOPs'] * 1e3 / ceil['copy_GBps']:.0f} FLOP/byte")

# %% [markdown]
# ## Why `sparse_mla` was slow, and what fixed it
# Two things, found in the compiled code and confirmed by the tile sweep (512 query tokens, same run).
#
# **Addresses.** A key's address takes two dependent loads: its top-k index, then the block-table entry
# of that index. The sweep times three ways to get them (all with the old QKᵀ layout, below): resolved
# inside the loop each step; resolved one step ahead (what this kernel used to do); resolved once per
# program into an int32 workspace before the loop (`SLOTS`), so each step needs one independent,
# contiguous load before its gather. The library's kernel does the last; the other loops are kept for the
# sweep in `dsv32ref.bench.sparse_mla_variants` (same math and epilogue, only the loop differs).

# %%
sweep = data["sparse_mla_tile_sweep"]


def sweep_ms(model, **want):
    hits = [r for r in sweep if r["model"] == model and r.get("ok")
            and all(r["config_full"].get(k) == v for k, v in want.items())]
    return min(r["ms"] for r in hits)


base = dict(BLOCK_N=64, num_warps=8, num_stages=2, Q_RELOAD=True)
rows = []
for m in ("deepseek-v3.2", "glm-5.2"):
    t_loop = sweep_ms(m, SLOTS=False, PREFETCH=False, SPLIT_QK=False, **base)
    t_ahead = sweep_ms(m, SLOTS=False, PREFETCH=True, SPLIT_QK=False, **base)
    t_slots = sweep_ms(m, SLOTS=True, PREFETCH=False, SPLIT_QK=False, **base)
    rows.append([m, t_loop, t_ahead, t_slots, f"{t_ahead / t_slots:.2f}x"])
table(["model", "in the loop (ms)", "one step ahead (ms)", "SLOTS (ms)", "SLOTS over one step ahead"], rows,
      floatfmt=".3f")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for ax, r in zip(axes, rows):
    ax.bar(["in the loop", "one step ahead", "SLOTS"], r[1:4], color=[GREY, GREY, OKABE_ITO[0]])
    ax.set_ylabel("time (ms), 512 query tokens")
    ax.set_xlabel("where a key's address is resolved")
    ax.set_title(f"sparse_mla tile sweep, {r[0]}")
show(fig)
# %% [markdown]
# **QKᵀ done twice.** A program holds 64 heads and two warpgroups (4 warps each, 64 rows per warpgroup
# MMA). Triton lays out a dot whose result flows into another dot (S → P → PV) with every warp along the
# rows, so that the softmax's row reductions stay inside a warp; with 64 rows that means both warpgroups
# compute all of S. `SPLIT_QK` (the default) writes QKᵀ as two dots that are not summed by an add of
# dot results, and runs the softmax inside a branch that is always taken: Triton's search for a chained
# dot stops at the branch, and the two warpgroups take 32 keys each. Triton then adds the cross-warpgroup
# row reductions and hands P to PV through shared memory. All with `SLOTS`:

# %%
rows = []
for m in ("deepseek-v3.2", "glm-5.2"):
    chained = sweep_ms(m, SLOTS=True, PREFETCH=False, SPLIT_QK=False, **base)
    chained_ahead = sweep_ms(m, SLOTS=True, PREFETCH=True, SPLIT_QK=False, **base)
    split = sweep_ms(m, SLOTS=True, PREFETCH=False, SPLIT_QK=True, **base)
    split_ahead = sweep_ms(m, SLOTS=True, PREFETCH=True, SPLIT_QK=True, **base)
    rows.append([m, chained, chained_ahead, split, split_ahead, f"{chained / split_ahead:.2f}x"])
table(["model", "chained (ms)", "chained, rows ahead", "split (ms)", "split, rows ahead", "default over chained"],
      rows, floatfmt=".3f")
top = min((r for r in sweep if r.get("ok")), key=lambda r: r["ms"])
print("fastest in the sweep:", "the library's kernel" if not top["config"] else top["config"])
print("  ", ", ".join(f"{k}={v}" for k, v in top["config_full"].items()))

# %% [markdown]
# An earlier run (`--compare`, `data/sparse_mla_split_qk.json`, its own provenance) timed the split with
# and without the next step's rows loaded one step ahead (`PREFETCH`) at more shapes; the pair was the
# fastest everywhere and is what the library's kernel does. With `SLOTS` the loads `PREFETCH` moves a step
# ahead are independent row numbers, so unlike the chains above they help. (The workspace holds rows in
# units of the cache's row stride, so a cache whose blocks are not back to back takes the same path.)
#
# <details><summary>History: the illegal memory access before PREFETCH became the default</summary>
#
# Two of three full test runs on the H200 hit an illegal memory access in the engine's capture test. The
# cause was the engine's capture-time metadata: a dummy request longer than `max_model_len` made the kernels
# read cos/sin rows and block-table columns past their ends. That is fixed; the benchmark above ran with the
# default it describes (its results carry the config).
# </details>

# %%
cmp_rows = json.load(open("../data/sparse_mla_split_qk.json"))["results"]
cmp_table = []
for m in ("deepseek-v3.2", "glm-5.2"):
    for shape, T in (("one request", 64), ("one request", 512), ("decode batch", 64)):
        cell = {json.dumps(r["config"], sort_keys=True): r["ms"] * 1e3 for r in cmp_rows
                if r["model"] == m and r["shape"] == shape and r["T"] == T}
        cmp_table.append([m, shape, T, cell["{}"], cell[json.dumps({"SPLIT_QK": True})],
                          cell[json.dumps({"PREFETCH": True, "SPLIT_QK": True}, sort_keys=True)]])
table(["model", "shape", "T", "chained (us)", "split (us)", "split + PREFETCH (us)"], cmp_table, floatfmt=".1f")
res = [x for x in data["resources"] if x["kernel"] == "_sparse_mla_kernel" and x["n_regs"]]
print("sparse_mla builds in the sweep: registers/thread", sorted({x["n_regs"] for x in res}))
print("                                shared memory KiB", sorted({x["shared_bytes"] // 1024 for x in res}))

# %% [markdown]
# The compiled code shows why. `scripts/sass_sparse_mla.py` builds the kernel for sm_90a without a GPU
# (triton's own ptxas and cuobjdump) and counts the instructions of one step of the main loop
# (`data/sparse_mla_sass.json`, with its provenance):

# %%
sass = json.load(open("../data/sparse_mla_sass.json"))
print(f"triton {sass['provenance']['triton']}, target {sass['provenance']['target']}")
table(["variant", "registers", "spilled (B)", "LDG / step", "cp.async / step", "wgmma / step", "barriers / step",
       "loop instructions"],
      [[name, v["registers"], v["spill_store_bytes"], v["per_step"]["LDG"], v["per_step"]["LDGSTS"],
        v["per_step"]["HGMMA"], v["per_step"]["BAR"], v["loop_instructions"]] for name, v in sass["variants"].items()])

# %%
V = sass["variants"]
loop, slots = V["in the loop, chained QK^T"], V["SLOTS, chained QK^T"]
ahead, chained = V["one step ahead, chained QK^T"], V["SLOTS, chained QK^T"]
split = V["SLOTS, split QK^T, rows one step ahead (the Triton kernel)"]
display(Markdown(
    f"With addresses resolved in the loop, each thread loads an index and then a block-table entry for each of "
    f"its rows: {loop['per_step']['LDG']} global loads to registers per step against {slots['per_step']['LDG']} "
    f"with `SLOTS`, each pair dependent, and at {loop['registers']} registers the compiler reuses the same "
    f"registers, so the pairs run one after another. Resolving one step ahead kept those loads in the loop "
    f"({ahead['per_step']['LDG']} per step) and added live registers ({ahead['spill_store_bytes']} B spilled): "
    f"slower still. With `SLOTS` a step's row numbers are independent loads of rows the program wrote "
    f"itself.\n\n"
    f"The chained QKᵀ issues {chained['per_step']['HGMMA']} warpgroup MMAs per step (each warpgroup computes "
    f"all of S); split, {split['per_step']['HGMMA']}: "
    f"{1 - split['per_step']['HGMMA'] / chained['per_step']['HGMMA']:.0%} fewer MMA instructions per step, for more "
    f"barriers ({split['per_step']['BAR']} against {chained['per_step']['BAR']}: the cross-warpgroup reductions "
    f"and P's trip through shared memory). What is left: one program per SM ({split['registers']} registers, "
    f"{split['shared_bytes'] // 1024} KiB of shared memory), so nothing hides a step's latencies; and the "
    f"gather of step i+1 is issued after step i's PV and waited for at the top of step i+1 (the pipeliner's "
    f"placement: a third key tile does not fit beside the query tile)."))

# %% [markdown]
# A sweep-only run before `SLOTS` (`data/sparse_mla_sweep.json`, its own provenance) timed the old
# default with each token's top-k indices sorted, i.e. with far better DRAM locality: no change, as
# expected when the limit is the dependent-load chain and not the memory system.

# %%
old = json.load(open("../data/sparse_mla_sweep.json"))["sparse_mla_tile_sweep"]
for m in ("deepseek-v3.2", "glm-5.2"):
    probe = next(r for r in old if r["model"] == m and r.get("probe"))
    same = next(r for r in old if r["model"] == m and not r.get("probe") and r["config"] == probe["config"])
    print(f"{m:<14} sorted indices / unsorted: {probe['ms'] / same['ms']:.2f}")

# %% [markdown]
# ## The same schedule in Gluon
# `dsv32ref.bench.sparse_mla_gluon` writes the kernel in Gluon (`triton.experimental.gluon`), with the
# layouts, copies and MMAs by hand. The query tile stays in shared memory for the whole program (the Triton
# build reads it again every step); the two warpgroups split S's keys and O's columns through the MMA
# layout; the next step's rows are gathered with cp.async into the other half of a double buffer; every
# wgmma is issued asynchronously. A sweep-only run (`data/sparse_mla_gluon_sweep.json`, its own provenance)
# timed it beside the library's kernel at 512 query tokens, with each PV waited for at once and with a
# step's PV left running while the next step's copies are awaited and its QKᵀ issued:

# %%
gsweep = json.load(open("../data/sparse_mla_gluon_sweep.json"))
g_roof = gsweep["ceilings"]["bf16_gemm_TFLOPs"]  # the higher of the run's two GEMM measurements
KINDS = (("library (Triton)", {}), ("Gluon", {"GLUON": True, "OVERLAP_PV": False}),
         ("Gluon, PV overlapped", {"GLUON": True, "OVERLAP_PV": True}))
g = {(r["model"], json.dumps(r["config"], sort_keys=True)): r for r in gsweep["sparse_mla_tile_sweep"]}
rows = []
for m in ("deepseek-v3.2", "glm-5.2"):
    lib = g[(m, "{}")]
    for name, want in KINDS:
        r = g[(m, json.dumps(want, sort_keys=True))]
        rows.append([m, name, r["ms"], r["achieved_TFLOPs"], f"{r['achieved_TFLOPs'] / g_roof:.1%}",
                     f"{lib['ms'] / r['ms']:.2f}x", r["ok"]])
table(["model", "kernel", "ms", "TFLOP/s", "of the run's GEMM", "over the library", "matches the reference"], rows,
      floatfmt=".3f")

# %%
gl_ds = g[("deepseek-v3.2", json.dumps(KINDS[1][1], sort_keys=True))]
gl_ov = g[("deepseek-v3.2", json.dumps(KINDS[2][1], sort_keys=True))]
lib_ds = g[("deepseek-v3.2", "{}")]
display(Markdown(
    f"At DeepSeek-V3.2's shape the Gluon kernel takes {gl_ds['ms']:.3f} ms against the library's "
    f"{lib_ds['ms']:.3f} ms: {gl_ds['achieved_TFLOPs']:.0f} TFLOP/s, {gl_ds['achieved_TFLOPs'] / g_roof:.0%} of the "
    f"bf16 GEMM rate measured in the same run ({g_roof:.0f} TFLOP/s), short of half of it. Overlapping a step's "
    f"PV with the next step's copies and QKᵀ made it slower ({gl_ov['ms']:.3f} ms): the PV's wait moves after the "
    f"next QKᵀ is issued, and the gather of the step after that is issued later. What bounds both builds: one "
    f"program per SM (the query, two key tiles and P take {(64 * 576 * 3 + 64 * 64) * 2 // 1024} KiB of shared "
    f"memory in bf16), and every step runs its "
    f"phases one after another (wait for the gather, QKᵀ, a softmax whose row maxima cross the warpgroups through "
    f"shared memory, P to shared memory, PV) with no second program or warpgroup to fill the tensor cores "
    f"meanwhile. FlashMLA's sparse prefill kernel gives the gathers to a producer warpgroup; the next section "
    f"builds that."))

# %% [markdown]
# ## A producer warpgroup: what sm_90 runs
# `dsv32ref.kernels.sparse_mla_hopper` is the Gluon kernel above with FlashMLA's schedule: a producer warpgroup
# resolves each step's rows, gathers them with cp.async into the stage the two consumer warpgroups freed, and
# stores the stage's 64 validity flags beside it; one `ready` and one `free` mbarrier per stage carry the
# hand-offs, and the row sums of P are reduced once after the loop instead of across the warpgroups every step.
# The consumers read the flags from shared memory and load nothing from global memory in their loop.
# `sparse_mla_paged` runs it on sm_90 for bf16 with DeepSeek's latent widths wherever the top-k is not split (one
# launch, as before); a config, fp16/fp32, other widths or a split run the Triton kernel. The kernel benchmark
# timed the Triton kernel beside it in each case:

# %%
rows = []
for m in ("deepseek-v3.2", "glm-5.2"):
    for r in data["results"]:
        tr = triton_k.get((r["model"], r.get("shape"), r["T"]))
        if r["kernel"] == "sparse_mla" and r["model"] == m and tr:
            rows.append([m, r["shape"], r["T"], r["ms"] * 1e3, tr["ms"] * 1e3, f"{tr['ms'] / r['ms']:.2f}x",
                         f"{r['fraction_of_compute']:.1%}", f"{tr['fraction_of_compute']:.1%}"])
table(["model", "shape", "T", "sm_90 kernel (us)", "Triton kernel (us)", "speed-up", "sm_90 of GEMM",
       "Triton of GEMM"], rows, floatfmt=".1f")
from dsv32ref.experiments.ledger import ASSUMED_SMS  # noqa: E402

ws = json.load(open("../data/sparse_mla_ws_compare.json"))
cons = V["sm_90 warp-specialized: the consumers' loop"]
prod = V["sm_90 warp-specialized: the producer's loop"]
ws_rows = {(r["model"], r["shape"], r["T"], json.dumps(r["config"], sort_keys=True)): r for r in ws["results"]}
two = ws_rows[("deepseek-v3.2", "one request", 512, json.dumps({"GLUON": True, "WS": True}, sort_keys=True))]
one = {m: next(r for r in data["results"] if r["kernel"] == "sparse_mla" and r["model"] == m
               and r["shape"] == "one request" and r["T"] == 512) for m in ("deepseek-v3.2", "glm-5.2")}
r512 = one["deepseek-v3.2"]
heads = ModelConfig.preset("deepseek-v3.2").num_attention_heads
block = 64  # sparse_mla_hopper's BLOCK_H and BLOCK_N: a program's heads, a step's keys
steps = r512["T"] * (heads // block) * (r512["topk"] // block)  # programs (tokens x head blocks) x steps each
per_step = r512["flops"] / steps  # the benchmark's FLOP count (QK^T and PV) of one step of one program
k_roof = data["ceilings"]["bf16_gemm_TFLOPs"]
step_us = per_step / (k_roof * 1e12 / ASSUMED_SMS) * 1e6  # at the run's GEMM rate shared by the SMs
took_us = r512["ms"] * 1e3 * ASSUMED_SMS / steps  # what a step took, the steps spread over the SMs
display(Markdown(
    f"At 512 query tokens the sm_90 kernel runs at {one['deepseek-v3.2']['fraction_of_compute']:.1%} of the GEMM "
    f"rate of its run at DeepSeek-V3.2's shape and {one['glm-5.2']['fraction_of_compute']:.1%} at GLM-5.2's. "
    f"An earlier build of the same schedule (`data/sparse_mla_ws_compare.json`, commit "
    f"{ws['provenance']['git_commit'][:7]}) resolved the rows in a launch of its own into a workspace: "
    f"{two['ms'] * 1e3:.0f} us at DeepSeek-V3.2's shape, {two['fraction_of_compute']:.1%} of that run's GEMM rate, "
    f"against {one['deepseek-v3.2']['ms'] * 1e3:.0f} us here in one launch. Compiled offline "
    f"(`data/sparse_mla_sass.json`, the table above) the consumers' loop issues {cons['loop_instructions']} "
    f"instructions a step: {cons['per_step']['HGMMA']} warpgroup MMAs, {cons['per_step']['LDG']} global loads, "
    f"{cons['per_step']['IMAD']} integer multiply-adds, {cons['per_step']['BAR']} CTA barriers; the producer's "
    f"{prod['loop_instructions']}, its {prod['per_step']['LDGSTS']} cp.async copies among them. What is left is the "
    f"schedule: one program per SM, and in it both consumer warpgroups run the same phase at the same time (wait, "
    f"QKᵀ, a softmax whose row maxima cross the warpgroups through shared memory, P to shared memory, PV), so the "
    f"tensor cores idle through each softmax. A step's two MMAs ({per_step / 1e6:.1f} MFLOP) would take "
    f"{step_us:.2f} us at the GEMM rate; at 512 tokens a step took {took_us:.2f} us ({steps} steps over "
    f"{ASSUMED_SMS} SMs). FlashMLA's kernel has each consumer warpgroup compute S for a different key block, so "
    f"one warpgroup's softmax runs under the other's MMAs."))

# %% [markdown]
# ## Splitting the top-k when the programs do not fill the GPU
# A separate probe run (`--splits-probe`, `data/sparse_mla_splits.json`, its own provenance) timed 1, 2, 4
# and 8 splits, and the merge launch alone. The default takes the largest power of two that keeps every
# program in one wave.

# %%
block_h = split["config"]["BLOCK_H"]
progs = {m: 64 * (ModelConfig.preset(m).num_attention_heads // block_h) for m in ("deepseek-v3.2", "glm-5.2")}
display(Markdown("At 64 query tokens, with " + f"{block_h} heads per program: " + ", ".join(
    f"{m} has {n} programs for the H200's {ASSUMED_SMS} SMs" for m, n in progs.items()) + "."))
probe = json.load(open("../data/sparse_mla_splits.json"))
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
for ax, m in zip(axes, ("deepseek-v3.2", "glm-5.2")):
    for j, shape in enumerate(("one request", "decode batch")):
        rows = [r for r in probe["results"] if r["kernel"] == "sparse_mla" and r["model"] == m and r["shape"] == shape]
        ns = [r["config"]["NUM_SPLITS"] for r in rows]
        ax.bar([i + 0.4 * j for i in range(len(ns))], [r["ms"] * 1e3 for r in rows], 0.4, color=OKABE_ITO[j],
               label=shape)
    ax.set_xticks([i + 0.2 for i in range(len(ns))], [str(n) for n in ns])
    merges = [r for r in probe["results"] if r["kernel"] == "sparse_mla_merge" and r["model"] == m]
    ax.set_xlabel("top-k splits (NUM_SPLITS)")
    ax.set_ylabel("time (us), 64 query tokens")
    ax.set_title(f"split-K probe, {m}\nmerge launch alone: " + ", ".join(f"{r['ms'] * 1e3:.1f} us" for r in merges))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    ax.legend(fontsize=8, loc="upper left")
show(fig)
glm = {r["T"]: r for r in data["results"] if r["kernel"] == "sparse_mla" and r["model"] == "glm-5.2"
       and r["shape"] == "one request"}
print(f"GLM-5.2 one request: 64 tokens in 2 x 16 steps {glm[64]['ms'] * 1e3:.1f} us;")
print(f"  128 tokens in 32 steps {glm[128]['ms'] * 1e3:.1f} us (the same 128 programs); half of that is "
      f"{glm[128]['ms'] * 1e3 / 2:.1f} us")

# %% [markdown]
# ## The indexer at one decode token
# Decode is the case DSA exists for: one query token against a long context. The benchmark's baseline is the
# lean PyTorch path: keys already contiguous, a bf16 einsum, ReLU, the weighted sum as one bmm, `torch.topk`,
# timed the same way (CUDA-graph replay, copies of the key cache in rotation, so that the keys come from
# HBM as a layer's cache does in a forward). The scores pass must read every key once (S × 128 × 2 bytes),
# so it is reported against the copy bandwidth of the same run; the top-k against its own bytes (the S fp32
# scores read once, the indices written).

# %%
dec = [r for r in idx if r["T"] == 1]
display(Markdown(f"`data/indexer_ab.json`: {ab['provenance']['device']}, commit {ab['provenance']['git_commit'][:12]}, "
                 f"copy bandwidth {ab['ceilings']['copy_GBps']:.0f} GB/s."))
display(Markdown(f"Key-cache copies in rotation: {sorted({r['key_copies'] for r in dec})}."))
table(["model", "context", "scores (us)", "of copy", "top-k (us)", "top-k GB/s", "both (us)", "lean PyTorch (us)",
       "speed-up"],
      [[r["model"], r["context"], r["ms_scores"] * 1e3, f"{r['scores_fraction_of_copy']:.0%}", r["ms_topk"] * 1e3,
        f"{r['topk_GBps']:.0f}", r["ms"] * 1e3, r["torch_ms"] * 1e3, f"{r['torch_ms'] / r['ms']:.2f}x"] for r in dec],
      floatfmt=".1f")
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
for ax, m in zip(axes, ("deepseek-v3.2", "glm-5.2")):
    rows = [r for r in dec if r["model"] == m]
    x = list(range(len(rows)))
    sc = [r["ms_scores"] * 1e3 for r in rows]
    ax.bar([i - 0.2 for i in x], sc, 0.4, color=OKABE_ITO[0], label="ours: scores")
    ax.bar([i - 0.2 for i in x], [r["ms_topk"] * 1e3 for r in rows], 0.4, bottom=sc, color=OKABE_ITO[1],
           label="ours: top-k")
    ax.bar([i + 0.2 for i in x], [r["torch_ms"] * 1e3 for r in rows], 0.4, color=GREY, label="lean PyTorch")
    ax.set_xticks(x, [f"{r['context'] // 1024}k" for r in rows])
    ax.set_xlabel("context (keys)")
    ax.set_title(f"indexer, one decode token, {m}")
    ax.legend(fontsize=8, loc="upper left")
axes[0].set_ylabel("time (us), CUDA-graph replay")
show(fig)

# %% [markdown]
# How a scores program walks its keys: it holds the query and walks `tiles` key tiles of 64 keys, the loads
# pipelined `num_stages` deep; where a tile lies in one cache block (a multiple of 64 keys per block), the
# program's block ids are read once before its loop, so no load in the loop waits on another. A tune run
# (`python -m dsv32ref.bench.indexer_ab --tune`, `data/indexer_tune.json`, its own provenance) timed the scores pass of
# every case at the tile count of the rule before it and its double, each at two depths. The defaults it chose
# (`scores_tiles`, `scores_stages`): as many tiles as leave more than one program per SM, pipelined 3 deep where
# the third 16 KiB buffer costs no residency (every program resident at once, or a token group), 2 where
# programs queue, 1 for a single tile. At one decode token:

# %%
tune = json.load(open("../data/indexer_tune.json"))
trows = [r for r in tune["results"] if r["T"] == 1]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for ax, m in zip(axes, ("deepseek-v3.2", "glm-5.2")):
    ctxs = sorted({r["context"] for r in trows if r["model"] == m})
    for i, ctx in enumerate(ctxs):
        sel = sorted((r for r in trows if r["model"] == m and r["context"] == ctx),
                     key=lambda r: (r["scores_kw"]["tiles"], r["scores_kw"]["num_stages"]))
        best = min(r["ms_scores"] for r in sel)
        for j, r in enumerate(sel):
            ax.bar(i + 0.2 * (j - 1.5), r["ms_scores"] / best, 0.2, color=OKABE_ITO[j])
            ax.annotate(f"{r['scores_kw']['tiles']}x{r['scores_kw']['num_stages']}", (i + 0.2 * (j - 1.5),
                        r["ms_scores"] / best), ha="center", xytext=(0, 2), textcoords="offset points", fontsize=7)
    ax.axhline(1.0, color=GREY, lw=1)
    ax.set_xticks(range(len(ctxs)), [f"{c // 1024}k" for c in ctxs])
    ax.set_ylim(0, 1.9)
    ax.set_xlabel("context (keys); bars: tiles x pipeline depth")
    ax.set_ylabel("scores time / the case's fastest")
    ax.set_title(f"indexer scores tune, one token, {m}")
show(fig)
display(Markdown(f"`data/indexer_tune.json`: {tune['provenance']['device']}, commit "
                 f"{tune['provenance']['git_commit'][:12]}, {len(tune['results'])} timings, every one checked against "
                 f"the reference: {all(r['ok'] for r in tune['results'])}."))

# %% [markdown]
# The top-k's chunks come from an earlier probe run (`data/indexer_probe.json`, its own provenance): the radix
# passes run over about 32 chunks per row.

# %%
iprobe = json.load(open("../data/indexer_probe.json"))["results"]
chunks = {}
for r in iprobe:
    if "chunk" in r["topk_kw"] and r["T"] == 1:
        c = chunks.setdefault(r["context"], {})
        c[r["topk_kw"]["chunk"]] = min(c.get(r["topk_kw"]["chunk"], 1e9), r["ms_topk"] * 1e3)
table(["context"] + [f"chunk {c} (us)" for c in sorted(next(iter(chunks.values())))],
      [[ctx] + [v[c] for c in sorted(v)] for ctx, v in chunks.items()], floatfmt=".1f")

# %%
d32 = {r["model"]: r for r in dec if r["context"] == 32768}
d128 = {r["model"]: r for r in dec if r["context"] == 131072}
floor = {r["bytes"]: r for r in ab["results"] if r["kernel"] == "read_floor"}
f128 = floor[d128["deepseek-v3.2"]["context"] * 2 * 128]
chained = {(r["model"], r["topk_kw"]["pdl"]): r for r in ab["results"] if r.get("probe") and "pdl" in r["topk_kw"]
           and r["context"] == 131072}
display(Markdown(
    "At one decode token the indexer is " + ", ".join(
        f"{d32[m]['torch_ms'] / d32[m]['ms']:.2f}x (32k) and {d128[m]['torch_ms'] / d128[m]['ms']:.2f}x (128k) "
        f"the lean PyTorch path for {m}" for m in d32) + ". "
    f"The scores pass reads the keys at {d128['deepseek-v3.2']['scores_fraction_of_copy']:.0%} (DeepSeek-V3.2) and "
    f"{d128['glm-5.2']['scores_fraction_of_copy']:.0%} (GLM-5.2) of the copy bandwidth at 128k (the copy streams "
    f"2 GiB buffers). A kernel that only reads the same {f128['bytes'] / 1e6:.1f} MB, in the same rotation, takes "
    f"{f128['ms'] * 1e3:.1f} us ({f128['fraction_of_copy']:.0%}): launch, ramp and tail cost a kernel of this size "
    f"{1 - f128['fraction_of_copy']:.0%} of the copy rate whatever it computes; the scores pass adds to them the MMAs "
    f"(DeepSeek-V3.2's 64 heads, twice GLM-5.2's 32, are the slower) and the block-table read before its loop. "
    f"The top-k is five dependent launches (four radix passes and the compaction), chained by programmatic "
    f"dependent launch: each starts while the one before runs and waits only before it reads that one's "
    f"histograms. At 128k that chain takes {chained[('deepseek-v3.2', True)]['ms_topk'] * 1e3:.1f} us, "
    f"{chained[('deepseek-v3.2', False)]['ms_topk'] * 1e3:.1f} us with plain launches."))

# %% [markdown]
# ## The indexer against the kernels of earlier commits
# `python -m dsv32ref.bench.indexer_ab` imports `dsv32ref/kernels/indexer_topk.py` as it was at earlier commits
# beside the library's and measures every indexer case with each in one run (same inputs, same key-cache
# rotation, same ceilings). The first is the commit before this round of indexer work (one program per key
# tile, heads on the MMA's rows, an unchained top-k); the second the build before the block ids left the scores
# loop and before the tune (each key looked up its block inside the loop, every program 2 deep). From 256
# tokens a program scores a group of tokens (4 at 64 heads, 8 at 32: 256 MMA columns), reading each key tile
# once for all of them instead of once per token.

# %%
base_sha = ab["implementations"][0]
by = {}
for r in ab_cases:
    by.setdefault((r["model"], r["T"], r["context"]), {})[r["implementation"]] = r
table(["model", "T", "context", f"{base_sha[:7]} (us)", "library (us)", "speed-up", "lean PyTorch (us)",
       "vs lean"],
      [[m, T, ctx, v[base_sha]["ms"] * 1e3, v["library"]["ms"] * 1e3, f"{v[base_sha]['ms'] / v['library']['ms']:.2f}x",
        v[base_sha]["torch_ms"] * 1e3 if v[base_sha].get("torch_ms") else None,
        f"{v[base_sha]['torch_ms'] / v['library']['ms']:.2f}x" if v[base_sha].get("torch_ms") else None]
       for (m, T, ctx), v in by.items()], floatfmt=".1f")
slower = [(k, v) for k, v in by.items() if v["library"]["ms"] > v[base_sha]["ms"]]
display(Markdown(f"Slower than at {base_sha[:7]} in {len(slower)} of {len(by)} cases" + (": " + "; ".join(
    f"{m} T={T} {ctx // 1024}k, {v['library']['ms'] * 1e3:.1f} vs {v[base_sha]['ms'] * 1e3:.1f} us"
    for (m, T, ctx), v in slower) if slower else "") + ". The speed-up runs from " + " to ".join(
    f"{by[k][base_sha]['ms'] / by[k]['library']['ms']:.2f}x ({k[0]}, T={k[1]}, {k[2] // 1024}k)"
    for k in (min(by, key=lambda k: by[k][base_sha]["ms"] / by[k]["library"]["ms"]),
              max(by, key=lambda k: by[k][base_sha]["ms"] / by[k]["library"]["ms"]))) + "."))
tok = [r for r in ab["results"] if r.get("probe") and "tokens" in r["scores_kw"]]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for ax, m in zip(axes, ("deepseek-v3.2", "glm-5.2")):
    cases = sorted({(r["T"], r["context"]) for r in tok if r["model"] == m})
    groups = sorted({r["scores_kw"]["tokens"] for r in tok if r["model"] == m})
    for j, g in enumerate(groups):
        base_ms = {(r["T"], r["context"]): r["ms_scores"] for r in tok if r["model"] == m and r["scores_kw"]["tokens"] == 1}
        ys = [next(r["ms_scores"] for r in tok if r["model"] == m and (r["T"], r["context"]) == c
                   and r["scores_kw"]["tokens"] == g) / base_ms[c] for c in cases]
        ax.bar([i + 0.8 * j / len(groups) for i in range(len(cases))], ys, 0.8 / len(groups), color=OKABE_ITO[j],
               label=f"{g} token{'s' if g > 1 else ''} per program")
    ax.axhline(1.0, color=GREY, lw=1)
    ax.set_ylim(0, 1.7)  # room above the bars for the legend
    ax.set_xticks([i + 0.4 - 0.4 / len(groups) for i in range(len(cases))],
                  [f"T={T}, {ctx // 1024}k" for T, ctx in cases])
    ax.set_xlabel("query tokens, context (keys)")
    ax.set_ylabel("scores time / 1 token per program")
    ax.set_title(f"indexer scores, token groups, {m}")
    ax.legend(fontsize=8, ncol=2, loc="upper center")
show(fig)

# %% [markdown]
# The split path pays for the merge launch, the fp32 partial outputs it writes and reads, and one more
# program prologue per token: GLM-5.2 at 64 tokens is the lowest fraction of the one-request cases of 64
# tokens or more (below). The probe file predates `SPLIT_QK`; the split rule it supported is unchanged.
#
# ## Reading the numbers
# The figures quoted here are computed from the data file, not typed in.

# %%
def best(kernel, key, model=None, T=None):
    rows = [r for r in data["results"] if r["kernel"] == kernel and (model is None or r["model"] == model)
            and (T is None or r["T"] == T)]
    return max(r[key] for r in rows)


for k in ("fused_norm_rope", "fused_q", "fused_q_fp8"):
    print(f"{k:<16} best fraction of copy bandwidth at 8192 tokens: {best(k, 'fraction_of_bound', T=8192):.0%}")
wins = [r for r in idx if r["context"] >= 32768 and r["torch_ms"]]
print(f"indexer_topk faster than the lean PyTorch path in {sum(r['ms'] < r['torch_ms'] for r in wins)} of "
      f"{len(wins)} measured cases at >= 32k context")
for m in ("deepseek-v3.2", "glm-5.2"):
    for shape in ("one request", "decode batch"):
        rows = [r for r in data["results"] if r["kernel"] == "sparse_mla" and r["model"] == m and r["shape"] == shape
                and r["T"] >= 64]
        lo = min(rows, key=lambda r: r["fraction_of_bound"])
        print(f"sparse_mla {m:<14} {shape:<13} >= 64 tokens: {lo['fraction_of_bound']:.1%} (T={lo['T']}) to "
              f"{max(r['fraction_of_bound'] for r in rows):.1%} of the {'/'.join(sorted({r['bound'] for r in rows}))} bound")

# %% [markdown]
# ## Conclusion
# - `fused_norm_rope` and `fused_q` approach the copy bandwidth once there are thousands of tokens; at
#   decode sizes they take a few microseconds, which under CUDA graphs is what a launch costs. The fp8
#   variant of `fused_q` does the Hadamard butterflies in registers and writes half the bytes for the
#   indexer query; it runs at a lower fraction of the copy bandwidth (the butterflies' shuffles).
# - `indexer_topk` beats the lean PyTorch path (contiguous keys, bf16 einsum, `torch.topk`) in the cases
#   counted above: it never writes the [T, H_I, S] logits. At one decode token it is faster by the ratios
#   printed above. What holds it back there: the scores pass runs below the read-only floor (the MMAs, the
#   block ids read before its loop), and the floor itself is far from the copy rate at tens of megabytes;
#   the top-k is five dependent launches. From 256 tokens a program scores a group of tokens, so each key
#   tile is read once for the group.
# - `sparse_mla` at 64 query tokens and more runs at the fractions printed above: of the bf16
#   tensor-core rate, and for a decode batch of GLM-5.2 (memory-bound: every row a distinct HBM read) of
#   the copy bandwidth. Decode with one or eight tokens is latency-bound: a few steps per program, plus
#   the prologue and the merge. On sm_90 a warp-specialized Gluon kernel (a producer warpgroup for the
#   gathers, as FlashMLA's) runs wherever the top-k is not split, faster than the Triton kernel in every such
#   case (table above), at the fractions of the GEMM rate printed there.
# - Beside the PR: it measured whole requests through vLLM's kernels on TP4; this notebook measures our
#   kernels alone on one GPU, each checked against the PyTorch reference in every benchmarked case.
