# %% [markdown]
# # Launches and TTFT of each eager boundary, on one H200
#
# vLLM's pull request "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region" measured GLM-5.2 under breakable
# CUDA graphs (TP4/EP4, dummy weights, 256 sequential 8-token requests with one output token, after
# warm-ups): how many direct launches narrowing removed, how many graph launches it kept, and the mean TTFT
# before and after; and, in a PIECEWISE-only run, what copying the attention output into a static buffer
# gained. Its figures are in `data/seeds.json` and printed below.
#
# Here the same protocol runs on one H200 with our engine (`python -m dsv32ref ttft`), GLM-5.2's and
# DeepSeek-V3.2's attention at full size with a reduced MoE (see below), and the ledger is also predicted
# on a CPU from the model structure (`python -m dsv32ref ledger --predict`). Everything below is read from
# `data/`.

# %%
import json

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from dsv32ref.report import GREY, OKABE_ITO, show, table


def load(name):
    with open(f"../data/{name}") as fh:
        return json.load(fh)


seeds = load("seeds.json")  # the PR's published figures
SEEDS = {"wide": seeds["ttft"]["wide"]["mean_ms"], "narrow": seeds["ttft"]["narrow"]["mean_ms"],
         "narrow_copy (PIECEWISE-only run)": seeds["piecewise_only"]["narrow_copy_mean_ms"]}
runs = {m: load(f"ttft_{m}.json") for m in ("glm-5.2", "deepseek-v3.2")}
predicted = {m: load(f"ledger_predicted_{m}.json") for m in ("glm-5.2", "deepseek-v3.2")}
for m, r in runs.items():
    p, pr = r["provenance"], r["protocol"]
    print(f"{m}: {p['device']}, driver {p['driver']}, torch {p['torch']}, {p['date'][:10]}, commit {p['git_commit'][:10]}")
    print(f"   {pr['requests']} requests after {pr['warmup']} warm-ups, {pr['prompt_len']}-token prompts, "
          f"{pr['output_tokens']} output token, mode {pr['mode']}, TP {pr['tensor_parallel']}")
tr, pw = seeds["launch_trace"], seeds["piecewise_only"]
display(Markdown(
    f"**The PR** ({seeds['setup']['parallel']}, {seeds['setup']['model']}): mean TTFT "
    f"{SEEDS['wide']:.2f} ms before, {SEEDS['narrow']:.2f} ms after; {tr['fewer_direct_launches']} fewer direct "
    f"launches per request ({', '.join(f'{v} {k}' for k, v in tr['moved_into_graphs'].items())}), "
    f"{tr['graph_launches_kept']} graph launches kept; in the PIECEWISE-only run the copy variant took "
    f"{pw['narrow_copy_mean_ms']:.2f} ms against {pw['narrow_mean_ms']:.2f} ({pw['copy_faster_percent']:.2f} % "
    f"faster). **Our model reduction**: {runs['glm-5.2']['reduction']}"))

# %% [markdown]
# ## The launch ledger of one request (GLM-5.2)
# Direct launches by class, measured with the CUDA profiler on the H200 and predicted on a CPU (a cell reads
# "measured / predicted" where they differ); graph launches per forward. 'other' (measured only) is the logits
# GEMM, sampling and input copies around the model forward; memcpy counts the copies inside the forward.

# %%
CLASSES = ["norm_rope", "q_gemm", "wuk_bmm", "fused_q", "indexer", "attention", "uv_bmm"]


def ledger_table(model):
    """One row per variant: measured by the profiler on the H200; 'm / p' where the CPU prediction differs."""
    r, p = runs[model], predicted[model]
    rows = []
    for v, res in r["variants"].items():
        if "+" in v:  # the top-k-skip arms: a boundary's launches but for the skipped indexer
            continue
        meas, pred = res["ledger"], p["variants"][v]
        m = [meas["direct"].get(c, 0) for c in CLASSES] + [sum(n for k, n in meas["memcpy"].items() if k != "other"),
                                                           meas["graph_launches"]]
        q = [pred["direct"].get(c, 0) for c in CLASSES] + [sum(n for k, n in pred["memcpy"].items() if k != "other"),
                                                           pred["graph_launches"]]
        rows.append([v] + [a if a == b else f"{a} / {b}" for a, b in zip(m, q)] + [meas["direct"].get("other", 0)])
    table(["variant"] + CLASSES + ["memcpy", "graphs", "other"], rows)


ledger_table("glm-5.2")

# %% [markdown]
# What narrowing moved into graphs, wide minus narrow, beside the PR's trace:

