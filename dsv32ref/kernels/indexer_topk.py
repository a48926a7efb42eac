"""The lightning indexer on the paged key cache: scores, then a radix-select top-k. Graph-safe.

Motivation. The PyTorch path materialises q.k for every indexer head, [T, H_I, S] in fp32, before the
weighted sum and torch.topk: at H_I = 64 that is 256 bytes per (token, key), 64x the [T, S] scores it
produces. Here one kernel reduces over heads in registers and writes only the [T, S] scores; a second
selects the top k per row with a 4-pass 8-bit radix select (histograms over the order-preserving integer
image of each fp32 score), then compacts the winners. Grids depend only on the number of query tokens and
the width of the caller's score buffer; positions, request indices, sequence lengths and block tables are
read on the device; no host sync.

Work per query token with S visible keys (DeepSeek-V3.2: H_I = 64, D = 128):
    scores: FLOPs = 2 H_I D S (+ H_I S for the weighting); bytes >= S D 2 (keys, bf16) + S 4 (scores out)
            -> 63 FLOP/byte: memory-bound on the key reads
    top-k:  5 passes over the S fp32 scores (4 histogram passes + 1 selection pass), writes k int32

Output: top-k indices int32 [T, K], the selected positions in increasing order (a set: attention does
not care about order), -1 padded when fewer than K keys are visible. Ties at the threshold go to the
lower positions, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv32ref.checks import (check_range, check_same_device, check_scale, check_tensor,
                             device_value_checks_on, is_int)

__all__ = ["indexer_scores_paged", "topk_from_scores", "indexer_topk_paged"]


@triton.jit
def _indexer_scores_kernel(
    q_ptr, stride_qt, stride_qh,  # q^I [T, H_I, D] (roped)
    w_ptr, stride_wt,  # weights [T, H_I] fp32, already scaled by H_I^-1/2
    kcache_ptr, stride_kb, stride_ks,  # indexer-key cache [NB, BS, D]
    block_table_ptr, stride_bt, req_ptr, pos_ptr,
    scores_ptr, stride_st,  # [T, S_MAX] fp32
    softmax_scale, block_size,
    S_MAX, B, max_blocks, num_blocks,  # bounds: score width, requests, a block-table row, block ids (masked)
    H_I: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    s0 = tl.program_id(1) * BLOCK_S
    # causal: keys 0..position, within the score row and what the block-table row can address; a request
    # index outside [0, B) scores nothing (the launcher's debug mode raises on these instead)
    req = tl.load(req_ptr + t)
    n_visible = tl.minimum(tl.load(pos_ptr + t) + 1, tl.minimum(S_MAX, max_blocks * block_size))
    n_visible = tl.where((req >= 0) & (req < B), n_visible, 0)
    if s0 < n_visible:
        offs_s = s0 + tl.arange(0, BLOCK_S)
        vis = offs_s < n_visible
        offs_h = tl.arange(0, H_I)
        offs_d = tl.arange(0, D)
        blk = tl.load(block_table_ptr + req * stride_bt + offs_s // block_size, mask=vis, other=0)
        vis = vis & (blk >= 0) & (blk < num_blocks)  # a key in a block outside the cache scores nothing
        k_ptrs = kcache_ptr + blk.to(tl.int64)[:, None] * stride_kb + (offs_s % block_size)[:, None] * stride_ks + offs_d[None, :]
        k = tl.load(k_ptrs, mask=vis[:, None], other=0.0)  # (BLOCK_S, D)
        q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :])  # (H_I, D)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * softmax_scale  # (H_I, BLOCK_S)
        w = tl.load(w_ptr + t * stride_wt + offs_h)  # (H_I,)
        score = tl.sum(w[:, None] * tl.maximum(logits, 0.0), axis=0)  # (BLOCK_S,)
        tl.store(scores_ptr + t * stride_st + offs_s, score, mask=vis)


@triton.jit
def _ordered_key(x):
    """fp32 -> uint32 whose unsigned order is the float order (flip all bits of negatives, the sign of others)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 (a negative weight times ReLU's 0) ties with +0.0, as in torch
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    ones = tl.full(bits.shape, 0xFFFFFFFF, tl.uint32)  # `~bits` breaks the interpreter on uint32
    return tl.where((bits & sign) != 0, bits ^ ones, bits | sign)


@triton.jit
def _select(vals, n, K, out_idx, out_val, src_idx, idx_base,
            BLOCK: tl.constexpr, HAS_SRC_IDX: tl.constexpr, WRITE_VALS: tl.constexpr):
    """Top K of vals[0:n] -> out_idx[0:K] (idx_base + offset, or src_idx[offset]), in increasing offset
    order, -1 padded; out_val gets the selected values (-inf padded) when WRITE_VALS."""
    if n <= K:
        # every entry is selected; pad with -1
        for pad_start in range(0, K, BLOCK):
            offs_pad = pad_start + tl.arange(0, BLOCK)
            keep = offs_pad < n
            if HAS_SRC_IDX:
                ids = tl.load(src_idx + offs_pad, mask=keep, other=-1)
            else:
                ids = tl.where(keep, idx_base + offs_pad, -1)
            tl.store(out_idx + offs_pad, ids, mask=offs_pad < K)
            if WRITE_VALS:
                v = tl.load(vals + offs_pad, mask=keep, other=float("-inf"))
                tl.store(out_val + offs_pad, v, mask=offs_pad < K)
    else:
        # Radix select: find the K-th largest key 8 bits at a time, most significant first.
        prefix = tl.full([], 0, tl.uint32)
        k_rem = K
        bins = tl.arange(0, 256)
        for p in tl.static_range(4):  # digit p covers bits [24 - 8p, 32 - 8p)
            hist = tl.zeros([256], tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                m = offs < n
                key = _ordered_key(tl.load(vals + offs, mask=m, other=float("-inf")))
                if p > 0:
                    m = m & ((key >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
                digit = ((key >> (24 - 8 * p)) & 0xFF).to(tl.int32)
                hist += tl.histogram(digit, 256, mask=m)
            at_or_above = tl.cumsum(hist, 0, reverse=True)  # keys with this prefix and digit >= d
            d_sel = tl.max(tl.where(at_or_above >= k_rem, bins, -1), axis=0)
            k_rem -= tl.sum(tl.where(bins > d_sel, hist, 0), axis=0)
            prefix = prefix | (d_sel.to(tl.uint32) << (24 - 8 * p))
        # prefix is the K-th largest key; take every larger key and the first k_rem equal ones.
        written = tl.zeros([], tl.int32)
        eq_seen = tl.zeros([], tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            v = tl.load(vals + offs, mask=m, other=float("-inf"))
            key = _ordered_key(v)
            gt = m & (key > prefix)
            eq = m & (key == prefix)
            eq_rank = tl.cumsum(eq.to(tl.int32), 0) - 1 + eq_seen
            take = gt | (eq & (eq_rank < k_rem))
            slot = tl.cumsum(take.to(tl.int32), 0) - 1 + written
            if HAS_SRC_IDX:
                ids = tl.load(src_idx + offs, mask=take, other=-1)
            else:
                ids = idx_base + offs
            tl.store(out_idx + slot, ids, mask=take)
            if WRITE_VALS:
                tl.store(out_val + slot, v, mask=take)
            written += tl.sum(take.to(tl.int32), axis=0)
            eq_seen += tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _topk_kernel(scores_ptr, stride_st, pos_ptr, out_ptr, stride_ot, K, S_MAX, BLOCK: tl.constexpr):
    """One program per row: the top K of scores[t, :positions[t] + 1] (never past the row's S_MAX)."""
    t = tl.program_id(0)
    n = tl.minimum(tl.load(pos_ptr + t) + 1, S_MAX).to(tl.int32)  # visible keys
    _select(scores_ptr + t * stride_st, n, K, out_ptr + t * stride_ot, out_ptr, out_ptr, 0,
            BLOCK=BLOCK, HAS_SRC_IDX=False, WRITE_VALS=False)


@triton.jit
def _topk_chunk_kernel(scores_ptr, stride_st, pos_ptr, cand_idx_ptr, cand_val_ptr, K, CHUNK, S_MAX,
                       BLOCK: tl.constexpr):
    """Stage 1 of the split top-k (few long rows): the top K of each CHUNK of a row, with their values."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    base = c * CHUNK
    n = tl.minimum(tl.maximum(tl.minimum(tl.load(pos_ptr + t) + 1, S_MAX).to(tl.int32) - base, 0), CHUNK)
    cand = (t * tl.num_programs(1) + c) * K
    _select(scores_ptr + t * stride_st + base, n, K, cand_idx_ptr + cand, cand_val_ptr + cand, cand_idx_ptr, base,
            BLOCK=BLOCK, HAS_SRC_IDX=False, WRITE_VALS=True)


@triton.jit
def _topk_merge_kernel(cand_idx_ptr, cand_val_ptr, n_cand, out_ptr, stride_ot, K, BLOCK: tl.constexpr):
    """Stage 2: the top K of a row's chunk candidates. Chunks are in position order and each chunk's
    candidates too, so ties still go to the lower position; -inf padding sorts last."""
    t = tl.program_id(0)
    _select(cand_val_ptr + t * n_cand, n_cand, K, out_ptr + t * stride_ot, out_ptr, cand_idx_ptr + t * n_cand, 0,
            BLOCK=BLOCK, HAS_SRC_IDX=True, WRITE_VALS=False)


def _check_common(q_idx, weights, index_cache, block_table, req_indices, positions):
    T, H_I, D = check_tensor("q_idx", q_idx, shape=(None, None, None),
                             dtype=(torch.bfloat16, torch.float16, torch.float32), dense_dims=1).shape
    for name, v in (("index_n_heads", H_I), ("index_head_dim", D)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"indexer_topk: {name} must be a power of two, got {v}")
    check_tensor("weights", weights, shape=(T, H_I), dtype=torch.float32, dense_dims=1)
    check_tensor("index_cache", index_cache, shape=(None, None, D), dtype=q_idx.dtype, dense_dims=1)
    B = check_tensor("block_table", block_table, shape=(None, None), dtype=torch.int32, dense_dims=1).shape[0]
    check_tensor("req_indices", req_indices, shape=(T,), dtype=torch.int32, dense_dims=1)
    check_tensor("positions", positions, shape=(T,), dtype=(torch.int64, torch.int32), dense_dims=1)
    check_same_device(q_idx=q_idx, weights=weights, index_cache=index_cache, block_table=block_table,
                      req_indices=req_indices, positions=positions)
    if device_value_checks_on():  # debug mode: syncs
        nb, bs = index_cache.shape[:2]
        check_range("req_indices", req_indices, 0, B, "block_table.shape[0]")
        check_range("positions", positions, 0, block_table.shape[1] * bs, "block_table.shape[1] x block_size")
        for t, (r, p) in enumerate(zip(req_indices.tolist(), positions.tolist())):
            check_range(f"block_table[{r}] (the blocks of token {t})", block_table[r, : p // bs + 1], 0, nb,
                        "index_cache.shape[0]")
    return T, H_I, D


def indexer_scores_paged(q_idx, weights, index_cache, block_table, req_indices, positions, softmax_scale,
                         scores, block_s: int = 64, num_warps: int = 4):
    """scores[t, s] = sum_h weights[t, h] relu(q_idx[t, h] . k[s] * softmax_scale) for s <= positions[t].

    q_idx [T, H_I, D]; weights fp32 [T, H_I]; index_cache [NB, BS, D]; scores fp32 [T, S_MAX] (caller-owned;
    entries past a token's position are left untouched). S_MAX must exceed every position.
    """
    T, H_I, D = _check_common(q_idx, weights, index_cache, block_table, req_indices, positions)
    check_tensor("scores", scores, shape=(T, None), dtype=torch.float32, device=q_idx.device, dense_dims=1)
    check_scale("indexer_scores_paged: softmax_scale", softmax_scale)
    if device_value_checks_on():
        check_range("positions", positions, 0, scores.shape[1], "scores.shape[1]")
    if T:
        grid = (T, triton.cdiv(scores.shape[1], block_s))
        _indexer_scores_kernel[grid](
            q_idx, q_idx.stride(0), q_idx.stride(1), weights, weights.stride(0),
            index_cache, index_cache.stride(0), index_cache.stride(1),
            block_table, block_table.stride(0), req_indices, positions, scores, scores.stride(0),
            softmax_scale, index_cache.shape[1],
            scores.shape[1], block_table.shape[0], block_table.shape[1], index_cache.shape[0],
            H_I=H_I, D=D, BLOCK_S=block_s, PRECISION="ieee" if q_idx.dtype == torch.float32 else "tf32",
            num_warps=num_warps,
        )
    return scores


def topk_from_scores(scores, positions, out, block: int = 4096, num_warps: int = 8, chunk: int = 8192,
                     split_below_rows: int = 128):
    """out[t] = the top out.shape[1] of scores[t, :positions[t] + 1] (int32, increasing, -1 padded).

    With fewer than `split_below_rows` rows and rows longer than two chunks, one program per row would
    leave the GPU idle: each row is cut into `chunk`-long pieces selected in parallel, then merged.
    The choice depends only on the shapes, so it is fixed within a captured graph.
    """
    T = check_tensor("scores", scores, shape=(None, None), dtype=torch.float32, dense_dims=1).shape[0]
    check_tensor("positions", positions, shape=(T,), dtype=(torch.int64, torch.int32), device=scores.device,
                 dense_dims=1)
    K = check_tensor("out", out, shape=(T, None), dtype=torch.int32, device=scores.device, dense_dims=1).shape[1]
    for name, v in (("block", block), ("chunk", chunk), ("num_warps", num_warps)):
        if not is_int(v) or v < 1 or v & (v - 1):
            raise ValueError(f"topk_from_scores: {name} must be a power of two, got {v!r}")
    if device_value_checks_on():
        check_range("positions", positions, 0, scores.shape[1], "scores.shape[1]")
    if chunk < K:
        raise ValueError(f"topk_from_scores: chunk ({chunk}) must be >= the top-k width ({K})")
    if T == 0:
        return out
    n_chunks = triton.cdiv(scores.shape[1], chunk)
    if T >= split_below_rows or n_chunks <= 2:
        _topk_kernel[(T,)](scores, scores.stride(0), positions, out, out.stride(0), K, scores.shape[1], BLOCK=block,
                           num_warps=num_warps)
        return out
    cand_idx = torch.empty(T, n_chunks, K, dtype=torch.int32, device=scores.device)
    cand_val = torch.empty(T, n_chunks, K, dtype=torch.float32, device=scores.device)
    _topk_chunk_kernel[(T, n_chunks)](scores, scores.stride(0), positions, cand_idx, cand_val, K, chunk,
                                      scores.shape[1], BLOCK=block, num_warps=num_warps)
    _topk_merge_kernel[(T,)](cand_idx, cand_val, n_chunks * K, out, out.stride(0), K, BLOCK=block, num_warps=num_warps)
    return out


def indexer_topk_paged(q_idx, weights, index_cache, block_table, req_indices, positions, softmax_scale,
                       scores, out, block_s: int = 64):
    """Both steps: the caller owns `scores` fp32 [T, S_MAX] (workspace) and `out` int32 [T, index_topk]."""
    indexer_scores_paged(q_idx, weights, index_cache, block_table, req_indices, positions, softmax_scale,
                         scores, block_s)
    return topk_from_scores(scores, positions, out)
