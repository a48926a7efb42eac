"""TTFT and launch ledger of every eager-boundary variant, with the seeds' protocol, on one GPU.

Protocol (the seeds'): 256 sequential requests after 8 warm-ups, 8-token prompts, 1 output token,
concurrency 1, default graph mode FULL_AND_PIECEWISE. All variants run in one process on one model
(the same weights), each with its own graph capture, interleaved request by request: two earlier runs
that took the variants one after the other disagreed on wide/narrow (1.99x vs 1.14x), so drift over a
run must hit every variant alike. Per variant: TTFT mean / median / p99, requests/s,
the launch ledger of one request, and the floor: the GPU-busy time of that request (its kernels' durations).

Model: the preset's attention at full size (all layers, heads and widths, IndexShare), with the MoE
reduced (see REDUCTION) so that the whole stack fits one H200 and the step has no host sync.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from dsv32ref.checks import is_int
from dsv32ref.config import ModelConfig
from dsv32ref.results import progress, write_partial, write_result

REDUCTION = ("MoE reduced to 4 routed experts (top-2) + 1 shared expert, moe_intermediate_size unchanged, computed "
             "densely (every routed expert on every token, weighted by the router) so a step has no host sync; "
             "the router keeps the DeepSeek-V3 formula. Everything else (embedding, every attention layer at full "
             "width, indexers, dense MLPs of the first layers, lm_head) is at full size.")


def reduced_config(preset: str) -> ModelConfig:
    return ModelConfig.preset(preset).replace(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)



def _stats(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"mean_ms": statistics.fmean(s), "median_ms": statistics.median(s),
            "p99_ms": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))], "min_ms": s[0], "max_ms": s[-1]}


def region_cost_ns(calls: int = 200_000, repeats: int = 7) -> dict:
    """Host cost of one named region (`with region(name): pass`) with the instrument off and on, in ns: the
    median over `repeats` timed loops. Times a region count gives the instrument's cost per request."""
    from dsv32ref.instrument import measuring, region

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


ARMS = {"skip": {"skip_short_topk": True}, "split": {"split_graphs": True}}  # `<boundary>+<arm>`: EngineConfig switches


def protocol_config(boundary: str, capture_sizes=(1, 2, 4, 8, 16), mode: str = "full_and_piecewise", seed: int = 0,
                    **switches):
    """The EngineConfig of the PR's protocol (one request of a few tokens at a time), shared by the TTFT run,
    the host costs and the timeline; `switches`: EngineConfig fields of an arm (ARMS)."""
    from dsv32ref.engine import EngineConfig
    from dsv32ref.graphs import CUDAGraphMode

    return EngineConfig(boundary=boundary, mode=CUDAGraphMode(mode), max_model_len=512, max_num_seqs=16,
                        max_num_batched_tokens=16, capture_sizes=list(capture_sizes), seed=seed, **switches)


def arm(name: str) -> tuple[str, str, dict]:
    """"narrow" -> ("narrow", "narrow", {}); "none+split" -> ("none+split", "none", {"split_graphs": True})."""
    boundary, _, kind = name.partition("+")
    if kind and kind not in ARMS:
        raise ValueError(f"arm {name!r}: expected <boundary> or <boundary>+<arm> with arm one of {sorted(ARMS)}")
    return name, boundary, dict(ARMS[kind]) if kind else {}


