"""TTFT and launch ledger of every eager boundary, with the PR's protocol, on one GPU.

Protocol (the PR's): 256 sequential requests after 8 warm-ups, 8-token prompts, 1 output token, concurrency 1,
default graph mode FULL_AND_PIECEWISE. Every arm runs in one process on its own engine over one copy of the
weights, each with its own graph capture, interleaved request by request (request i runs on every arm in turn,
the order rotating), so that drift over the run hits every arm alike. Per boundary: TTFT mean / median / p99,
requests/s, the launch ledger of one request, the floor (the GPU-busy time of that request: its kernels'
durations), and the step's anatomy (host time before the launch, the launch, GPU time to the sampled tokens).

Model: the preset's attention at full size (all layers, heads and widths, IndexShare), with the MoE reduced
(dsv32ref.config.REDUCED_MOE) so that the whole stack fits one H200 and the step has no host sync.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from dsv32ref.bench.kernels import measure_copy
from dsv32ref.checks import check_bool, check_int
from dsv32ref.config import REDUCED_MOE, ModelConfig, reduced_moe
from dsv32ref.engine import BOUNDARIES, LLMEngine, StepInput, TensorParallel, build_model, shard
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.engine.model import EngineMoE
from dsv32ref.experiments import host_costs, ledger
from dsv32ref.experiments.protocol import MAX_MODEL_LEN, arm, engine_config, numerics, prompts, stats
from dsv32ref.instrument import measuring
from dsv32ref.provenance import provenance
from dsv32ref.results import progress, write_partial, write_result

__all__ = ["TTFTProtocol", "anatomy", "run", "weight_bytes_by_region", "weight_read"]


@dataclass(frozen=True)
class TTFTProtocol:
    """What one TTFT run measures. `skip_topk`: boundaries that also run as `<boundary>+skip` (the
    short-prefill top-k skip on: the prompt has fewer keys than index_topk, so eager regions skip the indexer's
    scoring and selection). `fp8_kv`: boundaries that also run as `<boundary>+fp8`, with the FP8 KV cache
    (EngineConfig.kv_cache_dtype "fp8"), their tokens beside the others'. `fused_moe`: boundaries that also run
    as `<boundary>+fused`, their MoE layers in dsv32ref.kernels.fused_moe (EngineConfig.moe "fused"). `skinny_gemm`:
    boundaries that also run as `<boundary>+skinny`, their projections in dsv32ref.kernels.skinny_gemm
    (EngineConfig.gemm "skinny"). `fused_skinny`: boundaries that also run as `<boundary>+fused+skinny`, with both
    switches on. `instrument_ab`: boundaries that also
    run as `<boundary>+ranges`, every request with every named region and eager range open (what the instrument
    costs when it is on); TTFT of the plain arms is always timed with it off. Then the step's anatomy over `anatomy_requests` more requests, and on a GPU the
    host costs of the TTFT model (dsv32ref.experiments.host_costs) in the same process."""

    preset: str = "glm-5.2"
    requests: int = 256
    warmup: int = 8
    prompt_len: int = 8
    mode: str = "full_and_piecewise"
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    seed: int = 0
    variants: tuple[str, ...] = BOUNDARIES
    skip_topk: tuple[str, ...] = ()
    fp8_kv: tuple[str, ...] = ()
    fused_moe: tuple[str, ...] = ()
    skinny_gemm: tuple[str, ...] = ()
    fused_skinny: tuple[str, ...] = ()
    instrument_ab: tuple[str, ...] = ()
    anatomy_requests: int = 32
    host_costs: bool = True

    def __post_init__(self):
        # a prompt and its first token fit the protocol's sequences; the counts are bounded so that the prompts
        # drawn for every arm (requests x prompt_len ints) stay small
        for name, low, high in (("requests", 1, 1 << 16), ("warmup", 0, 1 << 12), ("prompt_len", 1, MAX_MODEL_LEN - 1),
                                ("anatomy_requests", 0, 1 << 16), ("seed", 0, 2 ** 63 - 1)):
            check_int(f"TTFTProtocol.{name}", getattr(self, name), low, high)
        if self.mode not in [m.value for m in CUDAGraphMode]:
            raise ValueError(f"TTFTProtocol.mode: expected one of {[m.value for m in CUDAGraphMode]}, got {self.mode!r}")
        check_bool("TTFTProtocol.host_costs", self.host_costs)
        for name in ("variants", "skip_topk", "fp8_kv", "fused_moe", "skinny_gemm", "fused_skinny", "instrument_ab"):
            given = getattr(self, name)
            if not isinstance(given, (list, tuple)):
                raise ValueError(f"TTFTProtocol.{name}: expected a tuple of boundaries, got {given!r}")
            unknown = [v for v in given if v not in BOUNDARIES]
            if unknown or (name == "variants" and not self.variants):
                raise ValueError(f"TTFTProtocol.{name}: unknown boundaries {unknown}; expected some of {BOUNDARIES}")
            if len(set(given)) != len(given):  # one engine an arm: a repeated name would capture it twice
                raise ValueError(f"TTFTProtocol.{name}: each boundary once, got {list(given)}")
        if not set(self.instrument_ab) <= set(self.variants):
            raise ValueError(f"TTFTProtocol.instrument_ab: {sorted(set(self.instrument_ab) - set(self.variants))} not "
                             f"among the variants {list(self.variants)} (the instrument's arms time those engines)")

    def arms(self) -> list[tuple[str, str, dict]]:
        """(name, boundary, EngineConfig switches) of every engine: the boundaries, then their +skip, +fp8,
        +fused, +skinny and +fused+skinny arms."""
        return ([arm(v) for v in self.variants] + [arm(f"{v}+skip") for v in self.skip_topk] +
                [arm(f"{v}+fp8") for v in self.fp8_kv] + [arm(f"{v}+fused") for v in self.fused_moe] +
                [arm(f"{v}+skinny") for v in self.skinny_gemm] + [arm(f"{v}+fused+skinny") for v in self.fused_skinny])


def anatomy(engines: dict, prompts_: list[list[int]]) -> dict:
    """Where one prefill step's time goes, per engine (interleaved request by request, instrument off), medians
    in ms: host time of stage + upload (the GPU has nothing to do yet), of execute (the graph launch; for
    eager boundaries every eager region's host work too), of sample until the tokens are on the host; and the
    GPU time from the upload to the sampled tokens (CUDA events, recorded around the step: two event records
    are the only additions to the step)."""
    rec = {v: {"stage_ms": [], "execute_ms": [], "sample_ms": [], "total_ms": [], "gpu_ms": []} for v in engines}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    seq, names = 10**6, list(engines)
    for i, p in enumerate(prompts_):
        for k in range(len(names)):
            v = names[(i + k) % len(names)]
            eng = engines[v]
            torch.cuda.synchronize()
            with torch.no_grad():
                t0 = time.perf_counter()
                with eng.staged(StepInput([(seq, list(p), 0)])) as prep:  # released after, even on failure
                    ev[0].record()
                    eng.upload()
                    t1 = time.perf_counter()
                    _, hidden = eng.execute(prep)
                    t2 = time.perf_counter()
                    eng.sample(prep, hidden)
                    ev[1].record()
                    t3 = time.perf_counter()
            r = rec[v]
            for key, dt in (("stage_ms", t1 - t0), ("execute_ms", t2 - t1), ("sample_ms", t3 - t2),
                            ("total_ms", t3 - t0)):
                r[key].append(dt * 1e3)
            r["gpu_ms"].append(ev[0].elapsed_time(ev[1]))
    return {v: {k: statistics.median(x) for k, x in r.items()} | {"requests": len(prompts_)} for v, r in rec.items()}


def _engines(config: ModelConfig, p: TTFTProtocol, weights, device: str) -> dict:
    """name -> (engine, capture seconds), every arm captured up front (so run-to-run drift hits them all)."""
    engines = {}
    for name, boundary, switches in p.arms():
        ec = engine_config(boundary, p.capture_sizes, p.mode, p.seed, **switches)
        eng = LLMEngine(config, ec, device=device, dtype=weights.lm_head.dtype, weights=weights)
        engines[name] = (eng, eng.capture())
    return engines


def _time_requests(engines: dict, p: TTFTProtocol, prompts_: list, lead: bool) -> dict:
    """Warm-ups, then the timed requests, interleaved over every arm (+ranges arms with the instrument on).
    Returns {arm: {"ttft_ms": [...], "wall_s": float, "tokens": [...]}}."""
    arms = [(name, name, False) for name in engines] + [(f"{v}+ranges", v, True) for v in p.instrument_ab]
    for i in range(p.warmup):
        for _, e, on in arms:
            with measuring(on):
                engines[e][0].generate(prompts_[i], 1)
    timed = {a[0]: {"ttft_ms": [], "wall_s": 0.0, "tokens": []} for a in arms}
    for i in range(p.requests):
        for k in range(len(arms)):
            key, e, on = arms[(i + k) % len(arms)]
            with measuring(on):
                t0 = time.perf_counter()
                tok, t = engines[e][0].generate(prompts_[p.warmup + i], 1)
                timed[key]["wall_s"] += time.perf_counter() - t0
            timed[key]["ttft_ms"].append(t * 1e3)
            timed[key]["tokens"].append(tok[0])
        if lead:
            progress(i + 1, p.requests, "TTFT, all variants")
    return timed


def first_token_margins(eng: LLMEngine, prompts_: list) -> list[float]:
    """Each prompt's first token again, untimed (after the timed loop: no sync on its path) -> the gap between the
    largest and the second-largest logit, in fp32: where it is small, any rounding (an FP8 cache's) can reorder them."""
    margins = []
    for prompt in prompts_:
        eng.generate(prompt, 1)
        top = eng.last_logits[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return margins


def weight_read(model, copy_GBps: float | None) -> dict:
    """What one forward must read of the rank's weights, every parameter but the embedding table (a step reads
    only its tokens' rows of it), and the time that takes at the copy bandwidth measured in the same run: the
    floor under any step's GPU time that the weights alone set (None without a measured bandwidth)."""
    nbytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name != "embed_tokens")
    return {"bytes": nbytes, "copy_GBps": copy_GBps, "limit_ms": nbytes / copy_GBps / 1e6 if copy_GBps else None}


# the engine's instrument region that reads each weight (dsv32ref.engine.model), by the parameter's own name;
# an MLP's weights are read in "moe" or "mlp" (which module holds them says), lm_head and the final norm in the
# logits, outside the forward: "other"
_WEIGHT_REGION = {
    "fused_qkv_a_proj": "a_proj", "q_b_proj": "q_gemm", "wq_b": "q_gemm",
    "W_UK": "wuk_bmm", "W_UV": "uv_bmm", "o_proj": "o_proj", "q_a_layernorm": "norm_rope",
    "kv_a_layernorm": "norm_rope", "k_norm_weight": "norm_rope", "k_norm_bias": "norm_rope",
    "input_layernorm": "layer_norm", "post_attention_layernorm": "layer_norm", "lm_head": "other", "norm": "other",
}


def weight_bytes_by_region(model) -> dict[str, int]:
    """weight_read's bytes split by the instrument region whose kernels read them: beside the ledger's GPU time of
    each region (gpu_ms_by_region_eager), how far each part of the floor is from its own weight read."""
    by = {}
    for name, p in model.named_parameters():
        if name == "embed_tokens":
            continue
        if ".mlp." in name:
            region = "moe" if isinstance(model.get_submodule(name[: name.index(".mlp.") + 4]), EngineMoE) else "mlp"
        else:
            region = _WEIGHT_REGION[name.rsplit(".", 1)[-1]]
        by[region] = by.get(region, 0) + p.numel() * p.element_size()
    return by


def _attach_weight_read(result: dict, weights, cuda: bool, lead: bool) -> None:
    """The weights' read at this GPU's copy bandwidth (measured after the timed loop: nothing else runs), each
    arm's GPU-busy floor over it, and each region's weight bytes and read time."""
    result["weight_read"] = w = weight_read(weights, measure_copy()["copy_GBps"] if cuda else None)
    w["by_region"] = {region: {"bytes": n, "limit_ms": n / w["copy_GBps"] / 1e6 if w["copy_GBps"] else None}
                      for region, n in weight_bytes_by_region(weights).items()}
    for r in result["variants"].values():
        r["floor_over_weight_read"] = r["ledger"]["gpu_busy_ms"] / w["limit_ms"] if w["limit_ms"] else None
    if lead and w["limit_ms"]:
        print(f"  weights read once: {w['bytes'] / 2**30:.2f} GiB at {w['copy_GBps']:.0f} GB/s = {w['limit_ms']:.2f} "
              f"ms; floor / that: " + ", ".join(f"{v} {r['floor_over_weight_read']:.2f}"
                                               for v, r in result["variants"].items()), flush=True)
        best = min(result["variants"], key=lambda v: result["variants"][v]["ledger"]["gpu_busy_ms"])
        by_ms = result["variants"][best]["ledger"]["gpu_ms_by_region_eager"] or {}
        over = sorted(((by_ms.get(k, 0.0) - v["limit_ms"], k) for k, v in w["by_region"].items()), reverse=True)
        print(f"  {best}'s GPU time over each region's weight read: "
              + ", ".join(f"{k} {ms:+.2f} ms" for ms, k in over[:5]), flush=True)


def _arm_result(eng: LLMEngine, cap_s: float, t: dict, p: TTFTProtocol, prompt: list[int], anat) -> dict:
    led = ledger.measure(eng, prompt)
    floor = led["gpu_busy_ms"]
    return {**stats(t["ttft_ms"]), "ttft_ms": t["ttft_ms"], "req_per_s": p.requests / t["wall_s"], "capture_s": cap_s,
            "prefill_runs_as": eng.runner.graphs.lookup(p.prompt_len, False)[0], "ledger": led,
            "ttft_over_floor": statistics.fmean(t["ttft_ms"]) / floor if floor else None, "anatomy": anat,
            "skip_short_topk": eng.ec.skip_short_topk, "kv_cache_dtype": eng.ec.kv_cache_dtype,
            "kv_tokens_per_gib": eng.runner.memory["kv_tokens_per_gib"]}


def _print_arm(v: str, r: dict) -> None:
    led = r["ledger"]
    print(f"  {v:<12} TTFT mean {r['mean_ms']:.2f} ms, median {r['median_ms']:.2f}, p99 {r['p99_ms']:.2f}, "
          f"{r['req_per_s']:.1f} req/s; direct launches {led['direct_total']}, graph launches "
          f"{led['graph_launches']}, floor {led['gpu_busy_ms']:.2f} ms, GPU idle {led['gpu_idle_ms']:.2f} ms, "
          f"eager-region host time {led['eager_region_host_ms']:.2f} ms", flush=True)


def _host_costs(engines: dict, p: TTFTProtocol, prompt: list[int]) -> dict:
    """The TTFT model's host costs in this process: launch costs with the `none` engine (or the first), and each
    eager region's host time in replay for every boundary that has eager regions."""
    probe = engines["none"][0] if "none" in engines else next(iter(engines.values()))[0]
    costs = host_costs.measure(probe, prompt)
    costs["engine"] = probe.ec.boundary
    costs["regions"] = host_costs.regions_host_us(
        {v: engines[v][0] for v in p.variants if not engines[v][0].ec.spec.graph_safe_prefill}, prompt,
        p.anatomy_requests)
    return costs


def _instrument_ab(result: dict, timed: dict, p: TTFTProtocol, lead: bool) -> None:
    cost = host_costs.region_cost_ns()
    ab = result["instrument"] = {"region_cost_ns": cost, "note": (
        "'<variant>+ranges' ran every request with the named regions and eager ranges open (torch.profiler "
        "record_function on each), as they were before the instrument was switched off outside measurements; "
        "remaining_ms_per_request = regions entered per request (from the profiled request) x region_cost_ns"
        "['off']"), "variants": {}}
    for v in p.instrument_ab:
        with_r, plain = stats(timed[f"{v}+ranges"]["ttft_ms"]), result["variants"][v]
        entered = plain["ledger"]["regions_entered"]
        a = ab["variants"][v] = {
            "with_ranges": with_r, "without": {k: plain[k] for k in with_r},
            "ranges_median_ms": with_r["median_ms"] - plain["median_ms"],
            "ranges_mean_ms": with_r["mean_ms"] - plain["mean_ms"], "regions_entered_per_request": entered,
            "remaining_ms_per_request": entered * cost["off"] / 1e6, "ttft_ms_with_ranges": timed[f"{v}+ranges"]["ttft_ms"]}
        if lead:
            print(f"  instrument {v:<10} median TTFT with ranges {with_r['median_ms']:.2f} ms, without "
                  f"{plain['median_ms']:.2f} ms ({a['ranges_median_ms']:+.2f}); off: {entered} regions x "
                  f"{cost['off']:.0f} ns = {a['remaining_ms_per_request']:.3f} ms per request", flush=True)
    if "wide" in p.instrument_ab and "narrow" in p.instrument_ab:
        ab["wide_over_narrow_with_ranges"] = (statistics.fmean(timed["wide+ranges"]["ttft_ms"])
                                              / statistics.fmean(timed["narrow+ranges"]["ttft_ms"]))


def _weights(config: ModelConfig, p: TTFTProtocol, device: str, tp_rank: int, tp_size: int):
    model = build_model(config, p.variants[0], device, torch.bfloat16 if device == "cuda" else torch.float32, p.seed)
    if tp_size > 1:
        model = shard(model, TensorParallel(tp_rank, tp_size, torch.distributed.group.WORLD))
    return model


def _token_summary(result: dict, timed: dict) -> None:
    """Which arms produced the same first tokens: within each numerics, and each arm against the first."""
    # the arms of one numerics (protocol.numerics): the FP8 cache, the fused MoE and skinny_gemm round differently
    # from the bf16 cache's dense MoE over cuBLAS's GEMMs, and each combination of them differently again
    groups = {}
    for v, t in timed.items():
        groups.setdefault(numerics(v), []).append(t["tokens"])
    tokens = groups[""]
    result["same_tokens_across_variants"] = all(t == tokens[0] for t in tokens)
    result["same_tokens_within"] = {tail: all(t == group[0] for t in group) for tail, group in groups.items() if tail}
    result["first_tokens"] = tokens[0]  # of every timed request: compares runs (one GPU vs TP) token by token
    for tail in result["same_tokens_within"]:  # each such arm's tokens, request by request, to set beside
        # first_token_margins where they differ: "fp8_first_tokens", "fused+skinny_first_tokens"
        result[f"{tail[1:]}_first_tokens"] = {v: t["tokens"] for v, t in timed.items() if numerics(v) == tail}
    result["tokens_equal_to_first_arm"] = {  # per arm, the fraction of requests whose token is the first arm's
        v: sum(a == b for a, b in zip(t["tokens"], tokens[0])) / max(1, len(tokens[0])) for v, t in timed.items()}


def run(p: TTFTProtocol = TTFTProtocol(), out: str | None = None, device: str = "cuda",
        config: ModelConfig | None = None, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """The experiment; `device="cpu"` (with a tiny `config`) runs the same control flow on emulated graphs as a
    smoke test, without timings that mean anything. With tp_size > 1 (inside torch.distributed, one call per
    rank: `dsv32ref ttft --tp N`) every rank holds its shard and runs the same requests in lockstep, the
    collectives keeping them together; rank 0 reports its own timings and ledger."""
    config, cuda, lead = config or reduced_moe(p.preset), device == "cuda", tp_rank == 0
    out = out if lead else None
    t0 = time.time()
    weights = _weights(config, p, device, tp_rank, tp_size)
    engines = _engines(config, p, weights, device)
    if cuda and lead:
        print(f"{p.preset}: engines built and captured in {time.time() - t0:.1f} s", flush=True)
    requests = prompts(config.vocab_size, p.warmup + p.requests, p.prompt_len, p.seed)
    result = {"provenance": provenance(), "preset": p.preset, "reduction": REDUCED_MOE, "protocol": {
        "requests": p.requests, "warmup": p.warmup, "prompt_len": p.prompt_len, "output_tokens": 1, "concurrency": 1,
        "mode": p.mode, "tensor_parallel": tp_size, "expert_parallel": tp_size,
        "order": "interleaved: request i runs on every variant in turn (rotating the order)"}, "variants": {}}
    if cuda:  # as vLLM's engine core does once started: collections skip the start-up heap (models, graphs)
        gc.collect()
        gc.freeze()
        result["protocol"]["gc"] = "start-up heap frozen (gc.freeze) after capture"
    timed = _time_requests(engines, p, requests, lead)
    anat = anatomy({v: e for v, (e, _) in engines.items()}, requests[:p.anatomy_requests]) \
        if cuda and p.anatomy_requests else {}
    for v, (eng, cap_s) in engines.items():
        result["variants"][v] = r = _arm_result(eng, cap_s, timed[v], p, requests[p.warmup], anat.get(v))
        if lead:
            _print_arm(v, r)
        if out:
            write_partial(out, result)
    if cuda and p.host_costs and lead:
        result["host_costs"] = _host_costs(engines, p, requests[p.warmup])
    _attach_weight_read(result, weights, cuda, lead)
    del weights
    if p.fp8_kv or p.fused_moe or p.skinny_gemm or p.fused_skinny:  # why such an arm's token differs: how close
        # the first arm's top two were
        result["first_token_margins"] = first_token_margins(engines[p.variants[0]][0],
                                                            requests[p.warmup:p.warmup + p.requests])
    for eng, _ in engines.values():
        eng.release_graphs()
    del engines
    gc.unfreeze()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if p.instrument_ab:
        _instrument_ab(result, timed, p, lead)
    _token_summary(result, timed)
    if "wide" in result["variants"] and "narrow" in result["variants"]:
        result["wide_over_narrow"] = result["variants"]["wide"]["mean_ms"] / result["variants"]["narrow"]["mean_ms"]
    if out:
        write_result(out, result)
    return result


def rank_main(rank: int, world_size: int, p: TTFTProtocol, out: str | None, device: str = "cuda",
              config: ModelConfig | None = None) -> None:
    """One rank of `dsv32ref ttft --tp N` (started by dsv32ref.parallel.spawn)."""
    run(p, out=out, device=device, config=config, tp_rank=rank, tp_size=world_size)
