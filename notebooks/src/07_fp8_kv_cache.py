# %% [markdown]
# # The FP8 KV cache: the bytes, what they cost in accuracy, what they buy in memory and speed
#
# vLLM's pull request "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region" measured GLM-5.2 with an FP8 KV
# cache. Serving engines that run DeepSeek-V3.2's sparse attention keep two caches in FP8: FlashMLA's latent
# rows (656 bytes per token instead of 1152 in bf16) and DeepGEMM's indexer keys (132 bytes instead of 256).
# This notebook draws both layouts from bytes our quantisers write (`dsv32ref.reference.fp8_cache`), computes
# what they save per token, and reads from `data/` what the FP8 cache did to accuracy (the reference model on
# the CPU, `python -m dsv32ref fp8-accuracy`), to kernel time (one H200, `python -m dsv32ref fp8-speed`) and to
# the PR's TTFT protocol (the `+fp8` arms of `python -m dsv32ref ttft`).

# %%
import json

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

from dsv32ref.bench.kernels import roofline
from dsv32ref.cache import LATENT_ROW_BYTES, indexer_key_bytes, token_bytes
from dsv32ref.config import ModelConfig
from dsv32ref.engine.memory import kv_bytes_per_token
from dsv32ref.reference import fp8_round_trip, hadamard_transform
from dsv32ref.reference.fp8_cache import (dequantize_latent, indexer_key_parts, latent_parts, quantize_indexer_keys,
                                          quantize_latent)
from dsv32ref.report import GREY, OKABE_ITO, show, table


def load(name):
    with open(f"../data/{name}") as fh:
        return json.load(fh)


acc, speed, ttft = load("fp8_accuracy.json"), load("fp8_speed.json"), load("ttft_glm-5.2.json")
for name, d in (("accuracy", acc), ("speed", speed), ("TTFT", ttft)):
    p = d["provenance"]
    print(f"{name:<9} {p['device']}, torch {p['torch']}, triton {p['triton']}, {p['date'][:10]}, "
          f"commit {p['git_commit'][:10]}")

# %% [markdown]
# ## The two layouts, byte by byte
# One latent row of 576 values, quantised as FlashMLA stores it: 512 fp8 e4m3 values of `c_kv`, four fp32
# scales (one per 128 values, each a power of two), then the 64 `k_pe` values in bf16, untouched. And one block
# of DeepGEMM's indexer-key cache: the block's 64 keys of 128 fp8 values each, then their 64 fp32 scales.

# %%
g = torch.Generator().manual_seed(0)
spread = torch.cat((torch.tensor([0.1, 1.0, 10.0, 100.0]).repeat_interleave(128), torch.ones(64)))  # (576,)
latent = torch.randn(1, 576, generator=g) * spread  # c_kv groups of four magnitudes, then k_pe
row = quantize_latent(latent)[0]  # (656,) bytes
values, scales, k_pe = latent_parts(row)
back = dequantize_latent(row)
print(f"row: {row.numel()} bytes = {values.numel()} fp8 + {4 * scales.numel()} scale bytes + {2 * k_pe.numel()} "
      f"k_pe bytes")
print("scales (one per 128 values):", scales.tolist())
print("bytes 512-527 (the scales, little-endian fp32):", row[512:528].tolist())
err = ((back[:512] - latent[0, :512]).abs() / latent[0, :512].abs()).view(4, 128).amax(-1)
print("largest relative error per group:", [f"{e:.3f}" for e in err.tolist()])
print("k_pe read back exactly as bf16:", torch.equal(back[512:], latent[0, 512:].to(torch.bfloat16).float()))

keys = torch.randn(1, 64, 128, generator=g) * torch.logspace(-2, 2, 64)[None, :, None]
block = quantize_indexer_keys(keys)  # (1, 64, 1, 132)
kv, ks = indexer_key_parts(block)
print(f"\nkey block: {block.numel()} bytes = {kv.numel()} fp8 values, then {4 * ks.numel()} scale bytes; "
      f"{indexer_key_bytes(128)} bytes per token")

