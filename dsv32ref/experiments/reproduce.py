"""The PR's measurements reproduced on this GPU, beside its published figures and the recorded H200 run.

The PR ("[Perf] Narrow DeepSeek V3.2 eager CUDA graph region", vLLM) measured GLM-5.2 at TP4: TTFT of 256
sequential 8-token requests before (wide) and after (narrow) the change, the copy variant's PIECEWISE-only gain
and its out-of-memory failure in FULL capture, and the launches one request lost. This runs the same protocol
on one GPU for every eager boundary (including "none", which the PR did not have), the capture-memory start-ups
at one TP4 rank's heads, and prints one table: the PR's figure, the recorded H200 run (data/), this machine.

    quick   64 TTFT requests of GLM-5.2, every boundary; three capture-memory start-ups (narrow with the
            graph-memory estimate off, then narrow_copy with it and without it): a few minutes
    full    every file data/ holds by the command that recorded it, but the offline compiles'
            (scripts/sm90_triton_versions.sh) and the PR's typed figures (seeds.json): 256 TTFT requests with
            the top-k-skip and fused-MoE arms for both models (the instrument A/B and the FP8 arms for GLM-5.2),
            capture memory with both caches, the regime map, the timeline, the kernel and FP8 benchmarks, FP8
            accuracy (CPU), the predicted ledgers

Each experiment runs in a process of its own, as the commands that recorded data/ ran: the capture-memory
start-ups size the KV cache from what their process holds, so an experiment run before them in the same process
would move where capture runs out of memory. The live run goes to runs/<UTC time>/, never over data/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from dsv32ref.results import DATA_DIR, read_result, reading

__all__ = ["PRESETS", "Plan", "print_table", "run", "table"]

CAPTURE = "capture_memory_glm-5.2_h16.json"
BOUNDARIES_BUT_COPIES = ("wide", "narrow", "narrow_out", "none")  # the boundaries the fused MoE arms run


@dataclass(frozen=True)
class Plan:
    """The commands of one preset, each run as `python -m dsv32ref <args> --out <dir>/<file>`."""

    name: str
    commands: tuple[tuple[str, tuple[str, ...]], ...]  # (output file, arguments)


PRESETS = {
    "quick": Plan("quick", (
        ("ttft_glm-5.2.json", ("ttft", "--model", "glm-5.2", "--requests", "64", "--skip-topk")),
        (CAPTURE, ("capture", "--model", "glm-5.2", "--heads-per-rank", "16", "--plan", "quick")),
    )),
    "full": Plan("full", (  # data/README.md's commands, file by file (tests/test_data.py holds them equal)
        ("ttft_glm-5.2.json", ("ttft", "--model", "glm-5.2", "--instrument-ab", "--fp8-kv", "narrow", "none",
                               "--fused-moe", *BOUNDARIES_BUT_COPIES, "--fused-skinny", "none")),
        ("ttft_deepseek-v3.2.json", ("ttft", "--model", "deepseek-v3.2", "--fused-moe", *BOUNDARIES_BUT_COPIES,
                                     "--fused-skinny", "none")),
        (CAPTURE, ("capture", "--model", "glm-5.2", "--heads-per-rank", "16", "--no-threshold")),
        ("capture_memory_glm-5.2_h16_fp8.json", ("capture", "--model", "glm-5.2", "--heads-per-rank", "16",
                                                 "--kv-cache-dtype", "fp8", "--no-threshold")),
        ("regimes_glm-5.2.json", ("regimes", "--model", "glm-5.2")),
        ("timeline_glm-5.2.json", ("timeline", "--model", "glm-5.2")),
        ("kernels.json", ("kernels",)),
        ("fp8_speed.json", ("fp8-speed",)),
        ("fp8_accuracy.json", ("fp8-accuracy",)),
        ("ledger_predicted_glm-5.2.json", ("ledger", "--predict", "--model", "glm-5.2", "--measured",
                                           "{dir}/ttft_glm-5.2.json")),
        ("ledger_predicted_deepseek-v3.2.json", ("ledger", "--predict", "--model", "deepseek-v3.2", "--measured",
                                                 "{dir}/ttft_deepseek-v3.2.json")),
    )),
}


def run_command(args: list[str]) -> None:
    """One experiment in a process of its own (its output streams through)."""
    subprocess.run([sys.executable, "-m", "dsv32ref", *args], check=True)


def run(preset: str, out_dir: str, recorded_dir: str = DATA_DIR) -> list[dict]:
    """Every command of the preset into out_dir, then the table against recorded_dir and the PR."""
    if preset not in PRESETS:
        raise ValueError(f"reproduce.run: preset must be one of {sorted(PRESETS)}, got {preset!r}")
    os.makedirs(out_dir, exist_ok=True)
    for name, args in PRESETS[preset].commands:
        print(f"\n[{preset}] dsv32ref {' '.join(args).format(dir=out_dir)}", flush=True)
        run_command([a.format(dir=out_dir) for a in args] + ["--out", os.path.join(out_dir, name)])
    rows = table(recorded_dir, out_dir)
    print_table(rows, recorded_dir, out_dir)
    return rows


def _load(folder: str | None, name: str) -> dict | None:
    return read_result(os.path.join(folder, name)) if folder else None


def _startup(cap: dict | None, estimate: bool) -> tuple[str | None, float | None]:
    """narrow_copy's start-up at the default settings, with or without the graph-memory estimate: (outcome,
    GiB the process held outside the caching allocator before capture)."""
    for r in (cap or {}).get("runs", []):
        if (r["boundary"], r["gpu_memory_utilization"], r["max_num_batched_tokens"], r["estimate_graph_memory"]) == \
                ("narrow_copy", 0.9, 512, estimate):
            non_torch = (r.get("before_capture") or {}).get("non_torch")
            return (f"OOM, {r['failed_at']}" if r["failed"] else "starts"), \
                (non_torch / 2**30 if non_torch is not None else None)
    return None, None


def _ttft_rows(v: dict | None) -> dict:
    """Our figures of one TTFT run, by row name (None where the run lacks them)."""
    if v is None:
        return {}
    out = {}
    for name in ("wide", "narrow"):
        for key, label in (("mean_ms", "TTFT mean (ms)"), ("median_ms", "TTFT median (ms)"), ("p99_ms", "TTFT p99 (ms)"),
                           ("req_per_s", "requests/s")):
            out[f"{name} {label}"] = v[name][key]
    out["wide / narrow (mean TTFT)"] = v["wide"]["mean_ms"] / v["narrow"]["mean_ms"]
    out["direct launches removed by narrowing"] = v["wide"]["ledger"]["direct_total"] - v["narrow"]["ledger"]["direct_total"]
    out["graph launches per request (narrow)"] = v["narrow"]["ledger"]["graph_launches"]
    out["narrow_copy faster than narrow (%)"] = 100 * (v["narrow"]["mean_ms"] - v["narrow_copy"]["mean_ms"]) \
        / v["narrow"]["mean_ms"]
    for name in ("narrow_out", "none"):
        out[f"{name} TTFT mean (ms)"] = v[name]["mean_ms"]
    out["none TTFT / its GPU-busy floor"] = v["none"]["ttft_over_floor"]
    return out


def _pr_rows(seeds: dict) -> dict:
    t, tr, pw = seeds["ttft"], seeds["launch_trace"], seeds["piecewise_only"]
    out = {f"{n} {label}": t[n][k] for n in ("wide", "narrow") for k, label in (
        ("mean_ms", "TTFT mean (ms)"), ("median_ms", "TTFT median (ms)"), ("p99_ms", "TTFT p99 (ms)"),
        ("req_per_s", "requests/s"))}
    out.update({"wide / narrow (mean TTFT)": t["wide"]["mean_ms"] / t["narrow"]["mean_ms"],
                "direct launches removed by narrowing": tr["fewer_direct_launches"],
                "graph launches per request (narrow)": tr["graph_launches_kept"],
                "narrow_copy faster than narrow (%)": pw["copy_faster_percent"],
                "narrow_copy start-up, estimate on": "OOM in FULL"})
    return out


NOTES = {"narrow_copy faster than narrow (%)": "PR: PIECEWISE only; ours: the default mode",
         "narrow_copy start-up, estimate on": "16 heads: one TP4 rank", "none TTFT mean (ms)": "not in the PR"}


def table(recorded_dir: str = DATA_DIR, live_dir: str | None = None) -> list[dict]:
    """Rows {what, pr, recorded, live, note} from data/seeds.json, the recorded GLM-5.2 runs and (if given) the
    live run's folder."""
    seeds = _load(recorded_dir, "seeds.json")
    if seeds is None:
        raise ValueError(f"reproduce: no recorded runs at {recorded_dir} (data/ comes with the repository: run from "
                         f"a checkout, or pass its data/ folder)")
    runs, outside = {}, {}
    for key, folder in (("recorded", recorded_dir), ("live", live_dir)):
        ttft, cap = _load(folder, "ttft_glm-5.2.json"), _load(folder, CAPTURE)
        with reading(f"{folder}'s ttft_glm-5.2.json and {CAPTURE}"):
            runs[key] = _ttft_rows(ttft["variants"] if ttft else None)
            for estimate in ("on", "off"):
                what = f"narrow_copy start-up, estimate {estimate}"
                runs[key][what], outside[key, what] = _startup(cap, estimate == "on")
    with reading(os.path.join(recorded_dir, "seeds.json")):
        pr = _pr_rows(seeds)
    rows = []
    for k in list(pr) + [k for k in runs["recorded"] if k not in pr]:
        rec, live, note = runs["recorded"].get(k), runs["live"].get(k), NOTES.get(k, "")
        if k.startswith("narrow_copy start-up") and rec and live and rec.split(" size")[0] != live.split(" size")[0]:
            here, there = (_gib(outside[side, k]) for side in ("live", "recorded"))
            note = f"differs: {here} GiB outside the allocator before capture here, {there} recorded"
        rows.append({"what": k, "pr": pr.get(k), "recorded": rec, "live": live, "note": note})
    return rows


def _gib(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _cell(x) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def print_table(rows: list[dict], recorded_dir: str = DATA_DIR, live_dir: str | None = None) -> None:
    rec = (_load(recorded_dir, "ttft_glm-5.2.json") or {}).get("provenance", {})
    print(f"\nGLM-5.2, one request at a time. PR: TP4/EP4, FP8 KV; recorded: {rec.get('device', '?')} at commit "
          f"{str(rec.get('git_commit', '?'))[:7]} ({recorded_dir}/); this machine: {live_dir or 'not run'}")
    print(f"{'':<38} {'PR':>12} {'recorded':>19} {'this machine':>19}  note")
    for r in rows:
        print(f"{r['what']:<38} {_cell(r['pr']):>12} {_cell(r['recorded']):>19} {_cell(r['live']):>19}  {r['note']}")