# %%
w, n = (runs["glm-5.2"]["variants"][v]["ledger"]["direct"] for v in ("wide", "narrow"))
moved = {c: w.get(c, 0) - n.get(c, 0) for c in tr["moved_into_graphs"]}
rows = [[c, moved[c], pr_n, moved[c] == pr_n] for c, pr_n in tr["moved_into_graphs"].items()]
rows.append(["total", sum(moved.values()), tr["fewer_direct_launches"], sum(moved.values()) == tr["fewer_direct_launches"]])
g = runs["glm-5.2"]["variants"]["narrow"]["ledger"]["graph_launches"]
rows.append(["graph launches per forward", g, tr["graph_launches_kept"], g == tr["graph_launches_kept"]])
table(["class", "ours", "the PR", "equal"], rows)

# %%
ledger_table("deepseek-v3.2")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
palette = OKABE_ITO
for ax, model in zip(axes, runs):
    variants = list(runs[model]["variants"])
    bottom = [0] * len(variants)
    for c, color in zip(CLASSES + ["other"], palette):
        vals = [runs[model]["variants"][v]["ledger"]["direct"].get(c, 0) for v in variants]
        ax.bar(variants, vals, bottom=bottom, color=color, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title(f"{model}: direct launches per request")
    ax.set_xlabel("variant")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
axes[0].set_ylabel("direct kernel launches")
axes[1].legend(fontsize=8)
show(fig)

# %% [markdown]
# ## TTFT
# Per variant: mean, median, p99, requests/s, and the floor: the GPU-busy time of the same request (the
# sum of its kernel durations, graph kernels included). The run interleaves the variants request by
# request, and times them with the instrument off: the named regions the ledger needs are opened only
# while a request is profiled.

# %%
def ttft_table(model):
    vs = runs[model]["variants"]
    display(Markdown(f"**{model}** (run at {runs[model]['provenance']['git_commit'][:7]})"))
    table(["variant", "mean (ms)", "median (ms)", "p99 (ms)", "req/s", "floor (ms)", "mean / floor"],
          [[v, r["mean_ms"], r["median_ms"], r["p99_ms"], f"{r['req_per_s']:.1f}", r["ledger"]["gpu_busy_ms"],
            r["mean_ms"] / r["ledger"]["gpu_busy_ms"]] for v, r in vs.items()])
    display(Markdown(
        f"wide / narrow {vs['wide']['mean_ms'] / vs['narrow']['mean_ms']:.2f} (medians "
        f"{vs['wide']['median_ms'] / vs['narrow']['median_ms']:.2f}); narrow_copy is "
        f"{1 - vs['narrow_copy']['mean_ms'] / vs['narrow']['mean_ms']:.1%} faster than narrow; narrow_out is "
        f"{vs['narrow_out']['mean_ms'] / vs['narrow_out']['ledger']['gpu_busy_ms']:.2f} x its floor; same first "
        f"tokens in every variant: {runs[model]['same_tokens_across_variants']}."))


ttft_table("glm-5.2")

# %%
ttft_table("deepseek-v3.2")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, model in zip(axes, runs):
    vs = runs[model]["variants"]
    ax.boxplot([r["ttft_ms"] for r in vs.values()], showfliers=False, whis=(1, 99))
    for i, r in enumerate(vs.values(), start=1):
        ax.plot([i - 0.3, i + 0.3], [r["ledger"]["gpu_busy_ms"]] * 2, color="black", lw=2)
    ax.plot([], [], color="black", lw=2, label="GPU-busy floor")
    ax.set_xticks(range(1, len(vs) + 1), list(vs), rotation=30, fontsize=8)
    ax.set_xlabel("variant")
    ax.set_title(f"{model}: TTFT of {runs[model]['protocol']['requests']} requests\n"
                 f"(box: quartiles, whiskers: p1-p99)")
axes[0].set_ylabel("TTFT (ms)")
axes[0].legend(fontsize=8, loc="upper right")
show(fig)

# %% [markdown]
# TTFT as the GPU-busy floor, the GPU's idle time inside the step and the host's time before the GPU starts,
# from the step's anatomy (medians of requests run after the TTFT loop, with no profiler: host time of
# staging and upload, then CUDA events from the upload to the sampled tokens), beside the PR's mean TTFT
# (TP4/EP4, its own GPUs; no floor published). The dot is our median TTFT; where bar and dot differ, the
# host was slower or faster while the anatomy ran than over the TTFT loop (notebook 06 shows these drifts
# come in bursts that hit every host-heavy variant at once). Our GPU reads every attention
# weight of the model, four times one TP4 rank's share, so compare the ratios, not the milliseconds.

# %%
fig, ax = plt.subplots(figsize=(10, 4.4))
vs = runs["glm-5.2"]["variants"]
names = [v for v in vs if "+" not in v]
x = [i - 0.2 for i in range(len(names))]
floor = [vs[v]["ledger"]["gpu_busy_ms"] for v in names]
idle = [vs[v]["anatomy"]["gpu_ms"] - f for v, f in zip(names, floor)]
host = [vs[v]["anatomy"]["stage_ms"] for v in names]
ax.bar(x, floor, 0.4, color=GREY, label="ours: GPU-busy floor")
ax.bar(x, idle, 0.4, bottom=floor, color=OKABE_ITO[5], label="ours: GPU idle inside the step (launches, gaps)")
ax.bar(x, host, 0.4, bottom=[f + i for f, i in zip(floor, idle)], color=OKABE_ITO[4],
       label="ours: host before the GPU starts (stage, upload)")
ax.plot(x, [vs[v]["median_ms"] for v in names], "o", color="black", ms=4, label="ours: median TTFT")
pr_bars = {"wide": SEEDS["wide"], "narrow": SEEDS["narrow"],
           "narrow_copy": SEEDS["narrow_copy (PIECEWISE-only run)"]}
ax.bar([names.index(v) + 0.2 for v in pr_bars], list(pr_bars.values()), 0.4, color=OKABE_ITO[0],
       label="the PR: mean TTFT (narrow_copy: its PIECEWISE-only run)")
ax.set_xticks(range(len(names)), names, fontsize=8)
ax.set_xlabel("variant")
ax.set_ylabel("TTFT (ms)")
ax.set_title("GLM-5.2, 8-token prompts: floor + GPU idle + host, ours (1 H200) and the PR's (TP4)")
ax.legend(fontsize=8, loc="upper right")
show(fig)

# %% [markdown]
# ## One request on a time axis
# `dsv32ref timeline` profiled five requests per boundary on the H200 and kept the one of median duration
# (`data/timeline_glm-5.2.json`): when the host launches graphs, when it runs eager regions, and when the GPU
# is busy. The profiler and the eager ranges are on, so the host side is slower than in the TTFT run above;
# what the picture shows is the order of things and where the GPU waits.

# %%
tl = load("timeline_glm-5.2.json")
lanes = [("gpu_busy", "GPU busy", OKABE_ITO[2]), ("host_eager", "host: eager region", OKABE_ITO[5]),
         ("host_graph_launch", "host: graph launch", OKABE_ITO[0])]
fig, axes = plt.subplots(len(tl["variants"]), 1, figsize=(12, 1.15 * len(tl["variants"]) + 1.2), sharex=True)
for ax, (v, r) in zip(axes, tl["variants"].items()):
    for y, (key, name, color) in enumerate(lanes):
        ax.broken_barh([(s_ / 1e3, max(e - s_, 1.0) / 1e3) for s_, e in r[key]], (y - 0.4, 0.8), color=color,
                       label=name)
    ax.set_yticks(range(len(lanes)), ["GPU", "eager", "graph"], fontsize=7)
    busy = sum(e - s_ for s_, e in r["gpu_busy"]) / 1e3
    ax.set_ylabel(f"{v}\n{r['request_us'] / 1e3:.0f} ms", rotation=0, ha="right", va="center", fontsize=8)
    ax.text(r["request_us"] / 1e3, 0, f" GPU busy {busy:.1f} ms", va="center", fontsize=7)
axes[0].legend(fontsize=7, loc="upper right", ncol=3)
axes[-1].set_xlabel("time from the start of the request (ms)")
fig.suptitle(f"GLM-5.2, one profiled {tl['prompt_len']}-token request per boundary (median of "
             f"{len(tl['variants']['wide']['profiled_request_us'])}; profiler on)")
show(fig)

# %%
nv = tl["variants"]["none"]
launch_ms = (nv["host_graph_launch"][0][1] - nv["host_graph_launch"][0][0]) / 1e3
an = runs["glm-5.2"]["variants"]["none"]["anatomy"]
display(Markdown(
    f"`wide` and `narrow` keep the host in eager regions for most of the request while the GPU works in "
    f"short bursts between them; `narrow_out` leaves less in each region. One caution for `none`: under the "
    f"profiler its one graph takes {launch_ms:.1f} ms to launch and the GPU waits for it. That is the "
    f"profiler's cost: in the TTFT run the launch takes {an['execute_ms']:.2f} ms of host time."))

# %% [markdown]
# ## What the instrument costs
# The ledger attributes launches to named regions (profiler ranges). A `torch.profiler.record_function`
# range costs host time even when no profiler runs, and an engine step opens hundreds of them, almost all
# inside eager regions. In the same run, wide, narrow and narrow_out were also timed with every range open
# on every request, as they used to be (GLM-5.2's run): the difference is what an always-on instrument adds to
# TTFT. With the instrument off, what remains is one no-op context manager per region, whose host cost was timed
# in the same process and multiplied by the regions one request enters.

# %%
for model in [m for m in runs if "instrument" in runs[m]]:
    ab = runs[model]["instrument"]
    vs = runs[model]["variants"]
    display(Markdown(f"**{model}**: one region costs {ab['region_cost_ns']['off']:.0f} ns off, "
                     f"{ab['region_cost_ns']['on']:.0f} ns on; wide / narrow (means) "
                     f"{vs['wide']['mean_ms'] / vs['narrow']['mean_ms']:.2f} without ranges, "
                     f"{ab['wide_over_narrow_with_ranges']:.2f} with them"))
    table(["variant", "median with ranges (ms)", "without (ms)", "difference (ms)", "regions", "left, off (ms)"],
          [[v, a["with_ranges"]["median_ms"], a["without"]["median_ms"], f"{a['ranges_median_ms']:+.2f}",
            a["regions_entered_per_request"], f"{a['remaining_ms_per_request']:.3f}"] for v, a in ab["variants"].items()])

# %% [markdown]
# ## Where the time goes
# From the profiled request of each variant: the GPU-busy floor, the time the GPU sat idle between the
# forward's first and last kernel (launch gaps, host work), and the host time spent inside eager regions.
# Then the kernel time of each region of the model, from one request run without graphs (the kernels are
# the same; this is how graph-launched kernels get a region): the share of the reduced MoE.

# %%
for model in runs:
    display(Markdown(f"**{model}** (the profiled request: its host regions run with the profiler on)"))
    table(["variant", "floor (ms)", "GPU idle (ms)", "eager host (ms)", "TTFT mean (ms)"],
          [[v, r["ledger"]["gpu_busy_ms"], r["ledger"]["gpu_idle_ms"], r["ledger"]["eager_region_host_ms"],
            r["mean_ms"]] for v, r in runs[model]["variants"].items()])
    reg = runs[model]["variants"]["narrow"]["ledger"]["gpu_ms_by_region_eager"]
    total = sum(reg.values())
    print(f"kernel time by region ({total:.1f} ms): " + ", ".join(f"{k} {v / total:.0%}" for k, v in list(reg.items())[:6]))

# %% [markdown]
# ## Conclusion

# %%
g = runs["glm-5.2"]["variants"]
reg = g["narrow"]["ledger"]["gpu_ms_by_region_eager"]
agree = all(g[v]["ledger"]["direct"].get(c, 0) == predicted["glm-5.2"]["variants"][v]["direct"].get(c, 0)
            for v in predicted["glm-5.2"]["variants"] if v in g for c in CLASSES)
display(Markdown(
    f"- The ledger reproduces the PR's arithmetic on GLM-5.2: narrowing moves "
    f"{sum(moved.values())} launches into graphs ({tr['fewer_direct_launches']} in the PR), with "
    f"{g['narrow']['ledger']['graph_launches']} graph launches per forward ({tr['graph_launches_kept']}); the CPU "
    f"prediction {'equals' if agree else 'differs from'} the profiler's count class by class. The copy "
    f"variants' copy is a device-to-device `cudaMemcpyAsync`, not a kernel, so it shows up under memcpy.\n"
    f"- wide / narrow is {g['wide']['mean_ms'] / g['narrow']['mean_ms']:.2f} here against "
    f"{SEEDS['wide'] / SEEDS['narrow']:.2f} in the PR. Every variant has about the same GPU-busy floor (same "
    f"kernels); TTFT above it is host time: `wide` launches its direct kernels one by one from Python between "
    f"graph segments, and the GPU idles. An always-on instrument is host time too, which is why the ranges are "
    f"open only while the ledger profiles.\n"
    f"- Capturing the UV BMM beats leaving it eager, as in the PR: narrow_copy is "
    f"{1 - g['narrow_copy']['mean_ms'] / g['narrow']['mean_ms']:.1%} faster than narrow here "
    f"({seeds['piecewise_only']['copy_faster_percent']:.2f} % in the PR's PIECEWISE-only run), and `narrow_out`, "
    f"which needs no copy, is closest to the floor of the five PR-era variants. Whether the copy variant can "
    f"start at all is notebook 05's subject.\n"
    f"- What is different here: one GPU reads every weight of the model per forward (all attention at full "
    f"width), far more than one TP4 rank, so our milliseconds are not the PR's; the reduced MoE (dense experts) "
    f"is {reg.get('moe', 0) / sum(reg.values()):.0%} of the kernel time."))
