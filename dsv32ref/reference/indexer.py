"""The DSA lightning indexer: a cheap multi-head ReLU score that picks each query's top-k keys.

    q^I = W^I_qb c_q  -> [index_n_heads, index_head_dim], split [rope | nope] (rope FIRST, unlike MLA)
    k^I = LayerNorm(W^I_k x) -> [index_head_dim] (one head shared by all indexer heads)
    w   = weights_proj(x) * index_n_heads^-1/2                       (fp32)
    I[t, s] = sum_h w[t, h] * ReLU(q^I[t, h] . k^I[s] * index_head_dim^-1/2)

Prefill masks s > position(t) with -inf before the top-k; top-k keeps min(index_topk, #visible)
positions, the rest of the fixed-width [T, index_topk] row is -1.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dsv32ref.checks import check_compute_scale, check_fits, check_tensor, is_int
from dsv32ref.config import ModelConfig
from dsv32ref.reference.norms import LayerNorm
from dsv32ref.reference.numerics import MAX_HADAMARD, QUANT_BLOCK, fp8_round_trip, hadamard_transform
from dsv32ref.reference.rope import apply_rope

_SCORE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)  # what indexer_scores multiplies


class Indexer(nn.Module):
    """Parameters named as in the checkpoints: wq_b, wk, k_norm (weight + bias), weights_proj."""

    def __init__(self, config: ModelConfig, deployed_numerics: bool = False):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.interleaved = config.indexer_rope_interleave
        self.deployed_numerics = deployed_numerics
        d = self.head_dim
        if deployed_numerics and (d & (d - 1) or d > MAX_HADAMARD):  # refused here, not at the first forward
            raise ValueError(f"Indexer: deployed_numerics rotates q and k by a Hadamard transform: index_head_dim "
                             f"must be a power of two <= {MAX_HADAMARD}, got {d}")
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)  # kept bf16, run in fp32
        self.softmax_scale = self.head_dim ** -0.5

    def _rope_then_quant(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: bool,
                         round_trip: bool) -> torch.Tensor:
        rope, nope = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        x = torch.cat((apply_rope(rope, cos, sin, self.interleaved), nope), dim=-1)
        if rotate or self.deployed_numerics:
            x = hadamard_transform(x)
        if round_trip or self.deployed_numerics:
            x = fp8_round_trip(x, block=min(QUANT_BLOCK, self.head_dim))
        return x

    def query(self, q_c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp8_keys: bool = False) -> torch.Tensor:
        """q_c [T, q_lora_rank] -> q^I [T, index_n_heads, index_head_dim], roped. fp8_keys (the keys are kept in
        FP8): rotated and rounded to fp8, one ue8m0 scale per head, as deployed engines score FP8 keys."""
        q = self.wq_b(q_c).view(q_c.shape[0], self.n_heads, self.head_dim)  # (T, H_I, D_I)
        return self._rope_then_quant(q, cos, sin, rotate=fp8_keys, round_trip=fp8_keys)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp8_keys: bool = False) -> torch.Tensor:
        """x [T, hidden] -> k^I [T, index_head_dim]: LayerNorm, then RoPE on the first rope_dim values. fp8_keys:
        rotated too, for the FP8 key cache to quantise (Hadamard: q.k unchanged; notebook 07 shows what it does to
        the rounding)."""
        return self._rope_then_quant(self.k_norm(self.wk(x)), cos, sin, rotate=fp8_keys, round_trip=False)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> w [T, index_n_heads], fp32 (float64 in exact tests), scaled by H_I^-1/2."""
        dt = torch.promote_types(x.dtype, torch.float32)
        return torch.nn.functional.linear(x.to(dt), self.weights_proj.weight.to(dt)) * self.n_heads ** -0.5


def indexer_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """q_idx [n, H_I, D], k_idx [S, D], weights [n, H_I] -> I [n, S] (fp32, or float64 where any input is)."""
    check_tensor("q_idx", q_idx, shape=(None, None, None), dtype=_SCORE_DTYPES)
    check_tensor("k_idx", k_idx, shape=(None, q_idx.shape[-1]), dtype=_SCORE_DTYPES, device=q_idx.device)
    check_tensor("weights", weights, shape=q_idx.shape[:2], dtype=_SCORE_DTYPES, device=q_idx.device)
    dt = functools.reduce(torch.promote_types, (q_idx.dtype, k_idx.dtype, weights.dtype, torch.float32))
    check_compute_scale("indexer_scores: softmax_scale", softmax_scale, dt)
    logits = torch.einsum("nhd,sd->nhs", q_idx.to(dt), k_idx.to(dt)) * softmax_scale  # (n, H_I, S)
    return torch.einsum("nh,nhs->ns", weights.to(dt), torch.relu(logits))


def topk_indices(scores: torch.Tensor, query_positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Causal top-k of scores [n, S]: key s is visible to query t iff s <= query_positions[t].

    Returns int32 [n, topk]: the visible keys with the highest scores, highest first, ties broken by the
    lower position; entries past min(topk, #visible) are -1. A NaN score ranks above every number (torch.sort's
    order, and torch.topk's): a key whose indexer key or weight is NaN is selected first, never dropped. `torch.topk`, which HF transformers' indexer
    uses, breaks exact ties differently; they do happen (every indexer head's ReLU 0 for several keys gives
    them all the score 0), so compare selections with another implementation tie-aware.
    """
    check_tensor("scores", scores, shape=(None, None),
                 dtype=(torch.float64, torch.float32, torch.bfloat16, torch.float16))  # -inf masks invisible keys
    check_tensor("query_positions", query_positions, shape=(scores.shape[0],), device=scores.device,
                 dtype=(torch.int64, torch.int32))
    if not is_int(topk) or not 1 <= topk < 2 ** 31:
        raise ValueError(f"topk: expected an int in [1, 2^31) (int32 columns), got {topk!r}")
    n, s = scores.shape
    # the masked copy, the sort's values and int64 indices, the visibility mask; the picks and the int32 output
    work = n * s * (2 * scores.element_size() + 8 + 1) + 16 * n * min(topk, s) + 4 * n * topk
    check_fits("topk_indices: its work tensors and the int32 output [n, topk]", work, scores.device)
    if query_positions.numel() and int(query_positions.min()) < 0:
        raise ValueError(f"query_positions: expected positions >= 0, got {int(query_positions.min())}")
    if query_positions.numel() and int(query_positions.max()) >= s:
        raise ValueError(f"query_positions: a query at position {int(query_positions.max())} needs more than "
                         f"the {s} keys scored")
    key_pos = torch.arange(s, device=scores.device)
    visible = key_pos[None, :] <= query_positions[:, None]  # (n, S)
    masked = scores.masked_fill(~visible, float("-inf"))
    # A stable descending sort keeps equal scores in position order: a deterministic tie-break.
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :topk]
    n_visible = visible.sum(-1, keepdim=True)  # (n, 1)
    rank = torch.arange(order.shape[1], device=scores.device)[None, :]
    picked = torch.where(rank < n_visible, order, torch.full_like(order, -1))
    out = torch.full((n, topk), -1, dtype=torch.int32, device=scores.device)
    out[:, : picked.shape[1]] = picked.to(torch.int32)
    return out
