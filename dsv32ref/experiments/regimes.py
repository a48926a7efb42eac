"""The regime map: where narrowing the eager break matters, on one GPU, every variant interleaved in one process.

    prefill   TTFT against prompt length (one request at a time, one output token), with each variant's
              GPU-busy floor at that length. Capture sizes stop at 512 tokens, so longer prompts run with no
              graph at all: the point where prefill leaves the graphs.
    decode    time per output token (TPOT) of a batch of B requests at context C: one uniform-decode step,
              FULL graphs against PIECEWISE ones (the eager regions replayed between graph segments).

Every variant is captured up front on one model (shared weights) and one KV cache (shared blocks: the
engines run one after another and release their sequences). Decode contexts are not prefilled (64 requests
of 8k tokens would take minutes): their blocks are allocated and the cache holds random values, which
changes no kernel's work except the top-k's data-dependent selection, drawn from the same distribution for
every variant. The MoE is reduced as in the TTFT experiment (dsv32ref.experiments.ttft.REDUCTION).
"""

from __future__ import annotations

import statistics
import time

import torch

from dsv32ref.checks import is_int
from dsv32ref.results import progress, write_partial, write_result

CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]



def _median_spread(ms: list[float]) -> dict:
    s = sorted(ms)
    q = lambda f: s[min(len(s) - 1, int(round(f * (len(s) - 1))))]  # noqa: E731
    return {"median_ms": statistics.median(s), "mean_ms": statistics.fmean(s), "p10_ms": q(0.1), "p90_ms": q(0.9),
            "n": len(s)}