def anatomy(engines: dict, prompts: list[list[int]]) -> dict:
    """Where one prefill step's time goes, per engine (interleaved request by request, instrument off), medians
    in ms: host time of stage + upload (the GPU has nothing to do yet), of execute (the graph launch; for
    eager boundaries every eager region's host work too), of sample until the tokens are on the host; and the
    GPU time from the upload to the sampled tokens (CUDA events, recorded around the step: two event records
    are the only additions to the step)."""
    import torch

    from dsv32ref.engine import StepInput

    rec = {v: {"stage_ms": [], "execute_ms": [], "sample_ms": [], "total_ms": [], "gpu_ms": []} for v in engines}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    seq = 10**6
    for i, p in enumerate(prompts):
        for k in range(len(engines)):
            v = list(engines)[(i + k) % len(engines)]
            eng = engines[v]
            torch.cuda.synchronize()
            with torch.no_grad():
                t0 = time.perf_counter()
                prep = eng.stage(StepInput([(seq, list(p), 0)]))
                ev[0].record()
                eng.upload()
                t1 = time.perf_counter()
                _, hidden = eng.execute(prep)
                t2 = time.perf_counter()
                eng.sample(prep, hidden)
                ev[1].record()
                t3 = time.perf_counter()
            eng.allocator.release(seq)
            r = rec[v]
            for key, dt in (("stage_ms", t1 - t0), ("execute_ms", t2 - t1), ("sample_ms", t3 - t2),
                            ("total_ms", t3 - t0)):
                r[key].append(dt * 1e3)
            r["gpu_ms"].append(ev[0].elapsed_time(ev[1]))
    return {v: {k: statistics.median(x) for k, x in r.items()} | {"requests": len(prompts)} for v, r in rec.items()}


