"""The sparse_mla variants the tile and address sweeps compare (notebook 02): not the library's kernel.

    SLOTS     resolve the top-k to cache rows once per program (the library does); off: the two dependent
              loads (top-k index -> block id) inside the loop, per key, per step
    PREFETCH  load step i + 1's rows (or index -> block chains) during step i (the library does)
    SPLIT_QK  the warpgroups split S's keys (the library does); off: QK^T chained into PV, both warpgroups
              compute all of S
    Q_RELOAD  re-read the query tile every step (the library does); off: hold it in registers (needs
              SPLIT_QK off: triton 3.6's pipeliner fails on a held query beside the split's branch)

One launch, no top-k splits (the sweep's 512-token prefill fills the GPU without them). The math and the
epilogue are the library's (dsv32ref.kernels.sparse_mla); only the loop differs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv32ref.checks import check_keys
from dsv32ref.kernels.sparse_mla import (DEFAULT_CONFIG, _finish, _online_softmax, _program_keys, _resolve_rows,
                                         _step_rows, check_inputs)

__all__ = ["sparse_mla_variant", "VARIANT_KEYS", "LIBRARY"]

VARIANT_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "SLOTS", "PREFETCH", "SPLIT_QK", "Q_RELOAD")
LIBRARY = dict(DEFAULT_CONFIG, SLOTS=True, PREFETCH=True, SPLIT_QK=True, Q_RELOAD=True)  # what the library runs


@triton.jit
def _chained_rows(idx_row_ptr, it, k_end, seq_len, bt_row_ptr, block_size, stride_cb, stride_cs, num_blocks,
                  BLOCK_N: tl.constexpr):
    """Step it's keys, addresses resolved here: top-k index, then block id -> (element offsets int64, valid)."""
    offs = it * BLOCK_N + tl.arange(0, BLOCK_N)
    idx = tl.load(idx_row_ptr + offs, mask=offs < k_end, other=-1)
    valid = (idx >= 0) & (idx < seq_len)
    pos = tl.where(valid, idx, 0)
    blk = tl.load(bt_row_ptr + pos // block_size, mask=valid, other=0)
    valid = valid & (blk >= 0) & (blk < num_blocks)
    return blk.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs, valid


@triton.jit
def _rows(rows_row_ptr, idx_row_ptr, it, k_end, seq_len, bt_row_ptr, block_size, stride_cb, stride_cs, num_blocks,
          BLOCK_N: tl.constexpr, SLOTS: tl.constexpr):
    if SLOTS:
        row, valid = _step_rows(rows_row_ptr, it, k_end, stride_cs, BLOCK_N)
    else:
        row, valid = _chained_rows(idx_row_ptr, it, k_end, seq_len, bt_row_ptr, block_size, stride_cb, stride_cs,
                                   num_blocks, BLOCK_N)
    return row, valid


@triton.jit
def _variant_kernel(
    q_ptr, stride_qt, stride_qh, cache_ptr, stride_cb, stride_cs, block_table_ptr, stride_bt, req_ptr, seq_lens_ptr,
    idx_ptr, stride_it, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, rows_ptr, sm_scale_log2,
    H, K, block_size, rows_per_block, B, max_blocks, num_blocks,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    SLOTS: tl.constexpr, PREFETCH: tl.constexpr, SPLIT_QK: tl.constexpr, Q_RELOAD: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    req, seq_len, k_end, it0, it1 = _program_keys(req_ptr, seq_lens_ptr, t, 0, K, B, max_blocks, block_size,
                                                  BLOCK_N, 1, False)
    idx_row_ptr, bt_row_ptr, rows_row_ptr = idx_ptr + t * stride_it, block_table_ptr + req * stride_bt, rows_ptr + t * K
    if SLOTS:
        _resolve_rows(idx_row_ptr, bt_row_ptr, rows_row_ptr, 0, k_end, seq_len, block_size, rows_per_block,
                      num_blocks)
        tl.debug_barrier()
    offs_lat = tl.arange(0, D_LAT)
    offs_rope = tl.arange(0, D_ROPE)
    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_lat[None, :], mask=h_mask[:, None], other=0.0)
    q_pe = tl.load(q_row + D_LAT + offs_rope[None, :], mask=h_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
    if PREFETCH:
        row, valid = _rows(rows_row_ptr, idx_row_ptr, it0, k_end, seq_len, bt_row_ptr, block_size, stride_cb,
                           stride_cs, num_blocks, BLOCK_N, SLOTS)
    for it in tl.range(it0, it1):
        if PREFETCH:
            row_next, valid_next = _rows(rows_row_ptr, idx_row_ptr, it + 1, k_end, seq_len, bt_row_ptr, block_size,
                                         stride_cb, stride_cs, num_blocks, BLOCK_N, SLOTS)
        else:
            row, valid = _rows(rows_row_ptr, idx_row_ptr, it, k_end, seq_len, bt_row_ptr, block_size, stride_cb,
                               stride_cs, num_blocks, BLOCK_N, SLOTS)
        if Q_RELOAD:
            q_lat = tl.load(q_row + offs_lat[None, :], mask=h_mask[:, None], other=0.0)
            q_pe = tl.load(q_row + D_LAT + offs_rope[None, :], mask=h_mask[:, None], other=0.0)
        k_lat = tl.load(cache_ptr + row[:, None] + offs_lat[None, :], mask=valid[:, None], other=0.0)
        k_pe = tl.load(cache_ptr + row[:, None] + D_LAT + offs_rope[None, :], mask=valid[:, None], other=0.0)
        if SPLIT_QK:  # as the library's _attend
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION) * sm_scale_log2 + \
                tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION) * sm_scale_log2
            if seq_len > 0:
                p, m_new, alpha, l_i = _online_softmax(s, valid, m_i, l_i)
            else:
                p, m_new, alpha, l_i = _online_softmax(s, valid, m_i, l_i)
        else:  # one accumulating dot, chained into PV
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
            s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION)
            p, m_new, alpha, l_i = _online_softmax(s * sm_scale_log2, valid, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        m_i = m_new
        if PREFETCH:
            row, valid = row_next, valid_next
    _finish(acc, m_i, l_i, t, offs_h, h_mask, 0, H, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, D_LAT, 1)


def sparse_mla_variant(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale, out, lse=None,
                       config: dict | None = None):
    """sparse_mla_paged's result (no splits) through the variant `config` (VARIANT_KEYS over LIBRARY)."""
    check_keys("sparse_mla_variant: config", config, VARIANT_KEYS)
    cfg = dict(LIBRARY, **(config or {}))
    if cfg["SPLIT_QK"] and not cfg["Q_RELOAD"]:
        raise ValueError("sparse_mla_variant: SPLIT_QK needs Q_RELOAD (triton 3.6's software pipeliner fails on a "
                         "loop-invariant query tile beside the split's branch)")
    T, H, d_lat, d_rope, B = check_inputs(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale,
                                          out, lse)
    if T == 0:
        return out, lse
    block_h = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(H)))
    lse_arg = lse if lse is not None else torch.empty(T, H, dtype=torch.float32, device=q.device)
    K = topk_indices.shape[1]
    rows = torch.empty(T, K, dtype=torch.int32, device=q.device)
    _variant_kernel[(T, triton.cdiv(H, block_h))](
        q, q.stride(0), q.stride(1), latent_cache, latent_cache.stride(0), latent_cache.stride(1),
        block_table, block_table.stride(0), req_indices, seq_lens, topk_indices, topk_indices.stride(0),
        out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0), rows, sm_scale * math.log2(math.e),
        H, K, latent_cache.shape[1], latent_cache.stride(0) // latent_cache.stride(1),
        B, block_table.shape[1], latent_cache.shape[0],
        D_LAT=d_lat, D_ROPE=d_rope, BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SLOTS=cfg["SLOTS"], PREFETCH=cfg["PREFETCH"],
        SPLIT_QK=cfg["SPLIT_QK"], Q_RELOAD=cfg["Q_RELOAD"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse
