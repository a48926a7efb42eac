"""Sparse MLA attention over top-k indices on the paged latent cache (absorbed MQA form). Graph-safe.

Motivation. After the indexer, each query token attends to index_topk = 2048 of its sequence's tokens.
In the absorbed form all H heads share one latent row per key, [c_kv (D_LAT) | k_pe (D_ROPE)], and V is
c_kv itself: a program loads a tile of gathered latent rows once and uses it for a block of heads, twice
(QK^T, then PV). Nothing on the host depends on the data: the grid is (tokens, head blocks, d_v blocks),
sequence lengths and block tables are read on the device, so the launch can be captured in a CUDA graph.

Work per query token (DeepSeek-V3.2: H = 128, k = 2048, D_LAT = 512, D_ROPE = 64):
    FLOPs  = 2 H k (D_LAT + D_ROPE) [QK] + 2 H k D_LAT [PV]          = 570 MFLOP
    bytes >= k (D_LAT + D_ROPE) * 2 [gathered rows, bf16] + H (D_LAT + D_ROPE + D_LAT) * 2 [q, out]
           = 2.36 MB + 0.28 MB
so about 216 FLOP/byte at H = 128: past the H200's ridge (160-185 FLOP/B measured): compute-bound. At GLM-5.2's
H = 64, half the FLOPs over the same rows: memory-bound if every gathered row comes from HBM (decode batches);
in a long prefill the rows are shared by many tokens and sit in L2, and the compute bound applies.

Addresses. A key's row is block_table[top-k index / BS] * BS + index % BS: two dependent loads. Resolved
inside the loop, each thread chains ~16 of them per step and the compiler serialises them under register
pressure; that, not bandwidth, was the kernel's limit (notebook 02). By default (SLOTS) a prologue resolves
the program's slice of the top-k into an int32 workspace once, and the loop reads it back.

Warps. Two warpgroups of 4 warps share a program: each owns 256 of the 512 output columns in PV, and (with
SPLIT_QK, the default: see DEFAULT_CONFIG) 32 of the 64 keys of a step in QK^T; how Triton is steered into the
second split is written at the kernel's QK^T.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dsv32ref.checks import (check_keys, check_range, check_same_device, check_scale, check_tensor,
                             device_value_checks_on, is_int)

__all__ = ["sparse_mla_paged", "DEFAULT_CONFIG"]


SLOT_CHUNK = tl.constexpr(2048)  # top-k entries resolved to cache rows per step of the SLOTS prologue


@triton.jit
def _key_rows(idx_row_ptr, offs_n, K, seq_len, bt_row_ptr, block_size, stride_cb, stride_cs, num_blocks):
    """Top-k slots offs_n of one token -> (element offsets of their latent rows int64, valid mask). A block id
    outside [0, num_blocks) makes its key invalid (never read)."""
    idx = tl.load(idx_row_ptr + offs_n, mask=offs_n < K, other=-1)
    valid = (idx >= 0) & (idx < seq_len)
    pos = tl.where(valid, idx, 0)
    blk = tl.load(bt_row_ptr + pos // block_size, mask=valid, other=0)
    valid = valid & (blk >= 0) & (blk < num_blocks)
    return blk.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs, valid


@triton.jit
def _slot_rows(slots_row_ptr, offs_n, K, stride_cs):
    """Resolved top-k slots offs_n of one token -> (element offsets of their latent rows int64, valid mask)."""
    slot = tl.load(slots_row_ptr + offs_n, mask=offs_n < K, other=-1)
    return slot.to(tl.int64) * stride_cs, slot >= 0


@triton.jit
def _online_softmax(s, valid, m_i, l_i):
    """One step of the online softmax on scores s in base 2 -> (p, new running max, rescale of the old terms,
    new sum)."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, m_new, alpha, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _sparse_mla_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, H, D_LAT + D_ROPE]
    cache_ptr, stride_cb, stride_cs,  # latent cache [NB, BS, D_LAT + D_ROPE]
    block_table_ptr, stride_bt,  # [B, max_blocks]
    req_ptr, seq_lens_ptr,  # [T], [B]
    idx_ptr, stride_it,  # top-k [T, K] int32 (token positions, -1 = none)
    out_ptr, stride_ot, stride_oh,  # out [T, H, D_LAT]; with splits: partial out fp32 [T, H, NUM_SPLITS, D_LAT]
    lse_ptr, stride_lt,  # lse [T, H] fp32; with splits: partial lse [T, H, NUM_SPLITS]
    slots_ptr,  # with SLOTS: int32 workspace [T, K], each key's row in the flattened cache (-1: skip)
    sm_scale_log2,  # sm_scale * log2(e): softmax in base 2
    H, K, block_size,
    B, max_blocks, num_blocks,  # bounds of req_indices, of a block-table row, of block ids (masked, never read)
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, Q_RELOAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, VALID_FIRST: tl.constexpr, SLOTS: tl.constexpr, PREFETCH: tl.constexpr,
    SPLIT_QK: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if NUM_SPLITS > 1:  # split-K: program_id(2) picks a slice of the top-k (BLOCK_DV == D_LAT)
        split = tl.program_id(2)
        dv0 = 0
    else:
        split = 0
        dv0 = tl.program_id(2) * BLOCK_DV
    h_mask = offs_h < H
    req = tl.load(req_ptr + t)
    # A request index outside [0, B) attends to nothing; a sequence longer than its block-table row (or
    # negative) is cut to what the row can address.
    seq_len = tl.load(seq_lens_ptr + req, mask=(req >= 0) & (req < B), other=0)
    seq_len = tl.maximum(tl.minimum(seq_len, max_blocks * block_size), 0)
    # With VALID_FIRST the caller promises the valid indices come first (the indexer's output): at most
    # seq_len of the K slots need visiting. A short prompt then skips most of the 2048 slots.
    k_end = tl.minimum(K, seq_len) if VALID_FIRST else K
    iters_total = tl.cdiv(k_end, BLOCK_N)
    iters_per_split = tl.cdiv(iters_total, NUM_SPLITS)
    it0 = split * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, iters_total)
    offs_lat = tl.arange(0, D_LAT)
    offs_rope = tl.arange(0, D_ROPE)
    offs_dv = dv0 + tl.arange(0, BLOCK_DV)

    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_lat[None, :], mask=h_mask[:, None], other=0.0)  # (BLOCK_H, D_LAT)
    q_pe = tl.load(q_row + D_LAT + offs_rope[None, :], mask=h_mask[:, None], other=0.0)  # (BLOCK_H, D_ROPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    idx_row_ptr = idx_ptr + t * stride_it
    bt_row_ptr = block_table_ptr + req * stride_bt
    if SLOTS:
        # A key's address takes two dependent loads (top-k index, then block id). Resolve this program's
        # slice of the top-k to flat cache rows once, before the loop, into the workspace: each step then
        # needs one independent, contiguous load before its gather, instead of a chain of two per key.
        # (The head blocks of a token each resolve the same slice and write the same values: two dependent
        # loads per entry once per program, cheaper than coordinating programs.)
        slots_row_ptr = slots_ptr + t * K
        k_stop = tl.minimum(it1 * BLOCK_N, k_end)
        for k0 in tl.range(it0 * BLOCK_N, k_stop, SLOT_CHUNK):
            offs_k = k0 + tl.arange(0, SLOT_CHUNK)
            idx = tl.load(idx_row_ptr + offs_k, mask=offs_k < k_stop, other=-1)
            ok = (idx >= 0) & (idx < seq_len)
            pos = tl.where(ok, idx, 0)
            blk = tl.load(bt_row_ptr + pos // block_size, mask=ok, other=0)
            ok = ok & (blk >= 0) & (blk < num_blocks)
            tl.store(slots_row_ptr + offs_k, tl.where(ok, blk * block_size + pos % block_size, -1), mask=offs_k < k_stop)
        tl.debug_barrier()  # this program's writes are visible to all its threads
        if PREFETCH:
            row, valid = _slot_rows(slots_row_ptr, it0 * BLOCK_N + offs_n, k_end, stride_cs)
    elif PREFETCH:
        row, valid = _key_rows(idx_row_ptr, it0 * BLOCK_N + offs_n, k_end, seq_len, bt_row_ptr, block_size,
                               stride_cb, stride_cs, num_blocks)
    for it in tl.range(it0, it1):
        # Rows of this step's keys; with PREFETCH they were resolved last step, and the next step's are now.
        if SLOTS and PREFETCH:
            row_next, valid_next = _slot_rows(slots_row_ptr, (it + 1) * BLOCK_N + offs_n, k_end, stride_cs)
        elif SLOTS:
            row, valid = _slot_rows(slots_row_ptr, it * BLOCK_N + offs_n, k_end, stride_cs)
        elif PREFETCH:
            row_next, valid_next = _key_rows(idx_row_ptr, (it + 1) * BLOCK_N + offs_n, k_end, seq_len, bt_row_ptr,
                                             block_size, stride_cb, stride_cs, num_blocks)
        else:
            row, valid = _key_rows(idx_row_ptr, it * BLOCK_N + offs_n, k_end, seq_len, bt_row_ptr, block_size,
                                   stride_cb, stride_cs, num_blocks)
        if Q_RELOAD:  # re-read q from L1/L2 each step instead of holding it in registers
            q_lat = tl.load(q_row + offs_lat[None, :], mask=h_mask[:, None], other=0.0)
            q_pe = tl.load(q_row + D_LAT + offs_rope[None, :], mask=h_mask[:, None], other=0.0)
        k_lat = tl.load(cache_ptr + row[:, None] + offs_lat[None, :], mask=valid[:, None], other=0.0)  # (BLOCK_N, D_LAT)
        k_pe = tl.load(cache_ptr + row[:, None] + D_LAT + offs_rope[None, :], mask=valid[:, None], other=0.0)  # (BLOCK_N, D_ROPE)
        if SPLIT_QK:
            # Triton lays out a dot whose result flows into another dot (S -> P -> PV) with every warp along
            # the rows, so that the softmax reductions stay inside a warp. With 64 heads and two warpgroups of
            # 64 rows each, both warpgroups would then compute all of S: twice the QK^T MMAs and shared-memory
            # reads. Here QK^T is two dots that are scaled before they are summed (Triton folds an add of dot
            # results into one accumulating dot), and the softmax runs inside a branch that is always taken
            # (H >= 1): the dataflow search stops at the branch's yield, the QK^T dots count as unchained, and
            # the two warpgroups take 32 keys each. Triton inserts the cross-warpgroup row reductions and passes
            # P to the PV dot through shared memory.
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION) * sm_scale_log2 + \
                tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION) * sm_scale_log2  # (BLOCK_H, BLOCK_N)
            if H > 0:
                p, m_new, alpha, l_i = _online_softmax(s, valid, m_i, l_i)
            else:  # never taken; Triton needs both branches to define the results
                p, m_new, alpha, l_i = _online_softmax(s, valid, m_i, l_i)
        else:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
            s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION)  # (BLOCK_H, BLOCK_N)
            p, m_new, alpha, l_i = _online_softmax(s * sm_scale_log2, valid, m_i, l_i)
        if BLOCK_DV == D_LAT:
            v = k_lat  # V is c_kv: reuse the tile already loaded
        else:
            v = tl.load(cache_ptr + row[:, None] + offs_dv[None, :], mask=valid[:, None], other=0.0)  # (BLOCK_N, BLOCK_DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        if PREFETCH:
            row, valid = row_next, valid_next

    # l_i is 0 exactly when no valid key scored above -inf; NaN when a score was NaN or +inf (a non-finite
    # query or key row), which then reaches out and lse as NaN, as in the reference.
    has_key = l_i != 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453
    if NUM_SPLITS > 1:  # partials in fp32; an empty split has lse -inf (weight 0 in the combine)
        o_ptrs = out_ptr + ((t * H + offs_h[:, None]) * NUM_SPLITS + split) * D_LAT + offs_dv[None, :]
        tl.store(o_ptrs, out, mask=h_mask[:, None])
        tl.store(lse_ptr + (t * H + offs_h) * NUM_SPLITS + split, tl.where(has_key, lse, float("-inf")), mask=h_mask)
    else:
        o_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
        if tl.program_id(2) == 0:
            tl.store(lse_ptr + t * stride_lt + offs_h, tl.where(has_key, lse, float("inf")), mask=h_mask)


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, H,
                           NUM_SPLITS: tl.constexpr, D_LAT: tl.constexpr):
    """out[t, h] = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse); lse = max + log(sum w)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D_LAT)
    lse_s = tl.load(part_lse_ptr + (t * H + h) * NUM_SPLITS + offs_s)  # (S,)
    nan_s = lse_s != lse_s  # a split that saw a NaN / +inf score: the result is NaN
    m = tl.max(tl.where(nan_s, float("-inf"), lse_s), axis=0)
    any_key = (m > float("-inf")) | (tl.max(nan_s.to(tl.int32), axis=0) > 0)
    w = tl.exp(lse_s - tl.where(m > float("-inf"), m, 0.0))  # (S,); 0 for empty splits, NaN for NaN ones
    o_s = tl.load(part_o_ptr + ((t * H + h) * NUM_SPLITS + offs_s[:, None]) * D_LAT + offs_d[None, :])  # (S, D_LAT)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o_s, axis=0) / tl.where(any_key, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + t * stride_lt + h, tl.where(any_key, m + tl.log(tl.where(any_key, total, 1.0)), float("inf")))


# Streaming multiprocessors assumed when the tensors are not on a GPU and the caller names none (interpreter
# runs; the launch-ledger prediction passes the H200's 132 so it splits the work the way the GPU will).
CPU_SMS = 4


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


# Tile configs: BLOCK_H heads x BLOCK_N keys per step, BLOCK_DV output columns per program; num_stages-1 key
# tiles are in flight (cp.async) while one is used. Q_RELOAD re-reads the query tile every step. SLOTS
# resolves the top-k to cache rows once per program (a workspace); PREFETCH loads step i+1's rows during
# step i. SPLIT_QK has the two warpgroups split S's keys instead of each computing all of S. The default
# is the best of the H200 runs: 64 heads x 64 keys per step, all 512 output columns in one program, SLOTS,
# SPLIT_QK and PREFETCH (tile sweep in data/kernels.json at 512 query tokens; the A/B at more shapes in
# data/sparse_mla_split_qk.json). The sweep (notebook 02) shows why: with addresses resolved in the loop,
# each thread chains ~16 index -> block-table loads per step, which the compiler serialises under register
# pressure (prefetching those chains made it worse); with SLOTS the loads are independent and loading the
# next step's rows one step ahead pays; and without SPLIT_QK half of the QK^T MMAs are repeats.
DEFAULT_CONFIG = dict(BLOCK_H=64, BLOCK_N=64, BLOCK_DV=512, num_warps=8, num_stages=2, Q_RELOAD=True,
                      SLOTS=True, PREFETCH=True, SPLIT_QK=True)
CONFIG_KEYS = ("BLOCK_H", "BLOCK_N", "BLOCK_DV", "num_warps", "num_stages", "Q_RELOAD", "SLOTS", "PREFETCH",
               "SPLIT_QK", "NUM_SPLITS")
# fp32 tiles take twice the shared memory: smaller key tiles, no multi-stage buffering.
FP32_CONFIG = dict(BLOCK_H=32, BLOCK_N=16, BLOCK_DV=512, num_warps=4, num_stages=1, Q_RELOAD=False,
                   SLOTS=True, PREFETCH=False, SPLIT_QK=False)


def sparse_mla_paged(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk_indices: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    config: dict | None = None,
    valid_first: bool = False,
    num_sms: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out[t, h] = softmax_j(sm_scale q[t, h] . kv_j) @ c_kv_j over the valid top-k keys of token t.

    q             [T, H, D_LAT + D_ROPE]   bf16 / fp16 / fp32 (the absorbed query [q~ | q_pe])
    latent_cache  [NB, BS, D_LAT + D_ROPE] same dtype, last dim contiguous
    block_table   int32 [B, max_blocks]; req_indices int32 [T]; seq_lens int32 [B]
    topk_indices  int32 [T, K]             token positions in the sequence; < 0 or >= seq_len: skipped
    out           [T, H, D_LAT]            written in place (caller-owned: graph-safe)
    lse           fp32 [T, H] or None      natural-log logsumexp; +inf where no key is valid
    Semantics are the reference's (dsv32ref.reference.sparse_mla): keys not selected are never read; a NaN or
    +inf score at a valid key (a non-finite query or key row) makes that (token, head)'s out and lse NaN.
    D_LAT is taken as out.shape[-1] (kv_lora_rank); both it and D_ROPE must be powers of two.
    valid_first   the valid indices of each row come first (as the indexer writes them): only the first
                  min(K, seq_len) slots are visited. Off by default (FlashMLA accepts any order).
    When T x head blocks leaves SMs idle (decode), the top-k is split across NUM_SPLITS programs
    (config["NUM_SPLITS"], default: the largest power of two that keeps all programs in one wave) and the
    partial results are merged by a second launch; the split count depends only on shapes, so it is fixed
    within a captured graph. `num_sms`: the SMs to fill (default: the device's; 4 for CPU tensors). With SLOTS (the default) each call also allocates an int32 [T, K] workspace.
    """
    T, H, D = check_tensor("q", q, shape=(None, None, None), dtype=(torch.bfloat16, torch.float16, torch.float32),
                           dense_dims=1).shape
    check_keys("sparse_mla_paged: config", config, CONFIG_KEYS)
    cfg = dict(FP32_CONFIG if q.dtype == torch.float32 else DEFAULT_CONFIG, **(config or {}))
    d_lat = check_tensor("out", out, shape=(T, H, None), dtype=q.dtype, dense_dims=1).shape[-1]
    d_rope = D - d_lat
    for name, v in (("kv_lora_rank (out.shape[-1])", d_lat), ("qk_rope_head_dim (q.shape[-1] - out.shape[-1])", d_rope)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"sparse_mla_paged: {name} must be a power of two, got {v}")
    check_tensor("latent_cache", latent_cache, shape=(None, None, D), dtype=q.dtype, dense_dims=1)
    B = check_tensor("seq_lens", seq_lens, shape=(None,), dtype=torch.int32, dense_dims=1).shape[0]
    check_tensor("block_table", block_table, shape=(B, None), dtype=torch.int32, dense_dims=1)
    check_tensor("req_indices", req_indices, shape=(T,), dtype=torch.int32, dense_dims=1)
    check_tensor("topk_indices", topk_indices, shape=(T, None), dtype=torch.int32, dense_dims=1)
    if lse is not None:
        check_tensor("lse", lse, shape=(T, H), dtype=torch.float32, dense_dims=1)
    check_scale("sparse_mla_paged: sm_scale", sm_scale)
    if num_sms is not None and (not is_int(num_sms) or num_sms < 1):
        raise ValueError(f"sparse_mla_paged: num_sms must be None or an int >= 1, got {num_sms!r}")
    if device_value_checks_on():  # debug mode (dsv32ref.checks.checking_device_values): syncs
        check_range("req_indices", req_indices, 0, B, "seq_lens.shape[0]")
        nb, bs = latent_cache.shape[:2]
        check_range("seq_lens", seq_lens, 0, block_table.shape[1] * bs + 1, "block_table.shape[1] x block_size + 1")
        for b, n in enumerate(seq_lens.tolist()):
            check_range(f"block_table[{b}] (its first {-(-n // bs)} blocks)", block_table[b, : -(-n // bs)], 0, nb,
                        "latent_cache.shape[0]")
    check_same_device(q=q, latent_cache=latent_cache, block_table=block_table, req_indices=req_indices,
                      seq_lens=seq_lens, topk_indices=topk_indices, out=out, lse=lse)
    if cfg["SPLIT_QK"] and not cfg["Q_RELOAD"]:
        raise ValueError("sparse_mla_paged: SPLIT_QK needs Q_RELOAD=True (triton 3.6's software pipeliner fails "
                         "on a loop-invariant query tile beside the branch; compile_sm90 in "
                         "scripts/sass_sparse_mla.py reproduces it)")
    if T == 0:
        return out, lse
    block_dv = min(cfg["BLOCK_DV"], d_lat)
    block_h = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(H)))
    lse_arg = lse if lse is not None else torch.empty(T, H, dtype=torch.float32, device=q.device)
    head_blocks, K = triton.cdiv(H, block_h), topk_indices.shape[1]
    splits = cfg.get("NUM_SPLITS")
    if splits is None:
        sms = num_sms if num_sms is not None else _num_sms(q.device.index) if q.is_cuda else CPU_SMS
        # Split the top-k only while the programs leave SMs idle: a bf16 program takes most of an SM's shared
        # memory (one per SM), so splitting a full wave further adds waves and a combine, not parallelism.
        fill = sms // (T * head_blocks)
        splits = 1 << (fill.bit_length() - 1) if fill >= 2 and block_dv == d_lat else 1
    splits = max(1, min(int(splits), 16, triton.next_power_of_2(triton.cdiv(K, cfg["BLOCK_N"]))))
    if splits & (splits - 1) or (splits > 1 and block_dv != d_lat):
        raise ValueError(f"sparse_mla_paged: NUM_SPLITS must be a power of two and needs BLOCK_DV == {d_lat}")
    if splits > 1:
        part_o = torch.empty(T, H, splits, d_lat, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
        o_arg, o_s0, o_s1, l_arg, l_s0 = part_o, 0, 0, part_lse, 0
        grid = (T, head_blocks, splits)
    else:
        o_arg, o_s0, o_s1, l_arg, l_s0 = out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0)
        grid = (T, head_blocks, d_lat // block_dv)
    # SLOTS resolves the top-k to flat cache rows (block * BS + offset) in a workspace: needs the cache's
    # blocks laid out back to back, as a contiguous [NB, BS, D] tensor has them.
    use_slots = cfg["SLOTS"] and latent_cache.stride(0) == latent_cache.shape[1] * latent_cache.stride(1)
    # Without SLOTS, PREFETCH would load the next step's index -> block-table chains, which is slower (the
    # sweep): a fallback from the default keeps it off unless the caller asked for it.
    prefetch = cfg["PREFETCH"] and (use_slots or "PREFETCH" in (config or {}))
    slots = torch.empty(T, K, dtype=torch.int32, device=q.device) if use_slots else topk_indices
    _sparse_mla_kernel[grid](
        q, q.stride(0), q.stride(1),
        latent_cache, latent_cache.stride(0), latent_cache.stride(1),
        block_table, block_table.stride(0), req_indices, seq_lens,
        topk_indices, topk_indices.stride(0),
        o_arg, o_s0, o_s1,
        l_arg, l_s0,
        slots,
        sm_scale * math.log2(math.e), H, K, latent_cache.shape[1],
        B, block_table.shape[1], latent_cache.shape[0],
        D_LAT=d_lat, D_ROPE=d_rope, BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"], BLOCK_DV=block_dv,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", Q_RELOAD=cfg["Q_RELOAD"],
        NUM_SPLITS=splits, VALID_FIRST=valid_first,
        SLOTS=use_slots, PREFETCH=prefetch, SPLIT_QK=cfg["SPLIT_QK"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _combine_splits_kernel[(T, H)](part_o, part_lse, out, out.stride(0), out.stride(1), lse_arg,
                                       lse_arg.stride(0), H, NUM_SPLITS=splits, D_LAT=d_lat, num_warps=4)
    return out, lse
