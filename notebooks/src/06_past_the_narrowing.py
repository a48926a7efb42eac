# %% [markdown]
# # Past the narrowing: no eager break at all, the regime map, and a TTFT model
#
# vLLM's pull request "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region" kept only the sparse indexer and
# the sparse attention eager and halved TTFT in one regime: 8-token prompts, one output token, PIECEWISE
# prefill. This notebook asks what comes after it, from measurements on one H200 read from `data/`:
#
# 1. `none`: a sixth boundary with **no eager break**. Prefill takes the graph-safe path that uniform decode
#    already takes (indexer scores into a static `[tokens, max_model_len]` workspace, one top-k and one
#    sparse-attention launch per layer over the whole batch, lengths and block tables read on the device), so
#    FULL graphs capture prefill too. What is left between the GPU-busy floor and TTFT, term by term.
# 2. The regime map: TTFT against prompt length (capture sizes stop at 512 tokens) and decode time per output
#    token (TPOT), FULL against PIECEWISE, per variant.
# 3. A TTFT model: the CPU-predicted launch ledger, host costs measured once on the GPU, and the floor.
#
# The model is GLM-5.2's attention at full size (64 heads, every layer) with the MoE reduced to four routed
# experts and the shared one, on one GPU, bf16 (`dsv32ref.config.REDUCED_MOE`); the PR ran TP4/EP4.

# %%
import json

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from dsv32ref import ModelConfig
from dsv32ref.config import reduced_moe
from dsv32ref.engine import BOUNDARIES
from dsv32ref.report import OKABE_ITO, show


def load(name):
    with open(f"../data/{name}") as fh:
        return json.load(fh)


seeds = load("seeds.json")
run = load("ttft_glm-5.2.json")
regimes = load("regimes_glm-5.2.json")
predicted = load("ledger_predicted_glm-5.2.json")
vs = run["variants"]
COLORS = dict(zip(BOUNDARIES, OKABE_ITO[:5] + [OKABE_ITO[7]]))
for name, d in (("TTFT run", run), ("regime map", regimes), ("prediction", predicted)):
    p = d["provenance"]
    print(f"{name:<11} {p['device']}, torch {p['torch']}, commit {p['git_commit'][:10]}, {p['date'][:10]}")

# %% [markdown]
# ## 1. No eager break
# Every variant ran the PR's protocol in one process, interleaved request by request (`dsv32ref ttft`).
# The floor is the GPU-busy time of one profiled request (the sum of its kernel durations).

# %%
rows = []
for v, r in vs.items():
    led = r["ledger"]
    rows.append(f"| {v} | {r['prefill_runs_as']} | {r['mean_ms']:.2f} | {r['min_ms']:.2f} "
                f"| {r['p99_ms']:.2f} | {led['gpu_busy_ms']:.2f} | {r['ttft_over_floor']:.3f} | {led['direct_total']} "
                f"| {led['graph_launches']} |")
