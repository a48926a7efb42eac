"""The regime map: where narrowing the eager break matters, on one GPU, every variant interleaved in one process.

    prefill   TTFT against prompt length (one request at a time, one output token), with each variant's
              GPU-busy floor at that length and the indexer's and sparse MLA's kernel time in it. Capture sizes
              stop at 512 tokens, so longer prompts run with no graph at all: the point where prefill leaves the
              graphs; prompts longer than the token budget prefill in chunks of it (chunked prefill).
    decode    time per output token (TPOT) of a batch of B requests at context C: one uniform-decode step,
              FULL graphs against PIECEWISE ones (the eager regions replayed between graph segments), and on a
              GPU the kernel time of one FULL step, the indexer's and sparse MLA's in it. Only the (C, B) whose
              B (C + decode_steps + 2) tokens fit `kv_tokens` run (one GPU holds every layer's latent cache:
              GLM-5.2 keeps about 95 KB a token); the others are listed as skipped.

The engines are sized for the longest context (max_model_len), as a serving engine configured for it is: the
graph-safe decode's score width and top-k follow max_model_len at every context.

Every variant has its own engine over one copy of the weights and one KV cache (shared blocks: the engines run
one after another and release their sequences). Decode contexts are not prefilled (64 requests of 8k tokens
would take minutes): their blocks are allocated and the cache holds random values, which changes no kernel's
work except the top-k's data-dependent selection, drawn from the same distribution for every variant. The MoE
is reduced (dsv32ref.config.REDUCED_MOE).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from dsv32ref.cache import PagedKVCache
from dsv32ref.checks import is_int
from dsv32ref.config import REDUCED_MOE, reduced_moe
from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput, build_model
from dsv32ref.experiments.ledger import idle_time_us, span_us
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.provenance import provenance
from dsv32ref.results import progress, write_partial, write_result

__all__ = ["RegimeProtocol", "gpu_busy_ms", "gpu_time", "run"]

# Kernel families by name (Triton kernels' function names; the rest is GEMMs, norms, the MoE, ...)
INDEXER_KERNELS = ("_indexer_scores_kernel", "_topk")
SPARSE_MLA_KERNELS = ("_sparse_mla", "_combine_splits_kernel")


@dataclass(frozen=True)
class RegimeProtocol:
    preset: str = "glm-5.2"
    variants: tuple[str, ...] = ("wide", "narrow", "narrow_out", "none")
    prompt_lens: tuple[int, ...] = (8, 64, 256, 512, 1024, 4096, 16384, 32768)
    ttft_requests: int = 8
    long_requests: int = 2  # prompts longer than the token budget: fewer requests (a 32k prefill takes seconds)
    token_budget: int = 8192  # max_num_batched_tokens: longer prompts prefill in chunks of it
    kv_tokens: int = 600_000  # the KV cache's tokens: decode cases needing more are skipped
    batches: tuple[int, ...] = (1, 8, 32, 64)
    contexts: tuple[int, ...] = (1024, 8192, 32768, 131072)
    decode_steps: int = 8
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    block_size: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt_lens", "batches", "contexts", "capture_sizes"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not values or not all(is_int(v) and v >= 1 for v in values):
                raise ValueError(f"RegimeProtocol.{name}: expected a non-empty list of ints >= 1, got {values!r}")
        for name in ("ttft_requests", "long_requests", "token_budget", "kv_tokens", "decode_steps", "block_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"RegimeProtocol.{name}: expected an int >= 1, got {getattr(self, name)!r}")
        unknown = [v for v in self.variants if v not in BOUNDARIES]
        if unknown or not self.variants:
            raise ValueError(f"RegimeProtocol.variants: unknown variant(s) {unknown}; expected some of {BOUNDARIES}")

    def decode_cases(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """((C, B) that fit kv_tokens, (C, B) that do not), contexts then batches in order."""
        cases = [(C, B) for C in self.contexts for B in self.batches]
        fits = [c for c in cases if c[1] * (c[0] + self.decode_steps + 2) <= self.kv_tokens]
        return fits, [c for c in cases if c not in fits]

    def kv_blocks(self) -> int:
        """Blocks of the shared KV cache: the largest decode case kept, or one longest prompt, plus one."""
        per = lambda n: -(-n // self.block_size)  # noqa: E731
        fits = self.decode_cases()[0]
        return max([per(max(self.prompt_lens))] + [B * per(C + self.decode_steps + 2) for C, B in fits]) + 1

    @property
    def max_model_len(self) -> int:
        return max(max(self.prompt_lens), max(self.contexts) + self.decode_steps + 2)

    def engine_config(self, boundary: str) -> EngineConfig:
        return EngineConfig(boundary=boundary, mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_model_len=self.max_model_len,
                            max_num_seqs=max(self.batches),
                            max_num_batched_tokens=max(min(max(self.prompt_lens), self.token_budget),
                                                       max(self.batches)),  # a decode step holds a token a request
                            capture_sizes=list(self.capture_sizes), block_size=self.block_size, seed=self.seed)


def _median_spread(ms: list[float]) -> dict:
    s = sorted(ms)
    q = lambda f: s[min(len(s) - 1, int(round(f * (len(s) - 1))))]  # noqa: E731
    return {"median_ms": statistics.median(s), "mean_ms": statistics.fmean(s), "p10_ms": q(0.1), "p90_ms": q(0.9),
            "n": len(s)}


def gpu_time(fn) -> dict:
    """Kernel time of one call of fn (after one unprofiled call; profiler, CUDA activity only, instrument off),
    kernels launched from graphs included: busy_ms, the sum of the kernel durations (the TTFT run's floor);
    indexer_ms and sparse_mla_ms, the time kernels of INDEXER_KERNELS (the scores and the top-k, not the indexer's
    projections, its queries' or keys' kernels, nor a short prompt's PyTorch top-k) and of SPARSE_MLA_KERNELS run:
    the union of their intervals, since a top-k kernel launched with programmatic dependent launch starts while
    the one before it still runs."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("dsv32ref::", "eager::"))]

    def running_ms(names) -> float:
        iv = [(e.time_range.start, e.time_range.end) for e in kernels if e.name.startswith(names)]
        return (span_us(iv) - idle_time_us(iv)) / 1e3
    return {"busy_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3, "indexer_ms": running_ms(INDEXER_KERNELS),
            "sparse_mla_ms": running_ms(SPARSE_MLA_KERNELS)}


def gpu_busy_ms(engine: LLMEngine, prompt: list[int]) -> float:
    """Sum of the kernel durations of one request (gpu_time's busy_ms)."""
    return gpu_time(lambda: engine.generate(prompt, 1))["busy_ms"]


def _engines(config, p: RegimeProtocol, device: str, t0: float) -> tuple[dict, PagedKVCache]:
    weights = build_model(config, p.variants[0], device, torch.bfloat16 if device == "cuda" else torch.float32,
                          p.seed)
    cache = PagedKVCache(config, p.kv_blocks(), p.block_size, weights.lm_head.dtype, device)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(p.seed)
        for t in cache.latent + [t for t in cache.indexer_k if t is not None]:
            t.normal_(generator=g)
    engines = {}
    for v in p.variants:
        engines[v] = LLMEngine(config, p.engine_config(v), device=device, dtype=weights.lm_head.dtype,
                               weights=weights, kv_cache=cache)
        engines[v].capture()
        print(f"  {v:<12} captured ({time.time() - t0:.0f} s)", flush=True)
    return engines, cache


def _prefill(engines: dict, p: RegimeProtocol, L: int, gen, vocab: int, cuda: bool) -> dict:
    """TTFT of `ttft_requests` prompts of L tokens on every variant, interleaved (one warm-up first)."""
    n = p.ttft_requests if L <= p.token_budget else p.long_requests
    prompts = torch.randint(0, vocab, (n + 1, L), generator=gen).tolist()
    order, times = list(engines), {v: [] for v in engines}
    for i, prompt in enumerate(prompts):
        for k in range(len(order)):
            v = order[(i + k) % len(order)]
            _, t = engines[v].generate(prompt, 1)
            if i:  # the first request of each length is a warm-up
                times[v].append(t * 1e3)
    row = {}
    for v, eng in engines.items():
        gpu = gpu_time(lambda: eng.generate(prompts[0], 1)) if cuda else {}
        floor, st = gpu.get("busy_ms"), _median_spread(times[v])
        chunk = min(L, eng.ec.max_num_batched_tokens)
        row[v] = {**st, "runs_as": eng.runner.graphs.lookup(chunk, False)[0], "chunks": -(-L // chunk),
                  "floor_ms": floor, "over_floor": st["mean_ms"] / floor if floor else None,
                  "indexer_ms": gpu.get("indexer_ms"), "sparse_mla_ms": gpu.get("sparse_mla_ms"), "ttft_ms": times[v]}
    return row


def _decode_step(eng: LLMEngine, mode: CUDAGraphMode, B: int, C: int, tok: list[int]) -> tuple[str, float, float]:
    """One uniform-decode step of B requests at context C in `mode`: (how it ran, step ms, stage ms)."""
    step = StepInput([(b, [tok[b]], C) for b in range(B)])
    try:
        for b in range(B):  # contexts not prefilled: decode reads the cache's values as they are
            eng.allocator.assume(b, C)
        with eng.runner.graphs.using_mode(mode), torch.no_grad():
            t1 = time.perf_counter()
            prep = eng.stage(step)  # host: blocks, metadata (grows with the context)
            t2 = time.perf_counter()
            eng.upload()
            how, hidden = eng.execute(prep)
            eng.sample(prep, hidden)
            t3 = time.perf_counter()
    finally:
        for b in range(B):  # the next variant's engine reuses the blocks (engines on one cache take turns)
            eng.allocator.release(b)
    return how, (t3 - t1) * 1e3, (t2 - t1) * 1e3


def _decode(engines: dict, p: RegimeProtocol, B: int, C: int, tok: list[int]) -> dict:
    """TPOT of B requests at context C, FULL graphs against PIECEWISE ones, every variant interleaved."""
    row = {}
    for phase, mode in (("FULL", CUDAGraphMode.FULL_AND_PIECEWISE), ("PIECEWISE", CUDAGraphMode.PIECEWISE)):
        runnable = [v for v in engines if phase == "FULL" or not engines[v].ec.spec.graph_safe_prefill]
        times, stage, hows = {v: [] for v in runnable}, {v: [] for v in runnable}, {}
        for i in range(p.decode_steps + 1):
            for k in range(len(runnable)):
                v = runnable[(i + k) % len(runnable)]
                hows[v], ms, stage_ms = _decode_step(engines[v], mode, B, C + i, tok)
                if i:
                    times[v].append(ms)
                    stage[v].append(stage_ms)
        for v in runnable:
            row.setdefault(v, {})[phase] = {**_median_spread(times[v]), "runs_as": hows[v],
                                            "stage_median_ms": statistics.median(stage[v]), "tpot_ms": times[v]}
    for v, eng in engines.items():  # on a GPU: one more FULL step, profiled (after the timed ones)
        if eng.device.type == "cuda":
            row[v]["FULL"]["gpu"] = gpu_time(lambda: _decode_step(eng, CUDAGraphMode.FULL_AND_PIECEWISE, B, C, tok))
    for v, eng in engines.items():
        if eng.ec.spec.graph_safe_prefill:
            row[v]["PIECEWISE"] = None  # no eager break: its FULL graphs are its only graphs
    return row


def run(p: RegimeProtocol = RegimeProtocol(), out: str | None = None, device: str = "cuda", config=None) -> dict:
    """The map (see the module docstring); `device="cpu"` with a tiny `config` runs the control flow on emulated
    graphs (timings meaningless)."""
    cuda, t0 = device == "cuda", time.time()
    config = config or reduced_moe(p.preset)
    engines, cache = _engines(config, p, device, t0)
    result = {"provenance": provenance(), "preset": p.preset, "reduction": REDUCED_MOE, "protocol": {
        "variants": list(p.variants), "capture_sizes": list(p.capture_sizes), "mode": "full_and_piecewise",
        "prompt_lens": list(p.prompt_lens), "ttft_requests": p.ttft_requests, "long_requests": p.long_requests,
        "token_budget": p.token_budget, "batches": list(p.batches),
        "contexts": list(p.contexts), "decode_steps": p.decode_steps, "max_model_len": p.max_model_len,
        "block_size": p.block_size, "kv_cache_gib": cache.nbytes() / 2**30,
        "order": "interleaved: request i (or decode batch i) runs on every variant in turn, rotating the order",
        "decode_cache": "allocated, random values, not prefilled"}, "prefill": {}, "decode": {},
        "scores_workspace_bytes": {v: e.runner.memory["scores_workspace"] for v, e in engines.items()}}
    gen = torch.Generator().manual_seed(p.seed)
    for i, L in enumerate(p.prompt_lens):
        result["prefill"][str(L)] = _prefill(engines, p, L, gen, config.vocab_size, cuda)
        progress(i + 1, len(p.prompt_lens), "prefill TTFT, all variants")
        if out:
            write_partial(out, result)
    cases, result["decode_skipped"] = p.decode_cases()
    for i, (C, B) in enumerate(cases):
        tok = torch.randint(0, config.vocab_size, (B,), generator=gen).tolist()
        result["decode"].setdefault(str(C), {})[str(B)] = _decode(engines, p, B, C, tok)
        progress(i + 1, len(cases), "decode TPOT, all variants")
        if out:
            write_partial(out, result)
    for eng in engines.values():
        eng.release_graphs()
    result["wall_s"] = time.time() - t0
    if out:
        write_result(out, result)
    return result
