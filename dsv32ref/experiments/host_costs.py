"""What a step costs the host, and what the GPU loses between graph kernels, measured once on the GPU machine:
the inputs of the TTFT model (dsv32ref.experiments.ttft_model).

Each figure is the median over `repeats` timed loops (time.perf_counter_ns), with the instrument off:
    aten_launch_us     one small aten kernel launch from Python (torch.add into an out tensor, 8 x 64 bf16)
    gemm_launch_us     one cuBLAS launch from Python (F.linear / torch.bmm at 8 tokens; its host work picks the
                       kernel), the mean of the two
    memcpy_us          one small asynchronous host-to-device copy from pinned memory
    graph_launch_us    CUDAGraph.replay() of a one-kernel graph (host side)
    graph_node_us      what each further kernel node adds to a replay's host time (a 512-kernel graph)
    eager_region_us    what one eager region adds when a breakable graph replays (the call and the next
                       segment's graph launch), beyond its own launches: a replay of N regions that each launch
                       one small kernel between one-kernel segments, per region, minus one aten launch
    in_graph_gap_us    GPU time lost per kernel inside a graph: a replay of 512 dependent small kernels (CUDA
                       events), per kernel, minus their mean duration (profiler)
    wrapper_us         host time of each named region that holds a Triton launcher (norm_rope, fused_q,
                       indexer, attention) in one eager forward of `engine` (its own shapes; checks and launches
                       included), timed by the instrument's region timers (dsv32ref.instrument.timing_regions)
    stage_us           LLMEngine.stage + upload of one `prompt` (host work before the first launch)
    sync_us            reading a small finished GPU tensor back (.tolist(): the step's last act)
    regions            per boundary with eager regions: the host time of each eager region and of each graph
                       segment's launch while the PIECEWISE graph of one prefill replays (median per entry,
                       in replay order: one region per layer), from the model runner's timed replay
                       (ModelRunner.execute_timed)
The TTFT run measures all of it in its own process after its timed requests (what the TTFT model,
dsv32ref.experiments.ttft_model, is priced with); `run` measures it alone, for one preset.
Loops of small launches are host-bound (the GPU runs each kernel faster than the host launches it), so the
loop time per iteration is the host cost.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dsv32ref.config import reduced_moe
from dsv32ref.engine import BOUNDARIES, LLMEngine, StepInput, build_model
from dsv32ref.experiments.protocol import engine_config, prompts
from dsv32ref.graphs import BreakableCapture, CUDAGraphMode, CudaGraphBackend, eager_break
from dsv32ref.instrument import measuring, region, timing_regions
from dsv32ref.provenance import provenance
from dsv32ref.results import write_result

# The named region around each Triton launcher, and the kernels it launches: the first is charged the region's
# host time, the others nothing.
WRAPPER_KERNELS = {
    "norm_rope": ("_fused_norm_rope_kernel",),
    "fused_q": ("_fused_q_kernel",),
    "indexer": ("_indexer_scores_kernel", "_topk_kernel", "_topk_hist_kernel", "_topk_compact_kernel"),
    "attention": ("_sparse_mla_kernel", "_sparse_mla_pairs_kernel", "_sparse_mla_ws_kernel", "_sparse_mla_heads_n_kernel",
                  "_combine_splits_kernel"),
}


def region_cost_ns(calls: int = 200_000, repeats: int = 7) -> dict:
    """Host cost of one named region (`with region(name): pass`) with the instrument off and on, in ns: the
    median over `repeats` timed loops. Times a region count gives the instrument's cost per request."""

    def loop(n: int) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with region("attention"):
                pass
        return (time.perf_counter_ns() - t0) / n

    def empty(n: int) -> float:  # the loop itself
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pass
        return (time.perf_counter_ns() - t0) / n

    res = {}
    for label, on in (("off", False), ("on", True)):
        n = calls if not on else calls // 20
        with measuring(on):
            loop(1000)
            res[label] = statistics.median(loop(n) - empty(n) for _ in range(repeats))
    return res


