"""Start-up memory of each eager boundary under FULL_AND_PIECEWISE capture (why the copy variant runs out of memory).

Each run builds an engine on a shared model the way the serving engine starts: a profile run (largest
prefill step), the graph-memory estimate (two largest captures per mode in a temporary pool, extrapolated),
the KV cache sized to gpu_memory_utilization, then every PIECEWISE size largest first, then every FULL size,
into one pool. Recorded per run: the start-up ledger, the allocator's state after every captured size
(allocated, reserved, free, static copy buffers), where and why a capture failed, the pools' segments, what
is still allocated after capture grouped by the line that allocated it (from the allocator's own history,
`torch.cuda.memory._record_memory_history`), and the memory model's prediction beside the measurement.

    python -m dsv32ref capture [--heads-per-rank 16] [--utilization 0.9] ...
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass

import torch

from dsv32ref.config import REDUCED_MOE, reduced_moe
from dsv32ref.engine import EngineConfig, LLMEngine, build_model
from dsv32ref.experiments.memory_model import predict, threshold
from dsv32ref.graphs import CaptureError, CUDAGraphMode, default_capture_sizes
from dsv32ref.provenance import provenance
from dsv32ref.results import write_partial, write_result


def _pools() -> list[dict]:
    """Allocator segments grouped by pool: bytes reserved and in use per pool."""
    pools: dict = {}
    for seg in torch.cuda.memory._snapshot().get("segments", []):
        key = str(seg.get("segment_pool_id", "default"))
        p = pools.setdefault(key, {"pool": key, "segments": 0, "reserved": 0, "allocated": 0})
        p["segments"] += 1
        p["reserved"] += seg.get("total_size", 0)
        p["allocated"] += seg.get("allocated_size", 0)
    return sorted(pools.values(), key=lambda p: -p["reserved"])


def _site(frames: list[dict]) -> str:
    """The innermost frame in dsv32ref that is not the graph runtime: the line that asked for the memory."""
    for f in frames:
        name = f.get("filename", "")
        if "dsv32ref" in name and "graphs/" not in name:
            return f"{name.split('dsv32ref/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(outside dsv32ref)"


def live_by_site(snapshot: dict, top: int = 10) -> list[dict]:
    """Blocks still allocated, grouped by allocating line and pool (needs history recorded with stacks)."""
    sites: dict = {}
    for seg in snapshot.get("segments", []):
        pool = "graph pool" if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0) else "default pool"
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            key = (_site(b.get("frames", [])), pool)
            s = sites.setdefault(key, {"site": key[0], "pool": key[1], "blocks": 0, "bytes": 0})
            s["blocks"] += 1
            s["bytes"] += b.get("size", 0)
    return sorted(sites.values(), key=lambda s: -s["bytes"])[:top]


@dataclass(frozen=True)
class Settings:
    """The engine's default settings under FULL_AND_PIECEWISE (one engine start-up per run of a plan)."""

    max_num_seqs: int = 256
    max_model_len: int = 8192
    max_num_batched_tokens: int = 512
    capture_sizes: tuple[int, ...] | None = None  # None: the engine's default sizes
    kv_cache_dtype: str = "auto"  # "fp8": FlashMLA's latent rows and DeepGEMM's keys (more tokens in the same budget)

    def engine_config(self, r: dict) -> EngineConfig:
        return EngineConfig(boundary=r["boundary"], mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            max_num_batched_tokens=r["max_num_batched_tokens"],
                            gpu_memory_utilization=r["gpu_memory_utilization"],
                            capture_sizes=list(self.capture_sizes) if self.capture_sizes else None,
                            estimate_graph_memory=r["estimate_graph_memory"], kv_cache_dtype=self.kv_cache_dtype)


