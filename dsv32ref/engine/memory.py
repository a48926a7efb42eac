"""Memory planning at start-up, as the serving engine does it, before any graph is captured:

    1. a profile run: the largest prefill step, eagerly, with a throwaway cache; its peak is the activations'
    2. the graph-memory estimate (vLLM's profile_cudagraph_memory): per mode, capture the two largest sizes into
       a temporary pool, each measured as the drop in free device memory; estimate = max over modes of the first
       capture + sum over modes of the second (at least 1 MiB) x (number of sizes - 1)
    3. the KV cache: total x gpu_memory_utilization - peak - estimate, in blocks, capped at what max_num_seqs
       sequences of max_model_len can use
Whatever the model keeps from 1 and 2 (narrow_copy's static buffers) stays allocated, unbudgeted: that is the
copy variant's start-up failure.
"""

from __future__ import annotations

import torch

from dsv32ref.cache import PagedKVCache, token_bytes
from dsv32ref.config import ModelConfig
from dsv32ref.graphs.breakable import CudaGraphBackend
from dsv32ref.graphs.runner import CUDAGraphMode

__all__ = ["kv_bytes_per_token", "plan_kv_cache"]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Cache bytes one token takes over all layers: its latent row [c_kv | k_pe] in every layer, and its indexer
    key in every layer that runs its indexer (dsv32ref.cache.token_bytes)."""
    latent, key = token_bytes(config, dtype, kv_cache_dtype)
    return sum(latent + (key if config.runs_indexer(i) else 0) for i in range(config.num_hidden_layers))


def plan_kv_cache(runner) -> tuple[int, dict]:
    """(num_blocks, the start-up ledger in bytes) for a ModelRunner whose model and input batch exist."""
    ec = runner.ec
    usable = ec.max_num_seqs * ec.max_blocks_per_seq + 1
    if ec.num_blocks is not None:
        return ec.num_blocks, {}
    if runner.device.type != "cuda":
        return usable, {}
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    profile = _profile_cache(runner)
    with torch.no_grad():
        runner.profile_run(profile)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    estimate, detail = _estimate_graph_memory(runner, profile) if ec.estimate_graph_memory else (0, {})
    del profile
    free, total = torch.cuda.mem_get_info()
    budget = total * ec.gpu_memory_utilization - peak - estimate
    ledger = dict(total=total, weights=weights, profile_peak=peak, peak_activations=peak - weights,
                  graph_estimate=estimate, graph_estimate_detail=detail, budget=budget)
    per_block = ec.block_size * kv_bytes_per_token(runner.config, runner.dtype, ec.kv_cache_dtype)
    num_blocks = min(int(budget // per_block), usable)
    if num_blocks < 1:
        raise RuntimeError(
            f"KV cache: no memory left at gpu_memory_utilization={ec.gpu_memory_utilization} (total "
            f"{total / 2**30:.1f} GiB; weights + peak activations {peak / 2**30:.1f} GiB; graph-memory estimate "
            f"{estimate / 2**30:.1f} GiB; static copy buffers {runner.model.static_outputs.nbytes() / 2**30:.1f} GiB)")
    return num_blocks, ledger


def _profile_cache(runner) -> PagedKVCache:
    """A throwaway cache the largest prefill step fits in."""
    ec = runner.ec
    return PagedKVCache(runner.config, -(-ec.max_num_batched_tokens // ec.block_size) + 1, ec.block_size,
                        runner.dtype, runner.device, ec.kv_cache_dtype)


def _estimate_graph_memory(runner, cache: PagedKVCache) -> tuple[int, dict]:
    """Step 2 of the module docstring, with the profile run's cache; the graphs are released afterwards."""
    if runner.ec.mode is CUDAGraphMode.NONE:
        return 0, {}
    pool = torch.cuda.graph_pool_handle()
    graphs = runner.graph_runner(lambda: CudaGraphBackend(pool), cache)
    first, per_graph, detail = {}, {}, {}
    try:
        for phase, sizes in graphs.phase_sizes():
            if not sizes:  # e.g. FULL when every capture size exceeds max_num_seqs
                continue
            samples = []
            for size in sizes[:2]:
                torch.cuda.synchronize()
                before = torch.cuda.mem_get_info()[0]
                with torch.no_grad():
                    graphs.capture(phase, size)
                torch.cuda.synchronize()
                samples.append(before - torch.cuda.mem_get_info()[0])
            first[phase] = samples[0]
            per_graph[phase] = max(samples[1] if len(samples) > 1 else 0, 2**20) * (len(sizes) - 1)
            detail[phase] = {"sizes": len(sizes), "samples": samples, "per_graph_total": per_graph[phase]}
    finally:
        graphs.release()
        del graphs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return (max(first.values()) + sum(per_graph.values()) if first else 0), detail