def _loop_us(fn, n: int, repeats: int) -> float:
    """Median over `repeats` of the host time per call of n calls of fn() (one warm-up loop first)."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - t0) / n / 1e3)
    torch.cuda.synchronize()
    return statistics.median(runs)


def _graph(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _in_graph_gap_us(n_kernels: int, repeats: int, graph_us: float) -> dict:
    x = torch.zeros(64, device="cuda")

    def chain():
        for _ in range(n_kernels):
            x.add_(1.0)

    g = _graph(chain)
    host = _loop_us(g.replay, 20, repeats)  # host-side launch of the whole graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_kernel = []
    for _ in range(repeats):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        per_kernel.append(start.elapsed_time(end) * 1e3 / n_kernels)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    durs = [e.time_range.elapsed_us() for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "add" in e.name.lower()]
    kernel_us = statistics.fmean(durs) if durs else float("nan")
    t = statistics.median(per_kernel)
    return {"per_kernel_us": t, "kernel_us": kernel_us, "gap_us": t - kernel_us, "kernels_profiled": len(durs),
            "replay_host_us": host, "node_us": (host - graph_us) / (n_kernels - 1)}


def _eager_region_us(n_regions: int, repeats: int, aten_us: float, graph_us: float) -> float:
    x = torch.zeros(64, device="cuda")

    @eager_break(name="host-cost probe")
    def region(t):
        t.add_(1.0)
        return t

    def forward():
        for _ in range(n_regions):
            x.add_(1.0)  # one captured kernel per segment
            region(x)
        x.add_(1.0)

    forward()
    torch.cuda.synchronize()
    with BreakableCapture(CudaGraphBackend(torch.cuda.graph_pool_handle())) as cap:
        forward()
    per = _loop_us(cap.graph.replay, 20, repeats) / n_regions
    cap.graph.reset()
    return per - aten_us


def wrapper_us(engine, prompt: list[int]) -> dict:
    """Host time per entry of each region of WRAPPER_KERNELS in eager forwards of `engine` (graphs off): median."""
    with engine.runner.graphs.using_mode(CUDAGraphMode.NONE):
        engine.generate(prompt, 1)  # warm
        with timing_regions() as times:
            for _ in range(3):
                engine.generate(prompt, 1)
    return {name: statistics.median(times[name]) for name in WRAPPER_KERNELS if times.get(name)}


def measure(engine, prompt: list[int], repeats: int = 7) -> dict:
    """Every figure of the module docstring, on the current CUDA device; `engine` is a captured LLMEngine
    (any boundary: its eager forward is what the launcher timings come from)."""
    a, b, c = (torch.randn(8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    aten = _loop_us(lambda: torch.add(a, b, out=c), 2000, repeats)
    src = torch.zeros(1024, dtype=torch.int32, pin_memory=True)
    dst = torch.zeros(1024, dtype=torch.int32, device="cuda")
    memcpy = _loop_us(lambda: dst.copy_(src, non_blocking=True), 2000, repeats)
    c0 = engine.config
    x = torch.randn(8, c0.hidden_size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(c0.q_lora_rank, c0.hidden_size, device="cuda", dtype=torch.bfloat16)
    qb = torch.randn(c0.num_attention_heads, 8, c0.qk_nope_head_dim, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(c0.num_attention_heads, c0.qk_nope_head_dim, c0.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
    gemm = (_loop_us(lambda: torch.nn.functional.linear(x, w), 1000, repeats)
            + _loop_us(lambda: torch.bmm(qb, wb), 1000, repeats)) / 2
    g = _graph(lambda: torch.add(a, b, out=c))
    graph = _loop_us(g.replay, 2000, repeats)
    gap = _in_graph_gap_us(512, repeats * 3, graph)
    region = _eager_region_us(64, repeats, aten, graph)
    small = torch.zeros(4, dtype=torch.int64, device="cuda")
    sync = _loop_us(lambda: small.tolist(), 500, repeats)
    seq = 10**6

    def stage():
        with engine.staged(StepInput([(seq, list(prompt), 0)])):
            engine.upload()

    stage_us = _loop_us(stage, 200, repeats)
    return {"aten_launch_us": aten, "gemm_launch_us": gemm, "memcpy_us": memcpy, "graph_launch_us": graph,
            "graph_node_us": gap["node_us"], "eager_region_us": region,
            "in_graph_gap_us": gap["gap_us"], "in_graph": gap, "wrapper_us": wrapper_us(engine, prompt),
            "stage_us": stage_us, "sync_us": sync, "repeats": repeats, "prompt_len": len(prompt),
            "note": "medians of timed loops, instrument off; see dsv32ref.experiments.host_costs"}


def region_host_us(engine, prompt: list[int], requests: int = 32) -> dict:
    """Host time of each entry of the PIECEWISE graph that serves `prompt`, over `requests` requests (medians,
    in replay order): "eager_us" per eager region, "graph_us" per graph segment launch."""
    return regions_host_us({"engine": engine}, prompt, requests)["engine"]


def _timed_request(engine, prompt: list[int], seq: int) -> list[float]:
    with engine.staged(StepInput([(seq, list(prompt), 0)])) as prep, torch.no_grad():  # released after, even on failure
        engine.upload()
        _, hidden, times = engine.runner.execute_timed(prep)
        engine.sample(prep, hidden)
    return times


def regions_host_us(engines: dict, prompt: list[int], requests: int = 32) -> dict:
    """region_host_us for several engines at once, interleaved request by request (rotating the order), so
    that drift over the measurement hits them all alike."""
    out, plans = {}, {}
    for key, engine in engines.items():
        how, size, captured = engine.runner.graphs.lookup(len(prompt), False)
        if how != "PIECEWISE":
            out[key] = {"runs_as": how}
            continue
        kinds = ["graph" if k == "G" else "eager" for k in captured.graph.pattern.split()]
        plans[key] = (engine, kinds, size, captured.graph.eager_names())
    times = {key: [] for key in plans}
    keys = list(plans)
    for i in range(requests + 1):
        for k in range(len(keys)):
            key = keys[(i + k) % len(keys)]
            t = _timed_request(plans[key][0], prompt, 10**6)
            if i:  # the first request of each engine is a warm-up
                times[key].append(t)
    for key, (engine, kinds, size, names) in plans.items():
        per_entry = [statistics.median(col) for col in zip(*times[key])]
        out[key] = {"runs_as": "PIECEWISE", "size": size, "requests": requests,
                    "eager_us": [t for t, kind in zip(per_entry, kinds) if kind == "eager"],
                    "graph_us": [t for t, kind in zip(per_entry, kinds) if kind == "graph"],
                    "names": sorted(set(names))}
    return out


def run(preset: str = "glm-5.2", variants=BOUNDARIES, prompt_len: int = 8, requests: int = 32, seed: int = 0,
        out: str | None = None) -> dict:
    """Every figure of the module docstring for one preset (the TTFT experiment's model and engines), one
    engine per boundary captured at the prompt's size only; written to `out` with provenance."""
    config = reduced_moe(preset)
    weights = build_model(config, variants[0], "cuda", torch.bfloat16, seed)
    (prompt,) = prompts(config.vocab_size, 1, prompt_len, seed)
    result = {"provenance": provenance(), "preset": preset, "prompt_len": prompt_len, "boundaries": list(variants)}
    engines = {}
    for v in variants:
        engines[v] = LLMEngine(config, engine_config(v, [prompt_len], seed=seed), device="cuda", weights=weights)
        engines[v].capture()
    result.update(measure(engines.get("none", engines[variants[0]]), prompt))
    regions = regions_host_us({v: e for v, e in engines.items() if not e.ec.spec.graph_safe_prefill}, prompt, requests)
    for v, r in regions.items():
        print(f"  {v:<18} eager regions {statistics.fmean(r['eager_us']):.0f} us mean, graph launches "
              f"{statistics.fmean(r['graph_us']):.1f} us mean", flush=True)
    for e in engines.values():
        e.release_graphs()
    result["regions"] = regions
    print(f"  launches: aten {result['aten_launch_us']:.2f} us, gemm {result['gemm_launch_us']:.2f}, graph "
          f"{result['graph_launch_us']:.2f} + {result['graph_node_us']:.3f} per node, in-graph gap "
          f"{result['in_graph_gap_us']:.3f}, stage {result['stage_us']:.0f}", flush=True)
    if out:
        write_result(out, result)
    return result