def _capture(eng: LLMEngine, entry: dict, rec: bool) -> None:
    """Capture every size; a CaptureError is a result (where it failed, what was live then)."""
    order = [(p, s) for p, sizes in eng.runner.graphs.phase_sizes() for s in sizes]
    failure = (lambda: entry.update(live_by_site_at_failure=live_by_site(torch.cuda.memory._snapshot()))) \
        if rec else None
    try:
        entry["capture_s"] = eng.capture(on_failure=failure)
    except CaptureError as e:
        entry["failed"] = str(e)
        done = len(eng.runner.capture_log)
        entry["failed_at"] = "%s size %d" % order[done] if done < len(order) else "after capture"


def _startup(config, weights, settings: Settings, r: dict, device: str, rec: bool) -> dict:
    """One engine start-up of run `r`: its ledger before capture, capture, the allocator's state after."""
    entry = {**r, "failed": None, "failed_at": None}
    try:
        eng = LLMEngine(config, settings.engine_config(r), device=device, dtype=weights.lm_head.dtype, weights=weights)
    except RuntimeError as e:  # the KV cache could not be sized: a start-up failure before capture
        return dict(entry, failed=f"{type(e).__name__}: {e}", failed_at="KV cache sizing")
    entry["startup"] = dict(eng.runner.memory)
    entry["before_capture"] = eng.runner.memory_ledger()
    if device == "cuda":  # memory the CUDA context and libraries hold outside the caching allocator
        total, free = entry["startup"]["total"], torch.cuda.mem_get_info()[0]
        entry["before_capture"]["non_torch"] = total - free - torch.cuda.memory_reserved()
    _capture(eng, entry, rec)
    entry["capture_log"] = eng.runner.capture_log
    entry["after"] = eng.runner.memory_ledger()
    if device == "cuda":
        entry["pools"] = _pools()
        if rec:
            entry["live_by_site"] = live_by_site(torch.cuda.memory._snapshot())
        if entry["failed"] is None:
            entry["retained_by_capture"] = entry["after"]["allocated"] - entry["before_capture"]["allocated"]
    eng.release_graphs()
    return entry


def run(preset: str = "glm-5.2", runs: list[dict] | None = None, heads_per_rank: int | None = None,
        settings: Settings = Settings(), device: str = "cuda", config=None, out: str | None = None,
        history: bool = True, complete: bool = True) -> dict:
    """`runs`: one dict per engine start-up, keys boundary, gpu_memory_utilization, estimate_graph_memory,
    max_num_batched_tokens, history (record the allocator history for it); defaults fill the rest.
    Progress goes to out's partial file after every start-up; `out` itself is written once the last is done
    (if `complete`: run_plan writes it after its threshold runs)."""
    cuda = device == "cuda"
    config = config or reduced_moe(preset)
    if heads_per_rank:
        config = config.replace(num_attention_heads=heads_per_rank)
    runs = runs or [{"boundary": b} for b in ("narrow", "narrow_copy", "narrow_copy_shared", "narrow_out")]
    weights = build_model(config, runs[0]["boundary"], device, torch.bfloat16 if cuda else torch.float32, seed=0)
    result = {"provenance": provenance(), "preset": preset, "reduction": REDUCED_MOE,
              "heads_per_rank": config.num_attention_heads,
              "settings": {**dataclasses.asdict(settings), "mode": "full_and_piecewise",
                           "capture_sizes": settings.capture_sizes or "default"}, "runs": []}
    for spec in runs:
        r = {"boundary": "narrow", "gpu_memory_utilization": 0.9, "estimate_graph_memory": True,
             "max_num_batched_tokens": settings.max_num_batched_tokens, "history": False, **spec}
        rec, t0 = cuda and history and r["history"], time.time()
        predicted = predict(config, r["boundary"], list(settings.capture_sizes) if settings.capture_sizes else None,
                            settings.max_num_seqs, r["max_num_batched_tokens"], estimate=r["estimate_graph_memory"])
        if rec:
            torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        try:
            entry = _startup(config, weights, settings, r, device, rec)
        finally:
            if rec:
                torch.cuda.memory._record_memory_history(enabled=None)
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        entry.update(predicted=predicted, wall_s=time.time() - t0)
        result["runs"].append(entry)
        status = f"FAILED at {entry['failed_at']}" if entry["failed"] else "ok"
        print(f"  {r['boundary']:<19} util {r['gpu_memory_utilization']:.2f} estimate "
              f"{'on ' if r['estimate_graph_memory'] else 'off'} max tokens {r['max_num_batched_tokens']}: {status} "
              f"({entry['wall_s']:.0f} s)", flush=True)
        if out:
            write_partial(out, result)
    if out and complete:
        write_result(out, result)
    return result


