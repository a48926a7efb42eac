"""One replayed request per boundary on a time axis: what the host does (graph launches, eager regions) and
when the GPU is busy, from the CUDA profiler. The picture behind the TTFT table: why `wide` is slow.

    dsv32ref timeline --model glm-5.2   (GPU)   -> data/timeline_glm-5.2.json

Per boundary, times in microseconds from the start of the request (LLMEngine.generate, one 8-token prefill):
    host_graph_launch  [start, end] of each cudaGraphLaunch call
    host_eager         [start, end] of each eager region (the instrument's eager:: ranges)
    gpu_busy           [start, end] of the GPU's busy stretches: kernel intervals merged where less than
                       `merge_gap_us` apart (the figure cannot show gaps that short; their sum is kept)
    request_us         the request's host duration, from its first to its last instruction
Five requests are profiled, each in a session of its own, and the one of median duration is kept. A profiled
request runs with the profiler and the eager ranges on, so its host side is slower than the TTFT run's; the
order of events and the GPU's idle stretches are what it shows.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dsv32ref.config import REDUCED_MOE, reduced_moe
from dsv32ref.engine import LLMEngine, build_model
from dsv32ref.experiments.ledger import is_annotation
from dsv32ref.experiments.protocol import engine_config, prompts
from dsv32ref.instrument import measuring
from dsv32ref.provenance import provenance
from dsv32ref.results import write_result


def merge(intervals: list[tuple[float, float]], gap: float) -> tuple[list[list[float]], float]:
    """Sorted intervals merged where the next starts less than `gap` after the current ends; returns (merged,
    total idle time inside the gaps that were merged away)."""
    out: list[list[float]] = []
    hidden = 0.0
    for s, e in sorted(intervals):
        if out and s - out[-1][1] < gap:
            hidden += max(s - out[-1][1], 0.0)
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out, hidden


def record(engine, prompt: list[int], merge_gap_us: float = 2.0, repeats: int = 5) -> dict:
    """Profile `repeats` requests of `engine` (a CUDA LLMEngine, graphs captured), each in a profiler session
    of its own, and return the timeline of the one of median duration (with every duration)."""
    runs = []
    with measuring():
        for _ in range(2):
            engine.generate(prompt, 1)  # warm
        for _ in range(repeats):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("timeline::request"):
                    engine.generate(prompt, 1)
                torch.cuda.synchronize()
            events = prof.events()
            req = next(e for e in events if e.name == "timeline::request"
                       and e.device_type == torch.autograd.DeviceType.CPU)
            runs.append((req.time_range.end - req.time_range.start, req, events))
    runs.sort(key=lambda x: x[0])
    _, req, events = runs[len(runs) // 2]
    t0 = req.time_range.start
    kernels, launches, eager = [], [], []
    for e in events:
        s, t = e.time_range.start - t0, e.time_range.end - t0
        if e.device_type == torch.autograd.DeviceType.CUDA and not is_annotation(e):
            kernels.append((s, t))
        elif e.name == "cudaGraphLaunch":
            launches.append([s, t])
        elif e.name.startswith("eager::") and e.device_type == torch.autograd.DeviceType.CPU:
            eager.append([s, t])
    busy, hidden = merge(kernels, merge_gap_us)
    return {"request_us": req.time_range.end - t0, "host_graph_launch": sorted(launches), "host_eager": sorted(eager),
            "gpu_busy": busy, "kernels": len(kernels), "kernel_us": sum(t - s for s, t in kernels),
            "merged_gaps_us": hidden, "merge_gap_us": merge_gap_us,
            "profiled_request_us": [d for d, _, _ in runs], "kept": "the median of the profiled requests"}


def run(preset: str = "glm-5.2", variants=("wide", "narrow", "narrow_out", "none"), prompt_len: int = 8, seed: int = 0,
        out: str | None = None) -> dict:
    """record() for each boundary, engines built as the TTFT experiment builds them; written to `out`."""
    config = reduced_moe(preset)
    weights = build_model(config, variants[0], "cuda", torch.bfloat16, seed)
    (prompt,) = prompts(config.vocab_size, 1, prompt_len, seed)
    result = {"provenance": provenance(), "preset": preset, "reduction": REDUCED_MOE, "prompt_len": prompt_len,
              "note": "times in us from the start of the request; fields: dsv32ref.experiments.timeline",
              "variants": {}}
    for v in variants:
        eng = LLMEngine(config, engine_config(v, seed=seed), device="cuda", weights=weights)
        eng.capture()
        r = result["variants"][v] = record(eng, prompt)
        r["runs_as"] = eng.runner.graphs.lookup(prompt_len, False)[0]
        eng.release_graphs()
        busy = sum(e - s for s, e in r["gpu_busy"])
        print(f"  {v:<12} request {r['request_us'] / 1e3:.2f} ms, {len(r['host_graph_launch'])} graph launches, "
              f"{len(r['host_eager'])} eager regions, GPU busy {busy / 1e3:.2f} ms in {len(r['gpu_busy'])} stretches",
              flush=True)
    if out:
        write_result(out, result)
    return result
