"""Sparse MLA attention over top-k token indices, with FlashMLA's semantics; and its dense twin.

Absorbed (MQA) form: one shared latent "head" per token, kv = [c_kv | k_pe] (d_qk = 576), V = c_kv
(the first d_v = 512 values of the same row). For query t and head h:
    score[t, h, j] = sm_scale * q[t, h] . kv[indices[t, j]]
    out[t, h]      = sum_j softmax_j(score) kv[indices[t, j], :d_v]
    lse[t, h]      = logsumexp_j(score)                     (natural log)
An index < 0 or >= len(kv) is invalid and scores -inf. A query with no valid index gets out = 0 and
lse = +inf (FlashMLA's convention). The softmax scale must be passed: FlashMLA's sparse prefill call
requires it, and its decode call defaults to d_qk^-1/2, which is not the model's tau.

What reaches the result, exactly:
- only the selected rows: a key that is not selected (index -1, >= len(kv), masked out, or simply not
  among the indices) contributes nothing whatever its values, NaN and inf included; no row outside the
  selection is read into the arithmetic;
- scores follow the IEEE softmax: a NaN or +inf score at a valid key (a non-finite value in the query
  row, or in a selected key row) makes that (token, head)'s out and lse NaN; a -inf score counts as no
  key. `sparse_mla_paged` (the Triton kernel) gives the same.
"""

from __future__ import annotations

import torch

from dsv32ref.checks import check_compute_scale, check_tensor, is_int


def _check(q: torch.Tensor, kv: torch.Tensor, d_v: int, sm_scale: float) -> None:
    check_tensor("q", q, shape=(None, None, None), dtype=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
    check_tensor("kv", kv, shape=(None, q.shape[-1]), dtype=q.dtype, device=q.device)
    if not is_int(d_v) or not 0 < d_v <= kv.shape[-1]:
        raise ValueError(f"d_v: expected an int in 1..{kv.shape[-1]}, got {d_v!r}")
    check_compute_scale("sm_scale", sm_scale, q.dtype)


def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, d_qk], kv [S, d_qk], indices int32 [n, k] -> (out [n, H, d_v] in q.dtype, lse [n, H] fp32+).

    Duplicate valid indices count once per occurrence, as in the kernel.
    """
    _check(q, kv, d_v, sm_scale)
    check_tensor("indices", indices, shape=(q.shape[0], None), dtype=torch.int32, device=q.device)
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = (indices >= 0) & (indices < kv.shape[0])  # (n, k)
    if kv.shape[0]:
        rows = kv[indices.long().clamp(0, kv.shape[0] - 1)].to(acc)  # (n, k, d_qk) gathered
        rows = torch.where(valid[..., None], rows, 0.0)  # an invalid index reads nothing (not even NaN)
    else:
        rows = kv.new_zeros(indices.shape + (kv.shape[-1],), dtype=acc)
    scores = torch.einsum("nhd,nkd->nhk", q.to(acc), rows) * sm_scale  # (n, H, k)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs, lse = _softmax_lse(scores)  # (n, H, k), (n, H)
    out = torch.einsum("nhk,nkv->nhv", probs, rows[..., :d_v])
    out, lse = _non_finite_rows(out, lse, scores)
    return out.to(q.dtype), lse


def _softmax_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax and natural-log logsumexp over the last dim; a row of only -inf gets probs 0 and lse +inf."""
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is valid
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])  # exp(-inf) = 0 on empty rows
    return probs, torch.where(empty, float("inf"), lse)


def _non_finite_rows(out: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with NaN at every (token, head) that has a NaN or +inf score at a valid key."""
    bad = (torch.isnan(scores) | torch.isposinf(scores)).any(dim=-1)  # (n, H)
    return out.masked_fill(bad[..., None], float("nan")), lse.masked_fill(bad, float("nan"))


def dense_mla(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention over every key, with a boolean mask [n, S] (True = attend).

    Independent of `sparse_mla`'s gather: used to check it with a mask built from the same indices.
    """
    _check(q, kv, d_v, sm_scale)
    check_tensor("mask", mask, shape=(q.shape[0], kv.shape[0]), dtype=torch.bool, device=q.device)
    acc = torch.promote_types(q.dtype, torch.float32)
    kv_acc = kv.to(acc)
    keep = mask[:, None, :]  # (n, 1, S)
    # q . kv over masked-out keys may be NaN (a non-finite row nobody selected): replaced, never used.
    scores = torch.einsum("nhd,sd->nhs", q.to(acc), kv_acc) * sm_scale
    scores = torch.where(keep, scores, float("-inf"))
    probs, lse = _softmax_lse(scores)  # (n, H, S)
    # P V with each query's masked-out rows zeroed, so that 0 x NaN never happens: (n, S, d_v) per chunk
    out = torch.empty(q.shape[0], q.shape[1], d_v, dtype=acc, device=q.device)
    step = max(1, 2**24 // max(1, kv.shape[0] * d_v))
    for i in range(0, q.shape[0], step):
        v = torch.where(mask[i: i + step, :, None], kv_acc[None, :, :d_v], 0.0)  # (chunk, S, d_v)
        out[i: i + step] = torch.einsum("nhs,nsv->nhv", probs[i: i + step], v)
    out, lse = _non_finite_rows(out, lse, scores)
    return out.to(q.dtype), lse
