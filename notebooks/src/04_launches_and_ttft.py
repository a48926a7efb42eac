# %% [markdown]
# # Launches and TTFT of each eager boundary, on one H200
#
# The seeds report, for GLM-5.2 under breakable CUDA graphs (TP4/EP4, dummy weights, 256 sequential
# 8-token requests with one output token after 8 warm-ups): narrowing the eager region removed 333 direct
# launches per request (78 norm/RoPE, 78 W_UK BMMs, 99 query/indexer GEMMs, 78 fused-Q) while keeping 79
# graph launches, and mean TTFT went from 57.42 to 28.72 ms; copying the attention output into a static
# buffer (UV BMM captured) was 7.43 % faster still under PIECEWISE (26.51 vs 28.64 ms).
#
# Here the same protocol runs on one H200 with our engine (`python -m dsv32ref ttft`), GLM-5.2's and
# DeepSeek-V3.2's attention at full size with a reduced MoE (see below), and the ledger is also predicted
# on a CPU from the model structure (`python -m dsv32ref ledger --predict`). Everything below is read from
# `data/`.

# %%
import json

import matplotlib.pyplot as plt


def load(name):
    with open(f"../data/{name}") as fh:
        return json.load(fh)


seeds = load("seeds.json")  # the PR's published figures
SEEDS = {"wide": seeds["ttft"]["wide"]["mean_ms"], "narrow": seeds["ttft"]["narrow"]["mean_ms"],
         "narrow_copy (PIECEWISE-only run)": seeds["piecewise_only"]["narrow_copy_mean_ms"]}
runs = {m: load(f"ttft_{m}.json") for m in ("glm-5.2", "deepseek-v3.2")}
predicted = {m: load(f"ledger_predicted_{m}.json") for m in ("glm-5.2", "deepseek-v3.2")}
for m, r in runs.items():
    p = r["provenance"]
    print(f"{m}: {p['device']}, driver {p['driver']}, torch {p['torch']}, {p['date'][:10]}, commit {p['git_commit'][:10]}")
    print(f"   protocol {r['protocol']}")
print("model reduction:", runs["glm-5.2"]["reduction"])

# %% [markdown]
# ## The launch ledger of one request (GLM-5.2)
# Direct launches by class, measured with the CUDA profiler on the H200 and predicted on a CPU; graph
# launches per forward. 'other' (measured only) is the logits GEMM, sampling and input copies around the
# model forward, which the prediction does not model.

# %%
CLASSES = ["norm_rope", "q_gemm", "wuk_bmm", "fused_q", "indexer", "attention", "uv_bmm"]


def ledger_table(model):
    r, p = runs[model], predicted[model]
    print(f"{'':<17}" + "".join(f"{c:>10}" for c in CLASSES + ["memcpy", "other", "graphs"]))
    for v, res in r["variants"].items():
        if "+" in v:  # the arms (top-k skip, split graphs): variants of a boundary, its launches but for theirs
            continue
        meas, pred = res["ledger"], p["variants"][v]
        row_m = [meas["direct"].get(c, 0) for c in CLASSES] + [sum(v_ for k, v_ in meas["memcpy"].items() if k != "other"),
                                                                meas["direct"].get("other", 0), meas["graph_launches"]]
        row_p = [pred["direct"].get(c, 0) for c in CLASSES] + [sum(pred["memcpy"].values()), "-", pred["graph_launches"]]
        print(f"{v + ' meas':<17}" + "".join(f"{x:>10}" for x in row_m))
        print(f"{'  predicted':<17}" + "".join(f"{x:>10}" for x in row_p))
        agree = all(meas["direct"].get(c, 0) == pred["direct"].get(c, 0) for c in CLASSES) and \
            meas["graph_launches"] == pred["graph_launches"]
        print(f"{'  agree':<17}{agree}")


ledger_table("glm-5.2")

