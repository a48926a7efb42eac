"""Predict, on a CPU, the launch ledger of one 8-token prefill of each eager-boundary variant.

The engine model is built with the preset's layer structure (layer count, IndexShare schedule, dense and
MoE layers, head counts, top-k) at tiny widths: launch counts do not depend on widths, only on structure
and on the shape-dependent kernel choices (sparse_mla's split assumes the H200's 132 SMs). Triton kernels
are recorded, not run (see dsv32ref.engine.ledger.predict).
"""

from __future__ import annotations

import json
import os
import time

import torch

from dsv32ref.experiments.ttft import reduced_config


def structure_config(preset: str):
    """The preset's structure at tiny widths (heads, indexer heads and top-k kept: they decide launches)."""
    return reduced_config(preset).replace(
        hidden_size=64, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        index_head_dim=16, intermediate_size=64, moe_intermediate_size=32, vocab_size=128)


def predict_all(preset: str = "glm-5.2", prompt_len: int = 8, variants=None, out: str | None = None) -> dict:
    from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput
    from dsv32ref.engine.ledger import predict
    from dsv32ref.graphs import CUDAGraphMode
    from dsv32ref.provenance import provenance

    config = structure_config(preset)
    result = {"provenance": provenance(), "preset": preset, "prompt_len": prompt_len, "assumed_sms": 132,
              "note": "counts of launching aten ops and Triton launches; one aten op is predicted as one kernel",
              "variants": {}}
    for v in variants or BOUNDARIES:
        t0 = time.time()
        eng = LLMEngine(config, EngineConfig(boundary=v, mode=CUDAGraphMode.NONE, max_model_len=64, max_num_seqs=2,
                                             max_num_batched_tokens=16, block_size=16, capture_sizes=[8, 16]),
                        device="cpu", dtype=torch.bfloat16)  # bf16 as on the GPU: dtype casts are launches too
        L = predict(eng, StepInput([(0, list(range(1, prompt_len + 1)), 0)]))
        ops = {}
        for (region, op, direct), n in sorted(L.ops.items()):
            ops.setdefault(region, {}).setdefault("direct" if direct else "graph", {})[op] = n
        result["variants"][v] = {"direct": dict(L.direct), "direct_total": sum(L.direct.values()),
                                 "memcpy": dict(L.memcpy),
                                 "in_graph": dict(L.in_graph), "graph_launches": L.graph_launches, "ops": ops}
        print(f"  {v:<12} direct {sum(L.direct.values())}, graph launches {L.graph_launches} "
              f"({time.time() - t0:.0f} s)", flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result