def run(preset: str = "glm-5.2", variants=None, n_requests: int = 256, warmup: int = 8, prompt_len: int = 8,
        mode: str = "full_and_piecewise", seed: int = 0, out: str | None = None, device: str = "cuda",
        config: ModelConfig | None = None, tp_rank: int = 0, tp_size: int = 1, instrument_ab=(),
        capture_sizes=(1, 2, 4, 8, 16), skip_topk=(), split=(), anatomy_requests: int = 32,
        host_costs: bool = True) -> dict:
    """The experiment; `device="cpu"` (with a tiny `config`) runs the same control flow on emulated graphs
    as a smoke test, without timings that mean anything.

    `instrument_ab`: variants that also run a second arm, `<variant>+ranges`, with every named region and
    eager range open on every request (the instrument as it was before it was made free when off), interleaved
    with the rest: the difference is what the instrument costs when it is on. TTFT of the plain variants is
    always timed with the instrument off.

    `skip_topk`: variants that also run `<variant>+skip`, an engine with EngineConfig.skip_short_topk on (the
    prompt has fewer keys than index_topk, so the indexer's scoring and selection are skipped where Python
    decides: in eager regions), interleaved with the rest. `split`: variants that also run `<variant>+split`,
    with EngineConfig.split_graphs on (captures start a new graph before layers 1, 4, 16, 64: does the launch of
    one large graph hold the GPU back?).

    Then, per variant, the step's anatomy over `anatomy_requests` more requests (see `anatomy`), and on a GPU
    the host costs of the TTFT model (dsv32ref.experiments.host_costs), measured with the "none" engine when
    it runs.

    With tp_size > 1 (inside torch.distributed, one call per rank: `dsv32ref ttft --tp N`), every rank holds its
    shard (heads and MLP columns split, experts split: TP = EP) and runs the same requests in lockstep, the
    collectives keeping them together; rank 0 reports its own timings and ledger."""
    from dsv32ref.engine import BOUNDARIES, LLMEngine, build_model
    from dsv32ref.experiments.ledger import measure
    from dsv32ref.instrument import measuring
    from dsv32ref.provenance import provenance

    for name, v, low in (("n_requests", n_requests, 1), ("warmup", warmup, 0), ("prompt_len", prompt_len, 1)):
        if not is_int(v) or v < low:
            raise ValueError(f"ttft.run: {name} must be an int >= {low}, got {v!r}")
    variants = list(variants or BOUNDARIES)
    unknown = [v for v in list(variants) + list(instrument_ab) + list(skip_topk) + list(split) if v not in BOUNDARIES]
    if unknown:
        raise ValueError(f"ttft.run: unknown variant(s) {unknown}; expected some of {BOUNDARIES}")
    config = config or reduced_config(preset)
    cuda = device == "cuda"
    t0 = time.time()
    model = build_model(config, variants[0], device, torch.bfloat16 if cuda else torch.float32, seed)
    lead = tp_rank == 0
    if tp_size > 1:
        import torch.distributed as dist

        from dsv32ref.engine.model import TensorParallel

        model.shard(TensorParallel(tp_rank, tp_size, dist.group.WORLD))
        out = out if lead else None
    if cuda and lead:
        torch.cuda.synchronize()
        print(f"{preset}: model built in {time.time() - t0:.1f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB "
              f"of weights", flush=True)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, config.vocab_size, (warmup + n_requests, prompt_len), generator=g).tolist()
    result = {"provenance": provenance(), "preset": preset, "reduction": REDUCTION, "protocol": {
        "requests": n_requests, "warmup": warmup, "prompt_len": prompt_len, "output_tokens": 1, "concurrency": 1,
        "mode": mode, "tensor_parallel": tp_size, "expert_parallel": tp_size}, "variants": {}}
    result["protocol"]["order"] = "interleaved: request i runs on every variant in turn (rotating the order)"
    engines = {}  # every variant captured up front, so that run-to-run drift hits them all alike
    # an engine per variant, and per extra arm: (its name, its boundary, EngineConfig switches)
    configs = [(v, v, {}) for v in variants] + [arm(f"{v}+{kind}") for kind, vs in (("skip", skip_topk),
                                                                                     ("split", split)) for v in vs]
    for name, v, switches in configs:
        ec = protocol_config(v, capture_sizes, mode, seed, **switches)
        eng = LLMEngine(config, ec, device=device, dtype=model.lm_head.dtype, model=model)
        engines[name] = (eng, eng.capture())
    if cuda:  # as vLLM's engine core does once started: collections skip the start-up heap (models, graphs)
        gc.collect()
        gc.freeze()
        result["protocol"]["gc"] = "start-up heap frozen (gc.freeze) after capture"
    # an arm: (its name, its engine, the instrument on)
    arms = ([(name, name, False) for name, _, _ in configs]
            + [(f"{v}+ranges", v, True) for v in instrument_ab if v in engines])
    for i in range(warmup):
        for _, e, on in arms:
            with measuring(on):
                engines[e][0].generate(prompts[i], 1)
    ttft = {a[0]: [] for a in arms}
    wall = {a[0]: 0.0 for a in arms}
    first_tokens = {a[0]: [] for a in arms}
    for i in range(n_requests):
        for k in range(len(arms)):
            key, e, on = arms[(i + k) % len(arms)]
            with measuring(on):
                t0 = time.perf_counter()
                tok, t = engines[e][0].generate(prompts[warmup + i], 1)
                wall[key] += time.perf_counter() - t0
            ttft[key].append(t * 1e3)
            first_tokens[key].append(tok[0])
        if lead:
            progress(i + 1, n_requests, "TTFT, all variants")
    plain = [a[0] for a in arms if not a[2]]
    anat = anatomy({v: engines[v][0] for v in plain}, prompts[:anatomy_requests]) if cuda and anatomy_requests else {}
    for v in plain:
        eng, cap_s = engines[v]
        ledger = measure(eng, prompts[warmup])
        how = eng.runner.lookup(prompt_len, False)[0]
        result["variants"][v] = {**_stats(ttft[v]), "ttft_ms": ttft[v], "req_per_s": n_requests / wall[v],
                                 "capture_s": cap_s, "prefill_runs_as": how, "ledger": ledger,
                                 "ttft_over_floor": statistics.fmean(ttft[v]) / ledger["gpu_busy_ms"]
                                 if ledger["gpu_busy_ms"] else None, "anatomy": anat.get(v),
                                 "skip_short_topk": eng.ec.skip_short_topk, "split_graphs": eng.ec.split_graphs}
        r = result["variants"][v]
        if not lead:
            continue
        print(f"  {v:<12} TTFT mean {r['mean_ms']:.2f} ms, median {r['median_ms']:.2f}, p99 {r['p99_ms']:.2f}, "
              f"{r['req_per_s']:.1f} req/s; direct launches {ledger['direct_total']}, graph launches "
              f"{ledger['graph_launches']}, floor {ledger['gpu_busy_ms']:.2f} ms, GPU idle {ledger['gpu_idle_ms']:.2f} ms, "
              f"eager-region host time {ledger['eager_region_host_ms']:.2f} ms", flush=True)
        if out:
            write_partial(out, result)
    if cuda and host_costs and lead:
        from dsv32ref.experiments import host_costs as hc

        probe = engines["none"][0] if "none" in engines else engines[variants[0]][0]
        result["host_costs"] = hc.measure(probe, prompts[warmup])
        result["host_costs"]["engine"] = probe.ec.boundary
        # each eager region's host time in replay, in this process (the TTFT model's per-region costs)
        result["host_costs"]["regions"] = hc.regions_host_us(
            {v: engines[v][0] for v in variants if not engines[v][0].ec.graph_safe_prefill}, prompts[warmup],
            anatomy_requests)
        if out:
            write_partial(out, result)
    for eng, _ in engines.values():
        eng.release_graphs()
    del engines
    gc.unfreeze()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if instrument_ab:
        cost = region_cost_ns()
        ab = result["instrument"] = {"region_cost_ns": cost, "note": (
            "'<variant>+ranges' ran every request with the named regions and eager ranges open (torch.profiler "
            "record_function on each), as they were before the instrument was switched off outside measurements; "
            "remaining_ms_per_request = regions entered per request (from the profiled request) x region_cost_ns"
            "['off']"), "variants": {}}
        for v in instrument_ab:
            if v not in result["variants"]:
                continue
            with_r = _stats(ttft[f"{v}+ranges"])
            entered = result["variants"][v]["ledger"]["regions_entered"]
            ab["variants"][v] = {"with_ranges": with_r, "without": {k: result["variants"][v][k] for k in with_r},
                                 "ranges_median_ms": with_r["median_ms"] - result["variants"][v]["median_ms"],
                                 "ranges_mean_ms": with_r["mean_ms"] - result["variants"][v]["mean_ms"],
                                 "regions_entered_per_request": entered,
                                 "remaining_ms_per_request": entered * cost["off"] / 1e6,
                                 "ttft_ms_with_ranges": ttft[f"{v}+ranges"]}
            if lead:
                a = ab["variants"][v]
                print(f"  instrument {v:<10} median TTFT with ranges {with_r['median_ms']:.2f} ms, without "
                      f"{result['variants'][v]['median_ms']:.2f} ms ({a['ranges_median_ms']:+.2f}); off: {entered} "
                      f"regions x {cost['off']:.0f} ns = {a['remaining_ms_per_request']:.3f} ms per request", flush=True)
        if "wide" in instrument_ab and "narrow" in instrument_ab:
            ab["wide_over_narrow_with_ranges"] = (statistics.fmean(ttft["wide+ranges"])
                                                  / statistics.fmean(ttft["narrow+ranges"]))
    base = first_tokens[variants[0]]
    result["same_tokens_across_variants"] = all(t == base for t in first_tokens.values())
    result["first_tokens"] = base  # of every timed request: compares runs (one GPU vs TP) token by token
    if "wide" in result["variants"] and "narrow" in result["variants"]:
        result["wide_over_narrow"] = result["variants"]["wide"]["mean_ms"] / result["variants"]["narrow"]["mean_ms"]
    if out:
        write_result(out, result)
    return result


if __name__ == "__main__":
    run(out=sys.argv[1] if len(sys.argv) > 1 else None)


def rank_main(rank: int, world_size: int, preset: str, n_requests: int, warmup: int, out: str | None,
              device: str = "cuda", config: ModelConfig | None = None, variants=None) -> None:
    """One rank of `dsv32ref ttft --tp N` (started by dsv32ref.parallel.spawn)."""
    run(preset, variants=variants, n_requests=n_requests, warmup=warmup, out=out, device=device, config=config,
        tp_rank=rank, tp_size=world_size)