# %% [markdown]
# What narrowing moved into graphs, wide minus narrow, beside the seeds' trace:

# %%
SEED_MOVED = {"norm_rope": 78, "wuk_bmm": 78, "q_gemm": 99, "fused_q": 78}
w, n = (runs["glm-5.2"]["variants"][v]["ledger"]["direct"] for v in ("wide", "narrow"))
moved = {c: w.get(c, 0) - n.get(c, 0) for c in SEED_MOVED}
for c, seed in SEED_MOVED.items():
    print(f"{c:<10} ours {moved[c]:>4}   seeds {seed:>4}   match: {moved[c] == seed}")
print(f"{'total':<10} ours {sum(moved.values()):>4}   seeds  333   match: {sum(moved.values()) == 333}")
print("graph launches per forward:", runs["glm-5.2"]["variants"]["narrow"]["ledger"]["graph_launches"], "(seeds: 79)")

# %%
ledger_table("deepseek-v3.2")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
palette = plt.cm.tab10.colors
for ax, model in zip(axes, runs):
    variants = list(runs[model]["variants"])
    bottom = [0] * len(variants)
    for c, color in zip(CLASSES + ["other"], palette):
        vals = [runs[model]["variants"][v]["ledger"]["direct"].get(c, 0) for v in variants]
        ax.bar(variants, vals, bottom=bottom, color=color, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title(f"{model}: direct launches per request")
    ax.tick_params(axis="x", rotation=20)
axes[0].set_ylabel("direct kernel launches")
axes[1].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## TTFT
# Per variant: mean, median, p99, requests/s, and the floor: the GPU-busy time of the same request (the
# sum of its kernel durations, graph kernels included). The run interleaves the variants request by
# request, and times them with the instrument off: the named regions the ledger needs are opened only
# while a request is profiled.

# %%
def ttft_table(model):
    vs = runs[model]["variants"]
    print(f"{model} (latest run, {runs[model]['provenance']['git_commit'][:7]})")
    print(f"{'variant':<20}{'mean':>9}{'median':>9}{'p99':>9}{'req/s':>8}{'floor':>8}{'mean/floor':>11}")
    for v, r in vs.items():
        floor = r["ledger"]["gpu_busy_ms"]
        print(f"{v:<20}{r['mean_ms']:>9.2f}{r['median_ms']:>9.2f}{r['p99_ms']:>9.2f}"
              f"{r['req_per_s']:>8.1f}{floor:>8.2f}{r['mean_ms'] / floor:>11.2f}")
    print(f"wide/narrow {vs['wide']['mean_ms'] / vs['narrow']['mean_ms']:.2f} (medians "
          f"{vs['wide']['median_ms'] / vs['narrow']['median_ms']:.2f}); narrow_copy vs narrow: "
          f"{1 - vs['narrow_copy']['mean_ms'] / vs['narrow']['mean_ms']:.1%} faster; narrow_out within "
          f"{vs['narrow_out']['mean_ms'] / vs['narrow_out']['ledger']['gpu_busy_ms']:.2f}x of its floor")
    print("same first tokens in every variant:", runs[model]["same_tokens_across_variants"])


ttft_table("glm-5.2")
print("seeds (GLM-5.2, TP4/EP4): " + ", ".join(f"{k} {v:.2f} ms" for k, v in SEEDS.items())
      + f"; wide/narrow {SEEDS['wide'] / SEEDS['narrow']:.2f}")

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
    ax.set_xticks(range(1, len(vs) + 1), list(vs), rotation=20)
    ax.set_title(f"{model}: TTFT of 256 requests (box: quartiles, whiskers: p1-p99)")
axes[0].set_ylabel("ms")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## What the instrument costs
# The ledger attributes launches to named regions (profiler ranges). A `torch.profiler.record_function`
# range costs host time even when no profiler runs, and an engine step opens hundreds of them, almost all
# inside eager regions. In the same run, wide, narrow and narrow_out were also timed with every range open
# on every request, as they used to be: the difference is what an always-on instrument adds to TTFT. With
# the instrument off, what remains is one no-op context manager per region, whose host cost was timed in
# the same process and multiplied by the regions one request enters.

# %%
for model in runs:
    ab = runs[model]["instrument"]
    print(f"{model}: one region costs {ab['region_cost_ns']['off']:.0f} ns off, {ab['region_cost_ns']['on']:.0f} ns on")
    print(f"{'variant':<12}{'median with ranges':>20}{'without':>10}{'difference':>12}{'regions':>9}{'left, off':>11}")
    for v, a in ab["variants"].items():
        print(f"{v:<12}{a['with_ranges']['median_ms']:>17.2f} ms{a['without']['median_ms']:>10.2f}"
              f"{a['ranges_median_ms']:>+12.2f}{a['regions_entered_per_request']:>9}{a['remaining_ms_per_request']:>8.3f} ms")
    vs = runs[model]["variants"]
    print(f"wide/narrow (means): {vs['wide']['mean_ms'] / vs['narrow']['mean_ms']:.2f} without ranges, "
          f"{ab['wide_over_narrow_with_ranges']:.2f} with them")

# %% [markdown]
# ## Where the time goes
# From the profiled request of each variant: the GPU-busy floor, the time the GPU sat idle between the
# forward's first and last kernel (launch gaps, host work), and the host time spent inside eager regions.
# Then the kernel time of each region of the model, from one request run without graphs (the kernels are
# the same; this is how graph-launched kernels get a region): the share of the reduced MoE.

# %%
for model in runs:
    print(model)
    print(f"{'variant':<20}{'floor':>8}{'GPU idle':>10}{'eager host':>12}{'TTFT mean':>11}")
    for v, r in runs[model]["variants"].items():
        led = r["ledger"]
        print(f"{v:<20}{led['gpu_busy_ms']:>8.2f}{led['gpu_idle_ms']:>10.2f}{led['eager_region_host_ms']:>12.2f}"
              f"{r['mean_ms']:>11.2f}")
    reg = runs[model]["variants"]["narrow"]["ledger"]["gpu_ms_by_region_eager"]
    total = sum(reg.values())
    top = ", ".join(f"{k} {v / total:.0%}" for k, v in list(reg.items())[:6])
    print(f"kernel time by region ({total:.1f} ms): {top}")

# %% [markdown]
# ## Reading it
# - The ledger reproduces the seeds' arithmetic exactly on GLM-5.2: narrowing moves 78 norm/RoPE,
#   78 W_UK BMM, 99 query/indexer GEMM and 78 fused-Q launches into graphs (333), with 79 graph launches
#   per forward; the CPU prediction equals the profiler's count class by class. The copy variants' copy
#   is a device-to-device `cudaMemcpyAsync`, not a kernel, so it shows up under memcpy.
# - Every variant has the same GPU-busy floor (same kernels); TTFT above the floor is host time. The wide
#   variant spends it launching its direct kernels (the ledger above) one by one from Python between graph
#   segments: its eager regions' host time is several times the others', and the GPU idles for most of the
#   request. That is what narrowing removes, and why wide/narrow depends on the host. An always-on
#   instrument is host time too: it inflated wide/narrow (the A/B above), which is why the regions are
#   open only while the ledger profiles. `narrow_out` comes closest to the floor.
# - Capturing the UV BMM (`narrow_copy`, `narrow_copy_shared`, `narrow_out`) beats leaving it eager, as in
#   the seeds; the copy variants are slower than `narrow_out` by their memcpy per layer. Whether the copy
#   variant can start at all is the subject of notebook 05.
# - The floor includes reading every weight of the model per forward on one GPU (all attention at full
#   width): far more than one TP4 rank reads, so our absolute times are not the seeds'. The reduced MoE
#   (4 experts, computed densely) is about half of the kernel time.