display(Markdown("| variant | prefill runs as | TTFT mean (ms) | min (ms) | p99 (ms) | floor (ms) | mean / floor "
                 "| direct launches | graph launches |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)))

# %%
none, narrow = vs["none"], vs["narrow"]
a = none["anatomy"]
hc = run["host_costs"]
gaps_ms = none["ledger"]["kernels"] * hc["in_graph_gap_us"] / 1e3
display(Markdown(
    f"`none` replays one FULL graph per prefill: {none['ledger']['graph_launches']} graph launch and "
    f"{none['ledger']['direct_total']} direct launches per request (logits, sampling), against "
    f"{narrow['ledger']['graph_launches']} graph launches and {narrow['ledger']['direct_total']} direct launches "
    f"for `narrow`. Its mean TTFT is {none['mean_ms']:.2f} ms, {none['ttft_over_floor']:.3f} x its floor "
    f"({narrow['ttft_over_floor']:.3f} x for `narrow`, {vs['narrow_out']['ttft_over_floor']:.3f} x for "
    f"`narrow_out`). The anatomy of its step (medians of {a['requests']} requests): "
    f"{a['stage_ms']:.3f} ms of host work before the first launch (metadata built and staged, two uploads), "
    f"{a['execute_ms']:.3f} ms to launch the graph, and {a['gpu_ms']:.2f} ms of GPU time from the upload to the "
    f"sampled tokens, {a['gpu_ms'] - none['ledger']['gpu_busy_ms']:.2f} ms above the floor. The GPU loses "
    f"{hc['in_graph_gap_us']:.2f} us between consecutive graph kernels (measured on a chain of small kernels); "
    f"times the {none['ledger']['kernels']} kernels of a request that is {gaps_ms:.2f} ms: the largest term."))

# %%
fig, ax = plt.subplots(figsize=(9, 3.6))
names = [v for v in vs if "+" not in v]
floor = [vs[v]["ledger"]["gpu_busy_ms"] for v in names]
rest = [vs[v]["mean_ms"] - f for v, f in zip(names, floor)]
ax.barh(names, floor, color="#999999", label="GPU-busy floor")
ax.barh(names, rest, left=floor, color="#D55E00", label="TTFT above the floor (host, launch gaps)")
for i, v in enumerate(names):
    ax.text(vs[v]["mean_ms"] + 0.3, i, f"{vs[v]['ttft_over_floor']:.2f}x", va="center", fontsize=8)
ax.axvline(seeds["ttft"]["narrow"]["mean_ms"], color="black", ls=":", lw=1, label="PR: narrow, TP4 (mean)")
ax.set_xlabel("mean TTFT (ms)")
ax.set_ylabel("variant")
ax.set_title("GLM-5.2, 8-token prompts: TTFT = floor + what the step adds (one H200)")
ax.legend(loc="lower right", fontsize=8)
ax.set_xlim(0, max(vs[v]["mean_ms"] for v in names) * 1.12)
show(fig)

# %% [markdown]
# **The top-k skip.** With `EngineConfig.skip_short_topk`, a step whose requests all have at most
# `index_topk` keys skips the indexer's scoring and selection: the top-k would keep every key. It applies
# where Python runs at step time, in the eager regions; a FULL graph always replays its indexer.

# %%
for v in ("narrow", "narrow_out"):
    s = vs.get(f"{v}+skip")
    if s is None:
        continue
    print(f"{v:<11} mean TTFT {vs[v]['mean_ms']:.2f} ms, with the skip {s['mean_ms']:.2f} ms "
          f"({s['mean_ms'] - vs[v]['mean_ms']:+.2f}); floor {vs[v]['ledger']['gpu_busy_ms']:.2f} -> "
          f"{s['ledger']['gpu_busy_ms']:.2f} ms")
print("same first tokens in every arm:", run["same_tokens_across_variants"])

# %% [markdown]
# ## 2. The regime map
# One process, the variants interleaved, one shared KV cache; capture sizes up to 512 tokens. Prompts longer than
# the step's token budget are prefilled in chunks of it (chunked prefill, as vLLM does); decode runs at every
# (context, batch) whose cache fits the KV budget.

# %%
P = regimes["prefill"]
lens = [int(L) for L in P]
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for v in regimes["protocol"]["variants"]:
    axes[0].plot(lens, [P[str(L)][v]["mean_ms"] for L in lens], marker="o", color=COLORS[v], label=v)
    axes[1].plot(lens, [P[str(L)][v]["over_floor"] for L in lens], marker="o", color=COLORS[v], label=v)
axes[0].plot(lens, [P[str(L)]["none"]["floor_ms"] for L in lens], color="#999999", ls="--", label="floor (none)")
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.axvline(max(regimes["protocol"]["capture_sizes"]), color="black", ls=":", lw=1)
    ax.set_xlabel("prompt length (tokens)")
axes[0].set_yscale("log")
axes[0].set_ylabel("mean TTFT (ms)")
axes[0].set_title("TTFT against prompt length (dotted: the largest capture size)")
axes[1].set_ylabel("TTFT / GPU-busy floor")
axes[1].set_title("what the step adds, relative to the floor")
axes[0].legend(fontsize=8, loc="upper left")
show(fig)

# %%
top = max(regimes["protocol"]["capture_sizes"])
past = [L for L in lens if L > top]
rows = "\n".join(f"| {L} | " + " | ".join(f"{P[str(L)][v]['mean_ms']:.1f} ({P[str(L)][v]['runs_as']})"
                                         for v in regimes["protocol"]["variants"]) + " |" for L in lens)
display(Markdown("| prompt | " + " | ".join(regimes["protocol"]["variants"]) + " |\n|---|"
                 + "---|" * len(regimes["protocol"]["variants"]) + "\n" + rows))
w8, n8 = P[str(lens[0])]["wide"]["mean_ms"], P[str(lens[0])]["narrow"]["mean_ms"]
w5, n5 = P[str(top)]["wide"]["mean_ms"], P[str(top)]["narrow"]["mean_ms"]
display(Markdown(
    f"At {lens[0]} tokens wide / narrow is {w8 / n8:.2f}; at {top} tokens, the largest captured size, it is "
    f"{w5 / n5:.2f}: the GEMMs grow with the prompt while the launches do not. Past {top} tokens "
    f"({', '.join(map(str, past))}) no graph exists and every variant runs eagerly: the variants differ by "
    f"at most {max(abs(P[str(L)][v]['mean_ms'] / P[str(L)]['narrow']['mean_ms'] - 1) for L in past for v in regimes['protocol']['variants']):.1%}."))

# %%
D = regimes["decode"]
fig, axes = plt.subplots(1, len(D), figsize=(14, 4), sharey=False)
for ax, (C, rows_) in zip(axes, D.items()):
    batches = [int(b) for b in rows_]
    for v in regimes["protocol"]["variants"]:
        ax.plot(batches, [rows_[str(b)][v]["FULL"]["median_ms"] for b in batches], marker="o", color=COLORS[v],
                label=f"{v} FULL")
        if rows_[str(batches[0])][v]["PIECEWISE"] is not None:
            ax.plot(batches, [rows_[str(b)][v]["PIECEWISE"]["median_ms"] for b in batches], marker="x", ls="--",
                    color=COLORS[v], label=f"{v} PIECEWISE")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("median time per output token (ms)")
    ax.set_title(f"decode at {C} tokens of context")
axes[0].legend(fontsize=7, ncol=2)
show(fig)

# %%
C_hi = max(D, key=int)
B_hi = max(D[C_hi], key=int)
r = D[C_hi][B_hi]
display(Markdown(
    f"At {C_hi} tokens of context and {B_hi} requests, PIECEWISE decode takes "
    f"{r['wide']['PIECEWISE']['median_ms']:.1f} ms per token for `wide` against {r['wide']['FULL']['median_ms']:.1f} "
    f"ms in its FULL graph, and {r['narrow']['PIECEWISE']['median_ms']:.1f} ms for `narrow` against "
    f"{r['narrow']['FULL']['median_ms']:.1f}. Decode steps are uniform, so the default mode replays FULL graphs "
    f"for every variant and the boundary does not matter there; it matters under PIECEWISE decode, where wide "
    f"pays its eager regions once per token. The step's host work before the launch grows with the context "
    f"(block tables built and validated in Python): {r['narrow']['FULL']['stage_median_ms']:.2f} ms of the "
    f"{r['narrow']['FULL']['median_ms']:.1f} ms here."))

# %% [markdown]
# **Where the GPU time goes at long context.** Each case's GPU time is split by kernel: the indexer (scores and
# top-k) and the sparse attention, out of everything the step ran (its GEMMs, norms, MoE), from one profiled step.

# %%
pr_ = regimes["protocol"]
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for v in pr_["variants"]:
    axes[0].plot(lens, [P[str(L)][v]["sparse_mla_ms"] / P[str(L)][v]["floor_ms"] for L in lens], marker="o",
                 color=COLORS[v], label=f"{v}: sparse MLA")
    axes[0].plot(lens, [P[str(L)][v]["indexer_ms"] / P[str(L)][v]["floor_ms"] for L in lens], marker="x", ls="--",
                 color=COLORS[v], label=f"{v}: indexer")
axes[0].set_xscale("log", base=2)
axes[0].set_xlabel("prompt length (tokens)")
axes[0].set_ylabel("share of the prefill's GPU time")
axes[0].set_title("prefill: the sparse path's share")
axes[0].legend(fontsize=7, ncol=2)
ctxs = [int(C) for C in D]
for b, mk in ((min(pr_["batches"]), "o"), (max(int(x) for x in D[str(ctxs[-1])]), "s")):
    g = [D[str(C)][str(b)]["none"]["FULL"]["gpu"] for C in ctxs if str(b) in D[str(C)]]
    cs = [C for C in ctxs if str(b) in D[str(C)]]
    axes[1].plot(cs, [x["sparse_mla_ms"] / x["busy_ms"] for x in g], marker=mk, color=OKABE_ITO[5],
                 label=f"sparse MLA, {b} request(s)")
    axes[1].plot(cs, [x["indexer_ms"] / x["busy_ms"] for x in g], marker=mk, ls="--", color=OKABE_ITO[6],
                 label=f"indexer, {b} request(s)")
axes[1].set_xscale("log", base=2)
axes[1].set_xlabel("context (tokens)")
axes[1].set_ylabel("share of the decode step's GPU time")
axes[1].set_title("decode (none, FULL): the sparse path's share")
axes[1].legend(fontsize=7)
show(fig)

# %%
L_hi, C_top = max(lens), max(ctxs)
ph = P[str(L_hi)]["none"]
d1 = D[str(C_top)][str(min(pr_["batches"]))]["none"]["FULL"]
skipped = regimes["decode_skipped"]
display(Markdown(
    f"A {L_hi}-token prompt takes {ph['mean_ms'] / 1e3:.2f} s to prefill with `none` ({ph['chunks']} chunks of up "
    f"to {pr_['token_budget']} tokens, {ph['over_floor']:.3f} x its floor): sparse attention "
    f"{ph['sparse_mla_ms'] / ph['floor_ms']:.0%} of its GPU time and the indexer "
    f"{ph['indexer_ms'] / ph['floor_ms']:.0%}, against {P[str(lens[0])]['none']['sparse_mla_ms'] / P[str(lens[0])]['none']['floor_ms']:.0%} "
    f"and {P[str(lens[0])]['none']['indexer_ms'] / P[str(lens[0])]['none']['floor_ms']:.1%} at {lens[0]} tokens. "
    f"Decoding one request at {C_top} tokens of context takes {d1['median_ms']:.1f} ms per token, the indexer "
    f"{d1['gpu']['indexer_ms'] / d1['gpu']['busy_ms']:.1%} and sparse attention "
    f"{d1['gpu']['sparse_mla_ms'] / d1['gpu']['busy_ms']:.1%} of it: at one token per request the weights' read "
    f"dominates. Not run, their caches exceeding the run's {regimes['protocol']['kv_cache_gib']:.1f} GiB KV cache, as "
    f"(context, requests): " + ", ".join(f"({c}, {b})" for c, b in skipped) + "."))

# %% [markdown]
# ## 3. A TTFT model
# `dsv32ref ledger --predict` counts every launch of one 8-token prefill on a CPU (the model's structure at
# tiny widths), and predicts TTFT = stage + max(host forward, GPU forward) + sync, with host costs measured
# on the GPU in the TTFT run's own process (`dsv32ref.experiments.host_costs`) and the floor of the TTFT run
# (`dsv32ref.experiments.ttft_model`).

# %%
tm = predicted["ttft_model"]
c = tm["host_costs"]
keys = ("aten_launch_us", "gemm_launch_us", "memcpy_us", "graph_launch_us", "graph_node_us", "eager_region_us",
        "in_graph_gap_us", "stage_us", "sync_us")
print("host costs (us): " + ", ".join(f"{k[:-3]} {c[k]:.2f}" for k in keys[:5]))
print("                 " + ", ".join(f"{k[:-3]} {c[k]:.2f}" for k in keys[5:]))
wr = list(c["wrapper_us"].items())
print("regions around the Triton launchers (us): " + ", ".join(f"{k} {x:.0f}" for k, x in wr))
rows = "\n".join(f"| {v} | {m['host_source']} | {m['host_forward_ms']:.2f} | {m['gpu_forward_ms']:.2f} "
                 f"| {m['host_bound_layers']} / {m['layers']} | {m['ttft_ms']:.2f} | {m['measured_ttft_ms']:.2f} "
                 f"| {m['miss_pct']:+.1f} | {m['measured_median_ms']:.2f} | {m['miss_median_pct']:+.1f} |"
                 for v, m in tm["variants"].items())
display(Markdown("| variant | host per layer | host forward (ms) | GPU forward (ms) | host-bound layers | predicted (ms) "
                 "| measured mean (ms) | miss (%) | median (ms) | miss (%) |\n|---|---|---|---|---|---|---|---|---|---|\n"
                 + rows))

# %%
fig, ax = plt.subplots(figsize=(8, 3.4))
names = list(tm["variants"])
x = range(len(names))
ax.bar([i - 0.2 for i in x], [tm["variants"][v]["ttft_ms"] for v in names], 0.4, color="#56B4E9", label="predicted")
ax.bar([i + 0.2 for i in x], [tm["variants"][v]["measured_ttft_ms"] for v in names], 0.4, color="#E69F00",
       label="measured (mean)")
ax.set_xticks(list(x), names, rotation=15)
ax.set_ylabel("TTFT (ms)")
ax.set_xlabel("variant")
ax.set_title("TTFT model against the measurement, 8-token prompts")
ax.legend(fontsize=8, loc="upper right")
show(fig)

# %%
miss = {v: m for v, m in tm["variants"].items() if abs(m["miss_pct"]) > 10}
ok = [v for v in tm["variants"] if v not in miss]
ok_median = [v for v, m in tm["variants"].items() if abs(m["miss_median_pct"]) <= 10]
text = (f"Host costs from the TTFT run at {tm['measured_commit'][:7]}. Within 10 % of the measured mean: "
        f"{', '.join(ok) or 'none'}; "
        f"of the median: {', '.join(ok_median) or 'none'} (the model prices one typical request). ")


def slow_requests(v):
    """Indices of the requests more than 10 % above the variant's median TTFT."""
    x = vs[v]["ttft_ms"]
    med = sorted(x)[len(x) // 2]
    return {i for i, t in enumerate(x) if t > 1.1 * med}


for v, m in miss.items():
    slow = m["measured_ttft_ms"] - m["measured_median_ms"]
    other = "narrow" if v != "narrow" else "wide"
    mine, theirs = slow_requests(v), slow_requests(other)
    text += (f"`{v}` misses the mean by {m['miss_pct']:+.1f} % and the median by {m['miss_median_pct']:+.1f} %: "
             f"its mean is {slow:.2f} ms above its median, the host's slow requests (p99 "
             f"{vs[v]['p99_ms']:.1f} ms), which a model of one typical request does not contain. They come in "
             f"bursts that hit every host-heavy arm at once: of `{v}`'s {len(mine)} requests more than 10 % above "
             f"its median, {len(mine & theirs) / max(len(mine), 1):.0%} are slow for `{other}` too at the same "
             f"request index (the arms run within a fraction of a second of each other), and `none`, whose host "
             f"waits on the GPU, has {len(slow_requests('none'))}: the machine's host, not the variant. ")
fl = {v: m["host_forward_ms"] - m["host_forward_from_launches_ms"] for v, m in tm["variants"].items()
      if m["host_source"] == "measured regions"}
text += ("The eager regions' host times, measured in replay, differ from the sum of their launches' costs "
         "(each timed in a loop of one op) by " + ", ".join(f"{x:+.1f} ms ({v})" for v, x in fl.items())
         + " per request: a launch inside a region does not cost what it costs in a loop of its own (the "
         "Python between launches, caches), which is why the model uses the regions' measured times.")
display(Markdown(text))

# %% [markdown]
# ## What a serving engine would change to drop the eager break
# What our `none` boundary needed, read from `dsv32ref/engine/model.py`:
# - **Host metadata out of the attention.** The eager path loops over requests with `query_start_loc_cpu`
#   and sizes each request's score buffer by `seq_lens_cpu`. The graph-safe path reads `req_indices`,
#   `positions`, `seq_lens` and the block table on the device, so nothing in the layer depends on the step.
# - **A static score workspace** of `[max tokens, max_model_len]` fp32, owned by the engine: its memory is
#   below, the price of giving every captured size a fixed address.
# - **Kernels whose grids depend only on the padded token count** and the workspace width: the indexer
#   scores (positions bound each row), the top-k (each row's length read on the device) and the sparse
#   attention (split-K over the top-k, merged on the device). Padding rows point at an empty request and
#   write nothing.
# - **FULL graphs for prefill sizes**: the runner captures every size in FULL and skips the PIECEWISE phase.

# %%
ws = regimes["scores_workspace_bytes"]
ml = regimes["protocol"]["max_model_len"]
mt = max(regimes["protocol"]["prompt_lens"])
display(Markdown(
    f"In the regime map (max_model_len {ml}, steps of up to {mt} tokens) the workspace of `none` holds "
    f"{ws['none'] / 2**20:.0f} MiB ({mt} x {ml} x 4 B), against {ws['narrow'] / 2**20:.1f} MiB for the others "
    f"(decode rows only). Prompts longer than the largest capture size still run eagerly, as every variant "
    f"does."))

# %% [markdown]
# ## Fewer kernels: the fused MoE
# The reduced MoE of the plain arms is PyTorch ops: a router of about a dozen small kernels, a scatter, the
# experts' einsums and the shared expert's GEMMs. `EngineConfig(moe="fused")` runs each MoE layer through
# `dsv32ref.kernels.fused_moe` instead: the router (two launches), the alignment of (token, expert) pairs, grouped
# gate/up and down GEMMs over the tokens each expert received, the shared expert among them, and the combine.
# The launch ledger, predicted here on the CPU from the model's structure (nothing is timed), counts what one
# 8-token request launches inside its graph with each form.

# %%
import contextlib
import io
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the prediction builds the engine on CPU tensors
from dsv32ref.experiments import ledger  # noqa: E402

with contextlib.redirect_stdout(io.StringIO()):  # its progress lines carry seconds
    fused_pred = ledger.predict_all(run["preset"], variants=("none", "none+fused"))["variants"]
moe_layers_pred = sum(ModelConfig.preset(run["preset"]).is_moe_layer(i)
                      for i in range(ModelConfig.preset(run["preset"]).num_hidden_layers))
rows = [(v, sum(fused_pred[v]["in_graph"].values()), fused_pred[v]["in_graph"].get("moe", 0),
         fused_pred[v]["in_graph"].get("moe", 0) // moe_layers_pred) for v in ("none", "none+fused")]
display(Markdown("| arm | kernels in the graph | of them MoE | per MoE layer |\n|---|---|---|---|\n" +
                 "\n".join(f"| `{v}` | {n} | {m} | {per} |" for v, n, m, per in rows)))
(_, n_dense, m_dense, per_dense), (_, n_fused, m_fused, per_fused) = rows

# %% [markdown]
# The TTFT runs time every boundary with both forms of the MoE in one process (the `+fused` arms), for both
# models. The weight-read limit is the time to read every parameter but the embedding table once, at the copy
# bandwidth measured in the same run: no step of one forward can be faster.

# %%
runs = {"glm-5.2": run, "deepseek-v3.2": load("ttft_deepseek-v3.2.json")}
rows = []
for model, rr in runs.items():
    wr = rr["weight_read"]
    for v in BOUNDARIES:
        if f"{v}+fused" not in rr["variants"]:
            continue
        d, f = rr["variants"][v], rr["variants"][f"{v}+fused"]
        rows.append(f"| {model} | {v} | {d['mean_ms']:.2f} / {f['mean_ms']:.2f} | {d['ledger']['gpu_busy_ms']:.2f} / "
                    f"{f['ledger']['gpu_busy_ms']:.2f} | {d['floor_over_weight_read']:.2f} / "
                    f"{f['floor_over_weight_read']:.2f} | {d['ttft_over_floor']:.3f} / {f['ttft_over_floor']:.3f} | "
                    f"{rr['tokens_equal_to_first_arm'][f'{v}+fused']:.0%} |")
display(Markdown("| model | boundary | TTFT mean (ms), dense / fused | floor (ms) | floor / weight read | TTFT / floor "
                 "| fused tokens = dense |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows)))
for model, rr in runs.items():
    wr = rr["weight_read"]
    print(f"{model}: weights read once {wr['bytes'] / 2**30:.2f} GiB at {wr['copy_GBps']:.0f} GB/s = "
          f"{wr['limit_ms']:.2f} ms; commit {rr['provenance']['git_commit'][:7]}, {rr['provenance']['date'][:10]}")

# %%
nf, nd = vs["none+fused"], vs["none"]
by_region = nf["ledger"]["gpu_ms_by_region_eager"]
cfg_r = reduced_moe(run["preset"])  # the TTFT run's model
expert_bytes = (moe_layers_pred * (cfg_r.n_routed_experts + cfg_r.n_shared_experts) * 3 * cfg_r.hidden_size
                * cfg_r.moe_intermediate_size * 2)
moe_limit_ms = expert_bytes / run["weight_read"]["copy_GBps"] / 1e6
rest_limit_ms = run["weight_read"]["limit_ms"] - moe_limit_ms
top_regions = sorted(by_region.items(), key=lambda kv: -kv[1])[:4]
display(Markdown(
    f"With the fused MoE a request launches {nf['ledger']['kernels']} kernels on the GPU instead of "
    f"{nd['ledger']['kernels']} (the prediction above: {per_fused} per MoE layer instead of {per_dense}). The floor "
    f"drops from {nd['ledger']['gpu_busy_ms']:.2f} to {nf['ledger']['gpu_busy_ms']:.2f} ms, mean TTFT from "
    f"{nd['mean_ms']:.2f} to {nf['mean_ms']:.2f} ms, and `none+fused` runs at {nf['ttft_over_floor']:.3f} x its "
    f"floor. The floor is still {nf['floor_over_weight_read']:.2f} x the weight-read limit "
    f"({run['weight_read']['limit_ms']:.2f} ms). By region of the model (GPU ms of the profiled request): "
    + ", ".join(f"{k} {x:.2f}" for k, x in top_regions) +
    f". The MoE layers take {by_region['moe']:.2f} ms against {moe_limit_ms:.2f} ms to read their experts once "
    f"({expert_bytes / 1e9:.1f} GB, if the 8 tokens select every expert of every layer: "
    f"{moe_limit_ms / by_region['moe']:.0%} of the copy rate), everything else "
    f"{nf['ledger']['gpu_busy_ms'] - by_region['moe']:.2f} ms against {rest_limit_ms:.2f} ms "
    f"({rest_limit_ms / (nf['ledger']['gpu_busy_ms'] - by_region['moe']):.0%}): at 8 tokens every GEMM is a weight "
    f"read, and each of the {nf['ledger']['kernels']} kernels reads its share below the copy rate. The fused arms "
    f"agree with each other on every first token, and with the dense arms on "
    f"{run['tokens_equal_to_first_arm']['none+fused']:.0%} of them: the two forms round the routed sum "
    f"differently (the dense form weights the experts in bf16, the fused one in fp32, as the reference module "
    f"does), and on these random weights the top two logits of a request are a median "
    f"{sorted(run['first_token_margins'])[len(run['first_token_margins']) // 2]:.3f} apart (logit units), "
    f"{sum(m == 0 for m in run['first_token_margins'])} of {len(run['first_token_margins'])} exactly tied."))

# %% [markdown]
# ## Conclusion

# %%
pr = seeds["ttft"]
pn = predicted["variants"]["none"]
moe_k, pred_k = pn["in_graph"]["moe"], sum(pn["in_graph"].values())
cfg = ModelConfig.preset(run["preset"])
moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
display(Markdown(
    f"- The PR measured wide / narrow = {pr['wide']['mean_ms'] / pr['narrow']['mean_ms']:.2f} at TP4; here, in "
    f"this run, it is {vs['wide']['mean_ms'] / vs['narrow']['mean_ms']:.2f} on one GPU. Removing the eager break "
    f"altogether (`none`) takes TTFT to {none['ttft_over_floor']:.3f} x the floor, from "
    f"{narrow['ttft_over_floor']:.3f} x for `narrow`: the remaining gap is the GPU's between-kernel time inside "
    f"the graph ({gaps_ms:.2f} ms for {none['ledger']['kernels']} kernels, "
    f"{gaps_ms / none['ledger']['gpu_busy_ms']:.1%} of the floor), the host's work before the launch "
    f"({a['stage_ms']:.2f} ms) and the launch of the one graph ({a['execute_ms']:.2f} ms of host time). Fewer "
    f"kernels is what would move it further: the MoE launches {moe_k} of the {pred_k} kernels we predict per "
    f"request ({moe_k // moe_layers} per MoE layer, our reduced dense MoE with its unfused router); the fused "
    f"MoE (`EngineConfig(moe=\"fused\")`) launches {per_fused} per layer and takes `none` to "
    f"{vs['none+fused']['mean_ms']:.2f} ms, {vs['none+fused']['ttft_over_floor']:.3f} x its floor, the floor "
    f"{vs['none+fused']['floor_over_weight_read']:.2f} x the time to read the weights once.\n"
    f"- Narrowing matters where the launches are a large share of the step: short prompts, and PIECEWISE "
    f"decode. By {top} tokens the GEMMs dominate, and past the largest capture size no variant has graphs.\n"
    f"- What is different here: one GPU holds all 64 heads (four times one TP4 rank's attention work), the "
    f"MoE is four routed experts and the shared one, and the host is this machine's; so compare variants within one run, not our "
    f"milliseconds with the PR's."))