def gpu_busy_ms(engine, prompt: list[int]) -> float:
    """Sum of the kernel durations of one request (profiler, CUDA activity only, instrument off)."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate(prompt, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt, 1)
        torch.cuda.synchronize()
    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("dsv32ref::", "eager::"))
               ) / 1e3


def _check_args(**kw) -> None:
    for name, values in kw.items():
        if not isinstance(values, (list, tuple)) or not values or not all(is_int(v) and v >= 1 for v in values):
            raise ValueError(f"regimes.run: {name} must be a non-empty list of ints >= 1, got {values!r}")


def run(preset: str = "glm-5.2", variants=("wide", "narrow", "narrow_out", "none"),
        prompt_lens=(8, 64, 256, 512, 1024, 4096), ttft_requests: int = 8, batches=(1, 8, 32, 64),
        contexts=(1024, 8192), decode_steps: int = 8, out: str | None = None, device: str = "cuda",
        config=None, seed: int = 0, capture_sizes=None) -> dict:
    """The map (see the module docstring); `device="cpu"` with a tiny `config` runs the control flow on emulated
    graphs (timings meaningless)."""
    from dsv32ref.cache import PagedKVCache
    from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput, build_model
    from dsv32ref.experiments.ttft import REDUCTION, reduced_config
    from dsv32ref.graphs import CUDAGraphMode
    from dsv32ref.provenance import provenance

    _check_args(prompt_lens=list(prompt_lens), batches=list(batches), contexts=list(contexts),
                counts=[ttft_requests, decode_steps])
    unknown = [v for v in variants if v not in BOUNDARIES]
    if unknown:
        raise ValueError(f"regimes.run: unknown variant(s) {unknown}; expected some of {BOUNDARIES}")
    cuda = device == "cuda"
    config = config or reduced_config(preset)
    sizes = list(capture_sizes or CAPTURE_SIZES)
    max_len = max(max(prompt_lens), max(contexts) + decode_steps + 2)
    seqs = max(batches)
    block = 64
    t0 = time.time()
    model = build_model(config, variants[0], device, torch.bfloat16 if cuda else torch.float32, seed)
    blocks = seqs * -(-max_len // block) + 1
    cache = PagedKVCache(config, blocks, block, model.lm_head.dtype, device)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(seed)
        for t in cache.latent + [t for t in cache.indexer_k if t is not None]:
            t.normal_(generator=g)
    result = {"provenance": provenance(), "preset": preset, "reduction": REDUCTION, "protocol": {
        "variants": list(variants), "capture_sizes": sizes, "mode": "full_and_piecewise", "prompt_lens": list(prompt_lens),
        "ttft_requests": ttft_requests, "batches": list(batches), "contexts": list(contexts),
        "decode_steps": decode_steps, "max_model_len": max_len, "block_size": block, "kv_cache_gib": cache.nbytes() / 2**30,
        "order": "interleaved: request i (or decode batch i) runs on every variant in turn, rotating the order",
        "decode_cache": "allocated, random values, not prefilled"}, "prefill": {}, "decode": {}}
    engines = {}
    for v in variants:
        ec = EngineConfig(boundary=v, mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_model_len=max_len, max_num_seqs=seqs,
                          max_num_batched_tokens=max(prompt_lens), capture_sizes=sizes, block_size=block, seed=seed)
        eng = LLMEngine(config, ec, device=device, dtype=model.lm_head.dtype, model=model, kv_cache=cache)
        engines[v] = eng
        eng.capture()
        print(f"  {v:<12} captured ({time.time() - t0:.0f} s)", flush=True)
    result["scores_workspace_bytes"] = {v: e.memory["scores_workspace"] for v, e in engines.items()}
    gen = torch.Generator().manual_seed(seed)
    order = list(variants)

    # ---- prefill: TTFT against prompt length --------------------------------------------------------------
    total = len(prompt_lens) * (ttft_requests + 1)
    done = 0
    for L in prompt_lens:
        prompts = torch.randint(0, config.vocab_size, (ttft_requests + 1, L), generator=gen).tolist()
        times = {v: [] for v in variants}
        for i, p in enumerate(prompts):
            for k in range(len(order)):
                v = order[(i + k) % len(order)]
                _, t = engines[v].generate(p, 1)
                if i:  # the first request of each length is a warm-up
                    times[v].append(t * 1e3)
            done += 1
            progress(done, total, "prefill TTFT, all variants")
        row = {}
        for v in variants:
            how = engines[v].runner.lookup(L, False)[0]
            floor = gpu_busy_ms(engines[v], prompts[0]) if cuda else None
            st = _median_spread(times[v])
            row[v] = {**st, "runs_as": how, "floor_ms": floor,
                      "over_floor": st["mean_ms"] / floor if floor else None, "ttft_ms": times[v]}
        result["prefill"][str(L)] = row
        if out:
            write_partial(out, result)

    # ---- decode: TPOT per batch and context, FULL vs PIECEWISE ---------------------------------------------
    total = len(contexts) * len(batches)
    done = 0
    for C in contexts:
        for B in batches:
            tok = torch.randint(0, config.vocab_size, (B,), generator=gen).tolist()
            row = {}
            for phase in ("FULL", "PIECEWISE"):
                mode = CUDAGraphMode.FULL_AND_PIECEWISE if phase == "FULL" else CUDAGraphMode.PIECEWISE
                runnable = [v for v in order if phase == "FULL" or not engines[v].ec.graph_safe_prefill]
                times = {v: [] for v in runnable}
                stage = {v: [] for v in runnable}
                hows = {}
                for i in range(decode_steps + 1):
                    for k in range(len(runnable)):
                        v = runnable[(i + k) % len(runnable)]
                        eng = engines[v]
                        eng.runner.mode = mode
                        step = StepInput([(b, [tok[b]], C + i) for b in range(B)])
                        with torch.no_grad():
                            t1 = time.perf_counter()
                            prep = eng.stage(step)  # host: blocks, metadata (grows with the context)
                            t2 = time.perf_counter()
                            eng.upload()
                            how, hidden = eng.execute(prep)
                            eng.sample(prep, hidden)
                            t3 = time.perf_counter()
                        for b in range(B):  # the next variant's engine reuses the blocks
                            eng.allocator.release(b)
                        eng.runner.mode = CUDAGraphMode.FULL_AND_PIECEWISE
                        hows[v] = how
                        if i:
                            times[v].append((t3 - t1) * 1e3)
                            stage[v].append((t2 - t1) * 1e3)
                for v in runnable:
                    row.setdefault(v, {})[phase] = {**_median_spread(times[v]), "runs_as": hows[v],
                                                    "stage_median_ms": statistics.median(stage[v]),
                                                    "tpot_ms": times[v]}
            for v in order:
                if engines[v].ec.graph_safe_prefill:
                    row[v]["PIECEWISE"] = None  # no eager break: its FULL graphs are its only graphs
            result["decode"].setdefault(str(C), {})[str(B)] = row
            done += 1
            progress(done, total, "decode TPOT, all variants")
            if out:
                write_partial(out, result)
    for eng in engines.values():
        eng.release_graphs()
    result["wall_s"] = time.time() - t0
    if out:
        write_result(out, result)
    return result
