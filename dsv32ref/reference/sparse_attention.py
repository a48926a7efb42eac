"""Sparse MLA attention over top-k token indices, with FlashMLA's semantics; and its dense twin.

Absorbed (MQA) form: one shared latent "head" per token, kv = [c_kv | k_pe] (d_qk = 576), V = c_kv
(the first d_v = 512 values of the same row). For query t and head h:
    score[t, h, j] = sm_scale * q[t, h] . kv[indices[t, j]]
    out[t, h]      = sum_j softmax_j(score) kv[indices[t, j], :d_v]
    lse[t, h]      = logsumexp_j(score)                     (natural log)
An index < 0 or >= len(kv) is invalid and scores -inf. A query with no valid index gets out = 0 and
lse = +inf (FlashMLA's convention). The softmax scale must be passed: FlashMLA defaults to d_qk^-1/2,
the model's tau is not that.
"""

from __future__ import annotations

import torch

from dsv32ref.checks import check_tensor


def _check(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> None:
    check_tensor("q", q, shape=(None, None, None), dtype=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
    check_tensor("kv", kv, shape=(None, q.shape[-1]), dtype=q.dtype, device=q.device)
    if not 0 < d_v <= kv.shape[-1]:
        raise ValueError(f"d_v: expected 1..{kv.shape[-1]}, got {d_v}")


def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, d_qk], kv [S, d_qk], indices int32 [n, k] -> (out [n, H, d_v] in q.dtype, lse [n, H] fp32+).

    Duplicate valid indices count once per occurrence, as in the kernel.
    """
    _check(q, kv, d_v)
    check_tensor("indices", indices, shape=(q.shape[0], None), dtype=torch.int32, device=q.device)
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = (indices >= 0) & (indices < kv.shape[0])  # (n, k)
    if kv.shape[0]:
        rows = kv[indices.long().clamp(0, kv.shape[0] - 1)].to(acc)  # (n, k, d_qk) gathered
    else:
        rows = kv.new_zeros(indices.shape + (kv.shape[-1],), dtype=acc)
    scores = torch.einsum("nhd,nkd->nhk", q.to(acc), rows) * sm_scale  # (n, H, k)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (n, H); -inf where nothing is valid
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no valid key -> 0
    out = torch.einsum("nhk,nkv->nhv", probs, rows[..., :d_v])
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out.to(q.dtype), lse


def dense_mla(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention over every key, with a boolean mask [n, S] (True = attend).

    Independent of `sparse_mla`'s gather: used to check it with a mask built from the same indices.
    """
    _check(q, kv, d_v)
    check_tensor("mask", mask, shape=(q.shape[0], kv.shape[0]), dtype=torch.bool, device=q.device)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("nhd,sd->nhs", q.to(acc), kv.to(acc)) * sm_scale
    scores = scores + torch.zeros_like(mask, dtype=acc).masked_fill(~mask, float("-inf"))[:, None, :]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("nhs,sv->nhv", probs, kv[:, :d_v].to(acc))
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out.to(q.dtype), lse