fig, axes = plt.subplots(2, 1, figsize=(9, 3.2))
for ax, parts, total, title in (
        (axes[0], [("c_kv: 512 fp8 e4m3", 512, OKABE_ITO[0]), ("4 fp32 scales", 16, OKABE_ITO[1]),
                   ("k_pe: 64 bf16", 128, OKABE_ITO[2])], LATENT_ROW_BYTES, "FlashMLA's latent row (one token)"),
        (axes[1], [("64 keys x 128 fp8 e4m3", 64 * 128, OKABE_ITO[3]), ("64 fp32 scales", 256, OKABE_ITO[5])],
         64 * 132, "DeepGEMM's indexer-key block (64 tokens)")):
    start = 0
    for label, n, color in parts:
        ax.barh(0, n, left=start, color=color, edgecolor="black")
        ax.text(start + n / 2, 0, f"{label}\n[{start}, {start + n})", ha="center", va="center", fontsize=8)
        start += n
    ax.set_xlim(0, total)
    ax.set_yticks([])
    ax.set_title(title)
    ax.set_xlabel("byte offset")
    ax.set_ylabel("bytes")
show(fig)

# %% [markdown]
# ## Memory per token
# Bytes one token takes in every layer's caches (`dsv32ref.engine.memory.kv_bytes_per_token`): the latent row
# in each layer, the indexer key in each layer that runs its own indexer (GLM-5.2's IndexShare layers reuse
# another's selection and keep no keys).