PLAN = [  # the engine's default settings (util 0.9, max_num_seqs 256, capture sizes up to 512)
    {"boundary": "narrow", "history": True},
    {"boundary": "narrow", "estimate_graph_memory": False},
    {"boundary": "narrow_copy", "history": True},
    {"boundary": "narrow_copy", "estimate_graph_memory": False, "history": True},
    {"boundary": "narrow_copy_shared"},
    {"boundary": "narrow_out"},
]


QUICK_PLAN = [  # the main job's quick run: narrow's baseline, then narrow_copy with the estimate and without it
    {"boundary": "narrow", "estimate_graph_memory": False},
    {"boundary": "narrow_copy"},
    {"boundary": "narrow_copy", "estimate_graph_memory": False},
]


HISTORY_PLAN = [  # the allocator's own account of narrow_copy, with and without the estimate
    {"boundary": "narrow_copy", "history": True},
    {"boundary": "narrow_copy", "estimate_graph_memory": False, "history": True},
]


def run_plan(preset: str = "glm-5.2", heads_per_rank: int | None = None, out: str | None = None,
             threshold_runs: bool = True, plan: str = "default", **kw) -> dict:
    """plan "history" or "quick": HISTORY_PLAN or QUICK_PLAN only. plan "default": PLAN, then the predicted
    threshold of narrow_copy (estimate off) checked on both sides: by the largest capture size when it lies below
    512, else by the utilisation."""
    plans = {"default": PLAN, "history": HISTORY_PLAN, "quick": QUICK_PLAN}
    if plan not in plans:
        raise ValueError(f"capture_memory.run_plan: plan must be one of {sorted(plans)}, got {plan!r}")
    last = not threshold_runs or plan != "default"
    res = run(preset, list(plans[plan]), heads_per_rank=heads_per_rank, out=out, complete=last, **kw)
    if last:
        return res
    if out:
        write_partial(out, res)
    config = reduced_moe(preset)
    if heads_per_rank:
        config = config.replace(num_attention_heads=heads_per_rank)
    base = next(r for r in res["runs"] if r["boundary"] == "narrow" and not r["estimate_graph_memory"])
    b, log = base["before_capture"], base["capture_log"]
    pw_end = [c for c in log if c["phase"] == "PIECEWISE"][-1]
    available = b["free"] + b["reserved"] - b["allocated"]
    pw_cost, full_cost = b["free"] - pw_end["free"], pw_end["free"] - log[-1]["free"]
    t = res["threshold_predicted"] = {
        **threshold(config, available, pw_cost, full_cost, base["startup"]["total"], base["gpu_memory_utilization"]),
        "available": available, "piecewise_cost_narrow": pw_cost, "full_cost_narrow": full_cost}
    if t["max_tokens_ok"] is not None and t["max_tokens_ok"] < 512:
        sizes = default_capture_sizes(512)
        nxt = sizes[sizes.index(t["max_tokens_ok"]) + 1]
        extra = [{"boundary": "narrow_copy", "estimate_graph_memory": False, "max_num_batched_tokens": m}
                 for m in (t["max_tokens_ok"], nxt)]
    else:
        u = t["utilization_at_512"]
        extra = [{"boundary": "narrow_copy", "estimate_graph_memory": False, "gpu_memory_utilization": round(x, 3)}
                 for x in (u - 0.01, min(u + 0.01, 0.99))]
    more = run(preset, extra, heads_per_rank=heads_per_rank, **kw)
    res["runs"] += [dict(r, threshold_check=True) for r in more["runs"]]
    if out:
        write_result(out, res)
    return res
