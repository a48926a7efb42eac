"""What a forward pass selects and attends to: used to check that dummy weights are not degenerate."""

from __future__ import annotations

import math

import torch

from dsv32ref.checks import check_tensor
from dsv32ref.reference.model import DeepseekV32ForCausalLM


@torch.no_grad()
def attention_stats(model: DeepseekV32ForCausalLM, input_ids: torch.Tensor) -> list[dict]:
    """One sequence through the model; per layer, over query tokens that see more than index_topk keys:

    entropy_ratio   mean softmax entropy over the selected keys / log(#selected)  (1 = uniform)
    max_prob        mean of the largest attention probability                      (1 = one-hot)
    recent_overlap  mean |top-k ∩ the k most recent positions| / k                 (1 = a sliding window)
    distinct_sets   fraction of such queries whose top-k set no other query shares
    """
    if not isinstance(model, DeepseekV32ForCausalLM):
        raise ValueError(f"attention_stats: model: expected a DeepseekV32ForCausalLM, got {type(model).__name__}")
    k = model.config.index_topk
    check_tensor("attention_stats: input_ids", input_ids, shape=(None,))
    if input_ids.shape[0] <= k:  # every statistic is a mean over those queries
        raise ValueError(f"attention_stats: input_ids: expected more than index_topk={k} tokens (the statistics are "
                         f"over queries that see more keys than the top-k), got {input_ids.shape[0]}")
    layers = model.model.layers
    inputs: list[tuple] = []
    hooks = [l.self_attn.register_forward_pre_hook(lambda m, args: inputs.append(args)) for l in layers]
    topk_out: list[torch.Tensor] = []
    try:
        model(input_ids, topk_out=topk_out)
    finally:
        for h in hooks:
            h.remove()
    stats = []
    for i, (layer, (x, cos, sin, *_), topk) in enumerate(zip(layers, inputs, topk_out)):
        attn = layer.self_attn
        _, q_nope, q_pe, c_kv, k_pe = attn.project(x, cos, sin)
        q = torch.cat((torch.einsum("thd,hdc->thc", q_nope, attn.W_UK), q_pe), -1).double()  # (T, H, 576)
        kv = torch.cat((c_kv, k_pe), -1).double()  # (T, 576): one sequence, positions 0..T-1
        rows = [t for t in range(x.shape[0]) if t + 1 > k]
        ent, pmax, recent = [], [], []
        for t in rows:
            sel = topk[t].long()
            p = torch.softmax(q[t] @ kv[sel].T * attn.softmax_scale, dim=-1)  # (H, k)
            ent.append((-(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(k)).mean().item())
            pmax.append(p.max(-1).values.mean().item())
            recent.append(len(set(sel.tolist()) & set(range(t - k + 1, t + 1))) / k)
        sets = [tuple(sorted(topk[t].tolist())) for t in rows]
        stats.append({
            "layer": i, "runs_indexer": attn.indexer is not None,
            "entropy_ratio": sum(ent) / len(ent), "max_prob": sum(pmax) / len(pmax),
            "recent_overlap": sum(recent) / len(recent),
            "distinct_sets": sum(sets.count(s) == 1 for s in sets) / len(sets),
        })
    return stats