# %%
rows = []
for name in ("deepseek-v3.2", "glm-5.2"):
    c = ModelConfig.preset(name)
    own = sum(c.runs_indexer(i) for i in range(c.num_hidden_layers))
    b16, f8 = (kv_bytes_per_token(c, torch.bfloat16, k) for k in ("auto", "fp8"))
    lat16, key16 = token_bytes(c, torch.bfloat16)
    lat8, key8 = token_bytes(c, torch.bfloat16, "fp8")
    rows.append([name, f"{c.num_hidden_layers} / {own}", f"{lat16} + {key16}", f"{lat8} + {key8}", b16 // 1024,
                 f8 // 1024, f8 / b16, int(2**30 // b16), int(2**30 // f8)])
table(["model", "layers / with keys", "bf16 B (latent + key)", "fp8 B", "bf16 KiB/token", "fp8 KiB/token",
       "fp8 / bf16", "bf16 tokens/GiB", "fp8 tokens/GiB"], rows)
ratio = rows[0][6]
display(Markdown(f"The FP8 cache holds {1 / ratio:.2f} x the tokens of the bf16 cache in the same memory "
                 f"(DeepSeek-V3.2; GLM-5.2 {1 / rows[1][6]:.2f} x)."))

# %% [markdown]
# ## What the rotation before the fp8 cast does
# Over FP8 keys the indexer runs as DeepSeek's inference code does: each query head and each key is multiplied by
# the orthonormal Hadamard matrix before it is rounded to fp8 with one power-of-two scale per vector
# (`dsv32ref.reference.hadamard_transform`, then `fp8_round_trip`). The rotation leaves every q . k as it was;
# what it changes is the rounding. Below: 4096 random keys and 64 random queries of 128 values (seeded), keys
# without and with one channel made 30 or 1000 x the others, queries that weight that channel like the others or
# not at all; the median error of the indexer's logits q . k from fp8 vectors against float64, and how much of
# each query's top-256 the fp8 logits keep.

# %%
def fp8_logits(q, k, rotate):
    """q [n, 128], k [S, 128] float64 -> the logits the fp8 vectors give (one ue8m0 scale per vector), float64."""
    if rotate:
        q, k = hadamard_transform(q), hadamard_transform(k)
    return fp8_round_trip(q, block=128) @ fp8_round_trip(k, block=128).T


def rounding_cost(q, k):
    """[logits error, top-256 kept] without the rotation, then with it."""
    exact = q @ k.T  # (n, S)
    top = exact.topk(256, dim=1).indices
    out = []
    for rotate in (False, True):
        approx = fp8_logits(q, k, rotate)
        kept = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(approx.topk(256, dim=1).indices, top))
        out += [((approx - exact).norm(dim=1) / exact.norm(dim=1)).median().item(), kept / top.numel()]
    return out


g = torch.Generator().manual_seed(0)
q0, k0 = torch.randn(64, 128, generator=g, dtype=torch.float64), torch.randn(4096, 128, generator=g, dtype=torch.float64)
rows = []
for boost in (1, 30, 1000):
    for weighted in ((True,) if boost == 1 else (True, False)):
        k, q = k0.clone(), q0.clone()
        k[:, 5] *= boost
        q[:, 5] *= 1.0 if weighted else 0.0
        case = "no large channel" if boost == 1 else f"channel 5 x{boost}, " + ("queries weight it" if weighted
                                                                              else "queries ignore it")
        rows.append([case] + rounding_cost(q, k))
table(["keys", "logits err", "top-256 kept", "logits err, rotated", "top-256 kept, rotated"], rows, floatfmt=".4f")
worst = rows[-1]
display(Markdown(
    f"fp8 e4m3 is a floating format: one scale per vector sets only where its 448 lies, and a value 1000 x "
    f"smaller than the largest still keeps its 3 mantissa bits. So a large channel costs the others little "
    f"precision, and rotating does not reduce the error here: without a large channel it changes nothing "
    f"({rows[0][1]:.4f} against {rows[0][3]:.4f}); with one, the rotation spreads the channel into all 128 values, "
    f"and their rounding errors no longer cancel against queries that do not weight it: the logits' error goes "
    f"from {worst[1]:.4f} to {worst[3]:.4f} and the top-256 kept from {worst[2]:.1%} to {worst[4]:.1%} at 1000 x. "
    f"The engine rotates because DeepSeek's "
    f"inference code does, which keeps its scores comparable with that code's; the accuracy recorded in `data/` "
    f"was measured at commit {acc['provenance']['git_commit'][:10]}, "
    f"{'with' if 'fp8_indexer_numerics' in acc else 'before'} the rotation and the fp8 queries."))

# %% [markdown]
# ## Accuracy
# The reference model in float64 over five caches (`dsv32ref.experiments.fp8_accuracy`): float64 (the
# reference), bf16, FP8 as deployed, and FP8 for one part alone (the latent rows, or the indexer keys), on tiny
# DeepSeek-V3.2 shapes at FlashMLA's latent widths with index_topk well below the sequence; once with our dummy
# weights and once with a checkpoint written by transformers. Teacher-forced over the float64 arm's sequence:
# the attention output's error per layer, the overlap of the indexer's top-k, the logits' error and top-1
# agreement; free-running: greedy agreement with the float64 arm's tokens.

# %%
arms = [a for a in acc["arms"] if a != "float64"]
rows = []
for model, r in acc["models"].items():
    for arm in arms:
        a = r["arms"][arm]
        rows.append([model.replace(" seed ", ", init "), arm, a["greedy_agreement"], a["first_divergence"],
                     a["top1_agreement"], a["logits_rel_err_median"], max(a["attn_rel_rms_per_layer"]),
                     min(a["topk_overlap_per_layer"])])
first = next(iter(acc["models"].values()))
print(f"prompt {first['prompt_len']} tokens, {first['generated']} generated, index_topk {first['index_topk']}")
table(["model", "cache", "greedy agree", "parts at", "top-1 agree", "logits err (median)", "attn err (worst layer)",
       "top-k overlap (min)"], rows, floatfmt=".3f")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
colors = dict(zip(arms, [GREY] + OKABE_ITO[:3]))
for model, r in acc["models"].items():
    style = "-" if model.startswith("transformers") else ":"
    for arm in arms:
        a = r["arms"][arm]
        label = arm if model == next(m for m in acc["models"] if m.startswith("transformers")) else None
        axes[0].plot(a["attn_rel_rms_per_layer"], style, color=colors[arm], marker="o", label=label)
        axes[1].plot(a["topk_overlap_per_layer"], style, color=colors[arm], marker="o")
axes[0].set_yscale("log")
axes[0].set_ylim(top=8)  # room for the legend above the curves
n_layers = len(first["arms"]["fp8"]["attn_rel_rms_per_layer"])
for ax in axes:
    ax.set_xticks(range(n_layers))
axes[0].set_title("attention output error per layer")
axes[0].set_xlabel("layer")
axes[0].set_ylabel("RMS(diff) / RMS(float64 cache)")
axes[0].legend(fontsize=7, ncol=2, loc="upper left", title="cache (solid: transformers; dotted: dummy)",
               title_fontsize=7)
axes[1].set_title("indexer top-k overlap with the float64 cache's")
axes[1].set_xlabel("layer")
axes[1].set_ylabel("shared selected positions (fraction)")
show(fig)

# %%
def mean_over(kind, arm, metric):
    """metric(arm's result) averaged over the runs of one kind of model ("dummy" or "transformers")."""
    vals = [metric(r["arms"][arm]) for m, r in acc["models"].items() if m.startswith(kind)]
    return sum(vals) / len(vals)


def worst_attn(a):
    return max(a["attn_rel_rms_per_layer"])


def logits_err(a):
    return a["logits_rel_err_median"]


att = {arm: mean_over("transformers", arm, worst_attn) for arm in arms}
lg = {arm: mean_over("transformers", arm, logits_err) for arm in arms}
dummy_bf16 = mean_over("dummy", "bf16", worst_attn)
keys_vs_latent = "more" if att["fp8 indexer"] > att["fp8 latent"] else "less"
display(Markdown(
    f"On the checkpoints written by transformers (its initialiser; averaged over both draws) the worst layer's "
    f"attention error is {att['bf16']:.1e} with a bf16 cache and {att['fp8']:.1e} with the FP8 cache "
    f"({att['fp8'] / att['bf16']:.1f} x); the latent rows alone give {att['fp8 latent']:.1e}, the indexer keys "
    f"alone {att['fp8 indexer']:.1e}. The median logits error is {lg['bf16']:.1e} (bf16), {lg['fp8']:.1e} (FP8), "
    f"{lg['fp8 latent']:.1e} (latent only), {lg['fp8 indexer']:.1e} (keys only). The keys alone do "
    f"{keys_vs_latent} harm than the latent rows alone, though a key takes "
    f"{indexer_key_bytes(128) / LATENT_ROW_BYTES:.0%} of a latent row's bytes (DeepSeek-V3.2's widths): a key's "
    f"error moves the indexer's "
    f"selection (the top-k overlap drops), and a changed selection changes the attention output by more than a "
    f"rounded value does. Our dummy weights make a chaotic model (the worst layer's error is already "
    f"{dummy_bf16:.1e} with a bf16 cache, and greedy decoding parts within a few tokens): there only the order of "
    f"the caches carries over. These are tiny random models: how a trained model's outputs move is not measured "
    f"here."))

# %% [markdown]
# ## Speed on the H200
# `sparse_mla_paged` decode over the bf16 cache and over FlashMLA's FP8 rows, B requests of one token, each
# with its own context and `index_topk` = 2048 selected rows, at 16, 64 and 128 heads (a TP4, TP2 and TP1 rank
# of GLM-5.2 or DeepSeek-V3.2); and the indexer's scores pass over bf16 and FP8 keys. Both caches hold the same
# values, so the two kernels are checked against each other; bytes are the rows each must read once. Times are
# CUDA-graph replays (medians), the copy bandwidth and the bf16 GEMM rate are measured in the same run.
#
# Each decode shape against its roofline (`dsv32ref.bench.kernels.roofline`): its bytes at the copy bandwidth
# against its FLOPs (q K^T over 576 columns, P V over 512) at the GEMM rate; the larger is the shape's bound. FP8
# only shrinks the rows' bytes, so what it can gain is the bf16 bound over the FP8 one: a little under 1152 / 656
# where both are bound by their bytes (the queries, indices and outputs weigh the same in both), less where the
# FLOPs take over (many heads), nothing where bf16 is already bound by its FLOPs.

# %% nbval-ignore
dec = [r for r in speed["results"] if r["kernel"] == "sparse_mla_decode"]
sco = [r for r in speed["results"] if r["kernel"] == "indexer_scores"]
print(f"copy bandwidth {speed['ceilings']['copy_GBps']:.0f} GB/s; all checks ok: "
      f"{all(r['ok'] for r in speed['results'])}")
ceil = speed["ceilings"]
for r in dec:  # each arm's roofline: its bytes at the copy bandwidth, the shape's FLOPs at the GEMM rate
    r["roof"] = {f: roofline(r["flops"], r[f"bytes_{f}"], r[f"ms_{f}"], ceil) for f in ("bf16", "fp8")}
    r["roof_gain"] = r["roof"]["bf16"]["floor_ms"] / r["roof"]["fp8"]["floor_ms"]
kernels = sorted({k for r in dec for k in r["impl"].values()})
letter = {k: chr(ord("a") + i) for i, k in enumerate(kernels)}
print(f"bf16 GEMM {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s; kernels: "
      + ", ".join(f"{letter[k]} {k}" for k in kernels) + "; 32k context:")
table(["B", "heads", "kernel bf16/fp8", "bf16 us", "fp8 us", "speed-up", "roofline gain", "bf16 bound",
       "bf16 % of copy", "fp8 % of copy"],
      [[r["B"], r["heads"], "/".join(letter[r["impl"][f]] for f in ("bf16", "fp8")), r["ms_bf16"] * 1e3,
        r["ms_fp8"] * 1e3, r["speedup"], r["roof_gain"], r["roof"]["bf16"]["bound"], 100 * r["fraction_of_copy_bf16"],
        100 * r["fraction_of_copy_fp8"]] for r in dec if r["context"] == 32768], floatfmt=".2f")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
ctx = max(r["context"] for r in dec)
for i, h in enumerate(sorted({r["heads"] for r in dec})):
    rs = sorted((r for r in dec if r["heads"] == h and r["context"] == ctx), key=lambda r: r["B"])
    axes[0].plot([r["B"] for r in rs], [r["speedup"] for r in rs], marker="o", color=OKABE_ITO[i], label=f"{h} heads")
    other = [r for r in rs if r["impl"]["bf16"] != r["impl"]["fp8"]]
    axes[0].plot([r["B"] for r in other], [r["speedup"] for r in other], "o", ms=12, mfc="none", color=GREY)
axes[0].axhline(1.0, color=GREY, lw=1)
axes[0].axhline(1152 / 656, color=GREY, lw=1, ls="--", label="bytes ratio 1152 / 656")
axes[0].set_xscale("log", base=2)
axes[0].set_title(f"sparse MLA decode, {ctx // 1024}k context (ringed: the caches on different kernels)",
                  fontsize=10)
axes[0].set_xlabel("requests (one token each)")
axes[0].set_ylabel("bf16 time / FP8 time")
axes[0].legend(fontsize=8)
for i, c in enumerate(sorted({r["context"] for r in sco})):
    pts = sorted((r["B"], 100 * r["fraction_of_copy_fp8"]) for r in sco if r["context"] == c)
    axes[1].plot(*zip(*pts), marker="o", color=OKABE_ITO[i], label=f"FP8 keys, {c // 1024}k")
    pts = sorted((r["B"], 100 * r["fraction_of_copy_bf16"]) for r in sco if r["context"] == c)
    axes[1].plot(*zip(*pts), marker="s", ls=":", color=OKABE_ITO[i], label=f"bf16 keys, {c // 1024}k")
axes[1].set_xscale("log", base=2)
axes[1].set_title("indexer scores: bytes read / time")
axes[1].set_xlabel("requests (one token each)")
axes[1].set_ylabel("% of the measured copy bandwidth")
axes[1].legend(fontsize=7)
show(fig)

# %%
lo, hi = min(r["speedup"] for r in dec), max(r["speedup"] for r in dec)
worst = min(dec, key=lambda r: r["speedup"])
s128 = [r for r in sco if r["B"] == max(x["B"] for x in sco) and r["context"] == ctx][0]
s1 = [r for r in sco if r["B"] == 1 and r["context"] == ctx][0]
slower = sum(r["speedup"] < 1 for r in dec)
same = sum(r["impl"]["bf16"] == r["impl"]["fp8"] for r in dec)
# memory-bound in practice: bound by its bytes on the roofline, and bf16 moves at least half the copy bandwidth
mem = [r for r in dec if r["roof"]["bf16"]["bound"] == "memory" and r["fraction_of_copy_bf16"] >= 0.5]
won = [r for r in mem if r["speedup"] > 1]
text = (f"Our FP8 decode is slower than our bf16 decode at {slower} of the {len(dec)} shapes measured ({same} of "
        f"them with both caches on one kernel): FP8 takes {1 / hi:.2f} to {1 / lo:.2f} x the bf16 time, the most "
        f"at {worst['B']} requests and {worst['heads']} heads, where FP8 reaches "
        f"{100 * worst['fraction_of_copy_fp8']:.0f} % of the copy bandwidth and bf16 "
        f"{100 * worst['fraction_of_copy_bf16']:.0f} %. By the roofline, bf16 is bound by its FLOPs at "
        f"{sum(r['roof']['bf16']['bound'] == 'compute' for r in dec)} shapes (there FP8 can gain nothing) and by "
        f"its bytes at the rest. ")
if mem:
    pairs = sorted({(r["B"], r["heads"]) for r in mem})
    text += (f"It is memory-bound in practice (bytes-bound, and at least half the copy bandwidth) at {len(mem)} "
             f"shapes (requests x heads: {', '.join(f'{b} x {h}' for b, h in pairs)}), where FP8 "
             f"is faster at {len(won)}: its speed-up is {min(r['speedup'] for r in mem):.2f} to "
             f"{max(r['speedup'] for r in mem):.2f} x where its roofline allows {min(r['roof_gain'] for r in mem):.2f} "
             f"to {max(r['roof_gain'] for r in mem):.2f} x. ")
else:
    text += "At no bytes-bound shape does bf16 reach half the copy bandwidth. "
ws = [r for r in dec if r["impl"]["fp8"] == "sm_90 warp-specialized" and r["speedup"] < 1]
if ws:
    text += (f"On sm_90's 64-head kernel (sm_90 warp-specialized), where FP8 is slower at {len(ws)} shapes, the "
             f"bytes are not what limits it; its producer's loads are: over FP8 rows its register loads hold one "
             f"step's c_kv (32 KiB) at most, where cp.async gathers of bf16 rows keep two stages (144 KiB) in flight "
             f"per SM. The producer issues them before its stage is free and resolves the next step's rows while "
             f"they fly, but it must then multiply them out (about three instructions a value) and store them before "
             f"it can issue the next step's. FlashMLA's FP8 decode dequantises in a producer warpgroup of its own "
             f"too. ")
text += (f"The indexer's scores pass over FP8 keys runs at {s1['speedup']:.2f} x the bf16 keys' speed for one "
         f"request ({s1['ms_fp8'] * 1e3:.1f} against {s1['ms_bf16'] * 1e3:.1f} us at {ctx // 1024}k keys) and "
         f"{s128['speedup']:.2f} x at {s128['B']} requests ({s128['ms_fp8'] * 1e3:.0f} against "
         f"{s128['ms_bf16'] * 1e3:.0f} us), at {100 * s128['fraction_of_copy_fp8']:.0f} % of the copy bandwidth "
         f"where bf16 keys reach {100 * s128['fraction_of_copy_bf16']:.0f} %: less than its bytes allow.")
display(Markdown(text))

# %% [markdown]
# ## The PR's TTFT protocol with the FP8 cache
# The `+fp8` arms run the same engine with `kv_cache_dtype="fp8"` (both caches in FP8, written by the fused
# norm-and-RoPE kernel, read by the sparse kernels), in the same run as the bf16 arms: 8-token prompts, one
# output token, GLM-5.2's attention at full size with the MoE reduced, one GPU.

# %%
vs = ttft["variants"]
rows = [[v, vs[v]["kv_cache_dtype"], vs[v]["mean_ms"], vs[v]["median_ms"], vs[v]["ttft_over_floor"],
         vs[v]["kv_tokens_per_gib"], ttft["tokens_equal_to_first_arm"][v]]
        for v in ("narrow", "narrow+fp8", "none", "none+fp8")]
table(["arm", "kv cache", "mean ms", "median ms", "TTFT / floor", "KV tokens per GiB", "tokens = bf16's"], rows)

# %% [markdown]
# Where the FP8 arms' first token differs, how close was the call? After the timed loop the first bf16 arm
# generates each request's token once more, untimed, and records the gap between its two largest logits.

# %%
margins = sorted(ttft["first_token_margins"])
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.hist(margins, bins=32, color=OKABE_ITO[0])
ax.set_title("bf16 arm: first token's top-two logit gap, per request")
ax.set_xlabel("largest logit - second largest (logit units)")
ax.set_ylabel("requests")
show(fig)

# %%
fp8_tok, bf16_tok = ttft["fp8_first_tokens"]["none+fp8"], ttft["first_tokens"]
order = sorted(range(len(margins_by_request := ttft["first_token_margins"])), key=lambda i: margins_by_request[i])
quarter = len(order) // 4
quartiles = []
for q in range(4):
    idx = order[q * quarter:(q + 1) * quarter] if q < 3 else order[3 * quarter:]
    ms = [margins_by_request[i] for i in idx]
    same = sum(fp8_tok[i] == bf16_tok[i] for i in idx)
    quartiles.append([f"Q{q + 1}", min(ms), max(ms), len(idx), same / len(idx)])
ties = [i for i in order if margins_by_request[i] == 0]
table(["margin quartile", "smallest gap", "largest gap", "requests", "none+fp8 token = bf16's"], quartiles,
      floatfmt=".3f")
agree = ", ".join(f"{q[4]:.0%}" for q in quartiles)
display(Markdown(
    f"By quarter of the gap, from the narrowest: {agree} of the requests keep the bf16 token (the widest quarter's "
    f"gaps run from {quartiles[3][1]:.3f} to {quartiles[3][2]:.3f} logit units); of the {len(ties)} exact ties, "
    f"{sum(fp8_tok[i] == bf16_tok[i] for i in ties)} agree. The FP8 cache's rounding, carried through "
    f"{ModelConfig.preset(ttft['preset']).num_hidden_layers} layers of random weights, moves the logits by more "
    f"than most of these gaps."))

# %% [markdown]
# ## Capture memory with the FP8 cache
# `dsv32ref capture` starts the engine at one TP4 rank's heads (16) with each boundary, as a serving engine
# sizes it: weights, a profile run, the graph-memory estimate (or not), then the KV cache takes the rest of the
# budget, then every capture size. Once with the bf16 cache, once with the FP8 cache.

# %%
caps = {"bf16": load("capture_memory_glm-5.2_h16.json"), "fp8": load("capture_memory_glm-5.2_h16_fp8.json")}
rows = []
for kv, cm in caps.items():
    for r in cm["runs"]:
        st_ = r["startup"]
        rows.append([kv, r["boundary"], "on" if r["estimate_graph_memory"] else "off", st_["kv_cache"] / 2**30,
                     st_["kv_tokens_per_gib"], st_["kv_cache"] / 2**30 * st_["kv_tokens_per_gib"] / 1e6,
                     f"out of memory at {r['failed_at']}" if r["failed"] else "starts"])
table(["cache", "boundary", "estimate", "KV cache (GiB)", "tokens per GiB", "tokens (M)", "outcome"], rows,
      floatfmt=".2f")
for kv, cm in caps.items():
    p = cm["provenance"]
    print(f"{kv}: {p['device']}, {p['date'][:10]}, commit {p['git_commit'][:10]}")

# %%
first = {kv: cm["runs"][0]["startup"] for kv, cm in caps.items()}
fails = {kv: [r["failed_at"] for r in cm["runs"] if r["failed"]] for kv, cm in caps.items()}
display(Markdown(
    f"With the FP8 cache the same budget holds {first['fp8']['kv_tokens_per_gib'] / first['bf16']['kv_tokens_per_gib']:.2f}"
    f" x the tokens ({first['fp8']['kv_tokens_per_gib']} against {first['bf16']['kv_tokens_per_gib']} per GiB at 16 "
    f"heads). It does not rescue the copy variant: its static buffers do not depend on the cache's dtype, and the "
    f"KV cache takes whatever the budget leaves either way, so `narrow_copy` with the estimate off still runs out "
    f"of memory in the FULL phase (FP8: {', '.join(fails['fp8']) or 'never'}; bf16: "
    f"{', '.join(fails['bf16']) or 'never'}). With the estimate on, "
    + ("every boundary starts with both caches." if all(not r["failed"] for cm in caps.values() for r in cm["runs"]
                                                       if r["estimate_graph_memory"]) else
       "some boundaries still run out of memory (table).")))

# %% [markdown]
# ## Conclusion

# %%
n, n8, z, z8 = (vs[v] for v in ("narrow", "narrow+fp8", "none", "none+fp8"))
display(Markdown(
    f"- Memory: the FP8 cache stores a DeepSeek-V3.2 token in {ratio:.2f} of the bf16 bytes; the engine's "
    f"start-up gives {n8['kv_tokens_per_gib'] / n['kv_tokens_per_gib']:.2f} x the tokens per GiB.\n"
    f"- Accuracy: on the tiny checkpoints written by transformers the FP8 cache's worst-layer attention error "
    f"is {att['fp8'] / att['bf16']:.1f} x the bf16 cache's, and the indexer keys alone do {keys_vs_latent} harm "
    f"than the latent rows alone. On the TTFT protocol the FP8 arms' first token equals the bf16 arms' in "
    f"{ttft['tokens_equal_to_first_arm']['narrow+fp8']:.0%} of requests. The calls are close: over a "
    f"{ModelConfig.preset(ttft['preset']).vocab_size}-token vocabulary the bf16 arm's top two logits lie "
    f"{margins[len(margins) // 2]:.3f} apart at the median and tie exactly in {sum(m == 0 for m in margins)} of "
    f"{len(margins)} requests, and dummy weights amplify rounding layer by layer (on the {n_layers}-layer dummy model "
    f"above, even a bf16 cache keeps the float64 cache's top-1 token in only "
    f"{mean_over('dummy', 'bf16', lambda a: a['top1_agreement']):.0%} of steps); the FP8 arm keeps the "
    f"bf16 token in {quartiles[0][4]:.0%} of the quarter of requests with the narrowest gaps, {quartiles[3][4]:.0%} "
    f"of the widest.\n"
    f"- Speed: decode over FP8 rows takes {1 / hi:.2f} to {1 / lo:.2f} x the time over bf16 rows (FP8 faster at "
    f"{len(dec) - slower} of {len(dec)} shapes, at {len(won)} of the {len(mem)} where bf16 is memory-bound in "
    f"practice), and TTFT moves from "
    f"{n['mean_ms']:.2f} to "
    f"{n8['mean_ms']:.2f} ms (`narrow`) and from {z['mean_ms']:.2f} to {z8['mean_ms']:.2f} ms (`none`): in the "
    f"PR's regime (8-token prompts) the cache is not what TTFT waits on."))
