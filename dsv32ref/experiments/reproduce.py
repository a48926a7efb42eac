"""The seed PR's measurements, reproduced on this GPU, beside its published figures.

The PR ("[Perf] Narrow DeepSeek V3.2 eager CUDA graph region", vLLM) measured GLM-5.2 at TP4: TTFT of 256
sequential 8-token requests before (wide) and after (narrow) the change, the copy variant's PIECEWISE-only gain
and its out-of-memory failure in FULL capture, and the launches one request lost. This runs the same protocol
on one GPU for every eager boundary (including "none", which the PR did not have), the capture-memory runs at
one TP4 rank's heads, and prints one table: the PR's figure, ours, and ours / PR.

    quick   64 TTFT requests, no instrument A/B, two capture-memory start-ups (narrow_copy with the graph-memory
            estimate and without it) into capture_memory_glm-5.2_h16_quick.json: a few minutes
    full    256 TTFT requests with the instrument A/B, the top-k-skip and the split-graph arms, both models,
            capture memory with the threshold runs, and the regime map
"""

from __future__ import annotations

import json
import os

PRESETS = {
    "quick": {"requests": 64, "instrument_ab": (), "skip_topk": (), "split": (), "models": ("glm-5.2",), "thresholds": False,
              "regimes": False},
    "full": {"requests": 256, "instrument_ab": ("wide", "narrow", "narrow_out"), "skip_topk": ("narrow", "narrow_out"),
             "split": ("none",), "models": ("glm-5.2", "deepseek-v3.2"), "thresholds": True, "regimes": True},
}


def run(preset: str = "quick", data_dir: str = "data") -> list[dict]:
    from dsv32ref.experiments import capture_memory, regimes, ttft

    if preset not in PRESETS:
        raise ValueError(f"reproduce.run: preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    for model in p["models"]:
        print(f"\n[TTFT] {model}: the PR's protocol, every boundary", flush=True)
        ttft.run(model, n_requests=p["requests"], out=os.path.join(data_dir, f"ttft_{model}.json"),
                 instrument_ab=p["instrument_ab"], skip_topk=p["skip_topk"], split=p["split"])
    print("\n[capture memory] glm-5.2 at one TP4 rank's heads (16)", flush=True)
    if p["thresholds"]:
        capture = "capture_memory_glm-5.2_h16.json"
        capture_memory.run_plan("glm-5.2", heads_per_rank=16, threshold_runs=True, out=os.path.join(data_dir, capture))
    else:
        capture = "capture_memory_glm-5.2_h16_quick.json"
        capture_memory.run("glm-5.2", QUICK_CAPTURE, heads_per_rank=16, out=os.path.join(data_dir, capture))
    if p["regimes"]:
        print("\n[regime map] glm-5.2", flush=True)
        regimes.run("glm-5.2", out=os.path.join(data_dir, "regimes_glm-5.2.json"))
    rows = table(data_dir, capture)
    print_table(rows)
    return rows


QUICK_CAPTURE = [{"boundary": "narrow_copy", "history": False},
                 {"boundary": "narrow_copy", "estimate_graph_memory": False, "history": False}]


def _load(data_dir: str, name: str) -> dict | None:
    path = os.path.join(data_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def table(data_dir: str = "data", capture: str = "capture_memory_glm-5.2_h16.json") -> list[dict]:
    """Rows (what, PR, ours, ours / PR, note) from data/seeds.json and our recorded GLM-5.2 runs."""
    seeds = _load(data_dir, "seeds.json")
    run_ = _load(data_dir, "ttft_glm-5.2.json")
    cap = _load(data_dir, capture)
    if seeds is None or run_ is None:
        return []
    v = run_["variants"]
    rows = []

    def row(what, pr, ours, note=""):
        ratio = ours / pr if isinstance(pr, (int, float)) and isinstance(ours, (int, float)) and pr else None
        rows.append({"what": what, "pr": pr, "ours": ours, "ratio": ratio, "note": note})

    for name in ("wide", "narrow"):
        s = seeds["ttft"][name]
        for key in ("mean_ms", "median_ms", "p99_ms", "req_per_s"):
            label = {"mean_ms": "TTFT mean (ms)", "median_ms": "TTFT median (ms)", "p99_ms": "TTFT p99 (ms)",
                     "req_per_s": "requests/s"}[key]
            row(f"{name} {label}", s[key], v[name][key])
    row("wide / narrow (mean TTFT)", seeds["ttft"]["wide"]["mean_ms"] / seeds["ttft"]["narrow"]["mean_ms"],
        v["wide"]["mean_ms"] / v["narrow"]["mean_ms"])
    tr = seeds["launch_trace"]
    row("direct launches removed by narrowing", tr["fewer_direct_launches"],
        v["wide"]["ledger"]["direct_total"] - v["narrow"]["ledger"]["direct_total"])
    row("graph launches per request (narrow)", tr["graph_launches_kept"], v["narrow"]["ledger"]["graph_launches"])
    if "narrow_copy" in v:
        pw = seeds["piecewise_only"]
        ours = 100 * (v["narrow"]["mean_ms"] - v["narrow_copy"]["mean_ms"]) / v["narrow"]["mean_ms"]
        row("narrow_copy faster than narrow (%)", pw["copy_faster_percent"], ours,
            "ours: prefill replays PIECEWISE graphs in the default mode")
    if cap is not None:
        outcomes = []
        for r in cap["runs"]:
            if r["boundary"] == "narrow_copy" and r["gpu_memory_utilization"] == 0.9 and \
                    r["max_num_batched_tokens"] == 512:
                what = f"out of memory at {r['failed_at']}" if r["failed"] else "starts"
                outcomes.append(f"graph-memory estimate {'on' if r['estimate_graph_memory'] else 'off'}: {what}")
        if outcomes:
            row("narrow_copy start-up", seeds["piecewise_only"]["copy_variant_failure"], "; ".join(outcomes),
                "16 heads: one TP4 rank")
    for name in ("narrow_out", "none"):
        if name in v:
            row(f"{name} TTFT mean (ms)", None, v[name]["mean_ms"], "not in the PR")
            row(f"{name} TTFT / its GPU-busy floor", None, v[name]["ttft_over_floor"], "not in the PR")
    return rows


def _cell(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x)


def print_table(rows: list[dict]) -> None:
    if not rows:
        print("no recorded runs to compare with the PR")
        return
    print(f"\n{'GLM-5.2, one request at a time':<40} {'PR (TP4)':>12} {'ours (1 GPU)':>14} {'ours/PR':>8}  note")
    for r in rows:
        pr, ours = _cell(r["pr"]), _cell(r["ours"])
        if len(pr) > 12 or len(ours) > 14:  # a sentence: on lines of its own
            print(f"{r['what']:<40}\n    PR:   {pr}\n    ours: {ours}  {r['note']}")
            continue
        print(f"{r['what']:<40} {pr:>12} {ours:>14} {_cell(r['ratio']):>8}  {r['note']}")
