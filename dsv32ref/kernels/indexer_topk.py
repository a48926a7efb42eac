"""The lightning indexer on the paged key cache: scores, then a radix-select top-k. Graph-safe.

Motivation. The PyTorch path materialises q.k for every indexer head, [T, H_I, S], before the weighted sum
and torch.topk: at H_I = 64 that is 64x the [T, S] scores it produces. Here one kernel reduces over heads in
registers and writes only the [T, S] scores; a second selects the top k per row with a 4-pass 8-bit radix
select (histograms over the order-preserving integer image of each fp32 score), then compacts the winners.
Grids depend only on the number of query tokens and the width of the caller's score buffer; positions,
request indices, sequence lengths and block tables are read on the device; no host sync.

Work per query token with S visible keys (DeepSeek-V3.2: H_I = 64, D = 128):
    scores: FLOPs = 2 H_I D S (+ H_I S for the weighting); bytes >= S D 2 (keys, bf16) + S 4 (scores out)
            -> 63 FLOP/byte: memory-bound on the key reads (one decode token at 128k context: 33.6 MB of keys)
    top-k:  5 passes over the S fp32 scores (4 histogram passes + 1 selection pass), writes k int32
With the FP8 key cache (DeepGEMM's blocks: fp8 keys, then one fp32 scale per key) a key is D + 4 bytes, 132
instead of 256 at D = 128, and each key's scale multiplies its scores. The queries may be bf16 (the keys are
upcast exactly) or, as deployed, fp8 with their per-head scales folded into the weights (fused_q writes them):
then the MMA multiplies fp8 by fp8 at twice the bf16 rate and the query tile takes half the shared memory.

Decode is the case the indexer exists for: one token, a long context. One program per 64 keys then makes
thousands of tiny programs that each reload the query; a program instead walks `tiles` key tiles with the
query held (the loads pipelined; where a tile lies in one cache block, the program's block ids are read before
its loop, so no load in the loop waits on another). And one program per row would select from 128k scores on
one SM: few long rows are cut into chunks, and each radix pass runs over all chunks at once (a launch per pass;
each program sums the chunks' histograms of the pass before to extend the prefix), then a last launch compacts.
Those five launches are chained by programmatic dependent launch where the GPU has it (sm_90 on): each starts
while the one before runs, loads its chunk of scores, and waits only before it reads the histograms of the pass
before.

Prefill is the other case: T tokens of one request read the same keys. From 256 tokens a program scores a
group of consecutive tokens (their heads side by side on the MMA's columns), so each key tile is read once
per group instead of once per token.

Output: top-k indices int32 [T, K], the selected positions in increasing order (a set: attention does
not care about order), -1 padded when fewer than K keys are visible. Ties at the threshold go to the
lower positions, as in the reference. A NaN in a query, key or weight makes its scores NaN (ReLU keeps NaN,
as torch.relu does), and a NaN score ranks above every number (as torch.sort and torch.topk rank it): the
reference, the interpreter and the compiled kernels select the same keys. An fp8 NaN byte (a key or query that
fused_norm_rope or fused_q wrote from a non-finite activation) is a NaN too, interpreted as well (fp8.load_e4m3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv32ref.checks import (check_disjoint, check_fp32_scale, check_range, check_same_device, check_tensor,
                             device_value_checks_on, is_int)
from dsv32ref.kernels.fp8 import load_e4m3
from dsv32ref.kernels.grid import dot_precision, mma
from dsv32ref.kernels.grid import num_sms as _num_sms
from dsv32ref.kernels.grid import pdl as _pdl
from dsv32ref.kernels.launch import launch
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["indexer_scores_paged", "topk_from_scores", "indexer_topk_paged"]


@triton.jit
def _after_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL): wait until the launch before this one has finished (its writes
    visible), then let the next launch start. Every program of a PDL launch calls it, before it reads what the
    launch before wrote and before it returns: a launch then ends only after the one before it, and a launch
    may read, before it calls this, what the launch two back wrote (the one between waited for it)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _load_keys(kcache_ptr, blk, row, vis, stride_kb, stride_ks, block_size, dtype: tl.constexpr, D: tl.constexpr,
               FP8: tl.constexpr, FLAG_NAN: tl.constexpr):
    """Keys at rows `row` of blocks `blk` -> (keys (BLOCK_S, D) in dtype, their scales (BLOCK_S,) fp32). FP8: the
    cache is bytes in DeepGEMM's block layout, a block's block_size x D fp8 values token by token, then its
    block_size fp32 scales; the scale multiplies the key's scores (it is one per key: the same as scaling the key)."""
    offs_d = tl.arange(0, D)
    if FP8:
        base = kcache_ptr + blk.to(tl.int64) * stride_kb  # the blocks' first bytes
        k, nan = load_e4m3((base + row * D)[:, None] + offs_d[None, :], vis[:, None], FLAG_NAN)  # (BLOCK_S, D)
        k = k.to(dtype)  # exact in any float dtype
        k_scale = tl.load((base + block_size * D + 4 * row).to(tl.pointer_type(tl.float32)), mask=vis, other=0.0)
        if FLAG_NAN:  # a NaN in a key: NaN scores, as the reference gives (compiled, the MMA gives them)
            k_scale = tl.where(nan, float("nan"), k_scale)
    else:
        k_row = blk.to(tl.int64) * stride_kb + row * stride_ks  # (BLOCK_S,)
        k = tl.load(kcache_ptr + k_row[:, None] + offs_d[None, :], mask=vis[:, None], other=0.0)  # (BLOCK_S, D)
        k_scale = tl.full(row.shape, 1.0, tl.float32)
    return k, k_scale


@triton.jit
def _indexer_scores_kernel(
    q_ptr, stride_qt, stride_qh,  # q^I [T, H_I, D] (roped)
    w_ptr, stride_wt,  # weights [T, H_I] fp32, already scaled by H_I^-1/2
    kcache_ptr, stride_kb, stride_ks,  # indexer-key cache [NB, BS, D]; FP8: bytes [NB, BS, D + 4] (_load_keys)
    block_table_ptr, stride_bt, req_ptr, pos_ptr,
    scores_ptr, stride_st,  # [T, S_MAX] fp32
    softmax_scale, block_size,
    T, S_MAX, B, max_blocks, num_blocks,  # bounds: tokens, score width, requests, a block-table row, block ids
    H_I: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, TILES: tl.constexpr, TOKENS: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_Q: tl.constexpr,
    FLAG_NAN: tl.constexpr,
):
    """Program (i, j): the scores of keys [j TILES BLOCK_S, (j + 1) TILES BLOCK_S) of tokens [i TOKENS,
    (i + 1) TOKENS), a key tile at a time. The tokens of one request share its keys: each tile is read once
    for all of them, one MMA over their TOKENS x H_I query rows (a group that spans requests takes each of
    its requests in turn, the others' rows masked). TILE_IN_BLOCK (block_size a multiple of BLOCK_S): a tile lies
    in one cache block, and the program's block ids are loaded once, before its loop; no load in the loop then
    waits on another (otherwise each key looks up its own block, a load its key's load waits on)."""
    t0 = tl.program_id(0) * TOKENS
    offs_g = tl.arange(0, TOKENS)  # the group's tokens
    offs_c = tl.arange(0, TOKENS * H_I)  # the MMA's columns: (token, head) pairs
    offs_d = tl.arange(0, D)
    # causal: keys 0..position, within the score row and what the block-table row can address; a request
    # index outside [0, B) scores nothing (the launcher's debug mode raises on these instead)
    tok_ok = t0 + offs_g < T
    req_g = tl.load(req_ptr + t0 + offs_g, mask=tok_ok, other=-1)
    n_vis_g = tl.minimum(tl.load(pos_ptr + t0 + offs_g, mask=tok_ok, other=-1) + 1,
                         tl.minimum(S_MAX, max_blocks * block_size))
    n_vis_g = tl.where(tok_ok & (req_g >= 0) & (req_g < B), n_vis_g, 0)  # (TOKENS,)
    tok_c = t0 + offs_c // H_I
    req_c = tl.load(req_ptr + tok_c, mask=tok_c < T, other=-1)  # (TOKENS H_I,)
    s_lo = tl.program_id(1) * (TILES * BLOCK_S)
    for g in range(TOKENS):
        req = tl.sum(tl.where(offs_g == g, req_g, 0), axis=0)
        n_g = tl.sum(tl.where(offs_g == g, n_vis_g, 0), axis=0)
        member = (req_g == req) & (n_vis_g > 0)  # (TOKENS,) the group's tokens of this request that see keys
        first = tl.sum(((offs_g < g) & member).to(tl.int32), axis=0) == 0  # token g leads them (if it is one)
        s_hi = tl.minimum(s_lo + TILES * BLOCK_S, tl.max(tl.where(member, n_vis_g, 0), axis=0))
        if first & (n_g > 0) & (s_lo < s_hi):
            member_c = (req_c == req) & (tok_c < T)
            w = tl.load(w_ptr + tok_c * stride_wt + offs_c % H_I, mask=member_c, other=0.0)  # (TOKENS H_I,)
            q_ptrs = q_ptr + tok_c[:, None] * stride_qt + (offs_c % H_I)[:, None] * stride_qh + offs_d[None, :]
            if FP8_Q:  # fp8 queries (their scales in w): a NaN one scores NaN, as in the reference
                q, q_nan = load_e4m3(q_ptrs.to(tl.pointer_type(tl.uint8)), member_c[:, None], FLAG_NAN)
                if FLAG_NAN:
                    w = tl.where(q_nan, float("nan"), w)
            else:
                q = tl.load(q_ptrs, mask=member_c[:, None], other=0.0)  # (TOKENS H_I, D), held
            if TILE_IN_BLOCK:
                tile_s = s_lo + tl.arange(0, TILES) * BLOCK_S  # the first key of each of the program's tiles
                blk_j = tl.load(block_table_ptr + req * stride_bt + tile_s // block_size, mask=tile_s < s_hi,
                                other=-1)  # (TILES,)
            for s0 in tl.range(s_lo, s_hi, BLOCK_S):
                offs_s = s0 + tl.arange(0, BLOCK_S)
                vis = offs_s < s_hi
                if TILE_IN_BLOCK:
                    blk = tl.sum(tl.where(tl.arange(0, TILES) == (s0 - s_lo) // BLOCK_S, blk_j, 0), axis=0)
                    row = s0 % block_size + tl.arange(0, BLOCK_S)  # (BLOCK_S,) within the block
                else:
                    blk = tl.load(block_table_ptr + req * stride_bt + offs_s // block_size, mask=vis, other=0)
                    row = offs_s % block_size
                vis = vis & (blk >= 0) & (blk < num_blocks)  # a key in a block outside the cache scores nothing
                k, k_scale = _load_keys(kcache_ptr, blk, row, vis, stride_kb, stride_ks, block_size, q.dtype, D, FP8,
                                        FLAG_NAN)
                # keys on the MMA's rows, (token, head) on its columns: the sum over heads stays inside each
                # warp (with heads on the rows it crossed warps through shared memory: 8-15 % slower, H200)
                logits = mma(k, tl.trans(q), PRECISION)  # (BLOCK_S, TOKENS H_I)
                logits = logits * (k_scale * softmax_scale)[:, None]
                # ReLU that keeps NaN, as torch.relu does (compiled, tl.maximum returns the number)
                part = tl.where(logits < 0.0, 0.0, logits) * w[None, :]
                for u in tl.static_range(TOKENS):
                    n_u = tl.sum(tl.where((offs_g == u) & member, n_vis_g, 0), axis=0)
                    score = tl.sum(tl.where((offs_c // H_I == u)[None, :], part, 0.0), axis=1)  # (BLOCK_S,)
                    tl.store(scores_ptr + (t0 + u) * stride_st + offs_s, score, mask=vis & (offs_s < n_u))


# ---- radix select ------------------------------------------------------------------------------------

@triton.jit
def _ordered_key(x):
    """fp32 -> uint32 whose unsigned order is the float order (flip all bits of negatives, the sign of others).
    Every NaN, whatever its sign bit, ranks above +inf, as torch.sort and torch.topk rank it."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 (a negative weight times ReLU's 0) ties with +0.0, as in torch
    x = tl.where(x != x, float("nan"), x)  # one NaN: the positive quiet one
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    ones = tl.full(bits.shape, 0xFFFFFFFF, tl.uint32)  # `~bits` breaks the interpreter on uint32
    return tl.where((bits & sign) != 0, bits ^ ones, bits | sign)


@triton.jit
def _digit_hist_block(key, m, prefix, P: tl.constexpr):
    """Histogram (256,) of digit P (bits [24 - 8P, 32 - 8P)) of the keys under mask m whose digits before P
    are prefix's."""
    if P > 0:
        m = m & ((key >> (32 - 8 * P)) == (prefix >> (32 - 8 * P)))
    return tl.histogram(((key >> (24 - 8 * P)) & 0xFF).to(tl.int32), 256, mask=m)


@triton.jit
def _digit_hist(vals, start, end, prefix, P: tl.constexpr, BLOCK: tl.constexpr):
    """_digit_hist_block over the keys of vals[start:end], BLOCK at a time."""
    hist = tl.zeros([256], tl.int32)
    for s in range(start, end, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < end
        hist += _digit_hist_block(_ordered_key(tl.load(vals + offs, mask=m, other=float("-inf"))), m, prefix, P)
    return hist


@triton.jit
def _digit_step(hist, prefix, k_rem, P: tl.constexpr):
    """Digit P of the k_rem-th largest key, from the histogram of digit P among the keys that share prefix
    -> (prefix with digit P set, k_rem minus the keys above that digit, the digit)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.cumsum(hist, 0, reverse=True)  # keys with this prefix and digit >= d
    d = tl.max(tl.where(at_or_above >= k_rem, bins, -1), axis=0)
    k_rem -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
    return prefix | (d.to(tl.uint32) << (24 - 8 * P)), k_rem, d


@triton.jit
def _take_block(key, offs, m, threshold, n_eq, written, eq_seen, out_idx):
    """Write the positions offs (under mask m) of every key above `threshold`, and of the equal keys while
    fewer than n_eq were taken (eq_seen equal keys came before), to out_idx[written:] in increasing order
    -> (written, eq_seen) after them."""
    gt = m & (key > threshold)
    eq = m & (key == threshold)
    eq_rank = tl.cumsum(eq.to(tl.int32), 0) - 1 + eq_seen
    take = gt | (eq & (eq_rank < n_eq))
    slot = tl.cumsum(take.to(tl.int32), 0) - 1 + written
    tl.store(out_idx + slot, offs, mask=take)
    return written + tl.sum(take.to(tl.int32), axis=0), eq_seen + tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _take(vals, start, end, threshold, n_eq, written, eq_seen, out_idx, BLOCK: tl.constexpr):
    """_take_block over the positions [start, end) of vals, BLOCK at a time."""
    written = written + tl.zeros([], tl.int32)
    eq_seen = eq_seen + tl.zeros([], tl.int32)
    for s in range(start, end, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < end
        key = _ordered_key(tl.load(vals + offs, mask=m, other=float("-inf")))
        written, eq_seen = _take_block(key, offs, m, threshold, n_eq, written, eq_seen, out_idx)


@triton.jit
def _take_all(start, end, out_idx, BLOCK: tl.constexpr):
    """A row with at most K visible keys: every position in [start, end) is selected, in place."""
    for s in range(start, end, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        tl.store(out_idx + offs, offs, mask=offs < end)


@triton.jit
def _pad(start, K, out_idx, BLOCK: tl.constexpr):
    for s in range(start, K, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        tl.store(out_idx + offs, tl.full([BLOCK], -1, tl.int32), mask=offs < K)


@triton.jit
def _topk_kernel(scores_ptr, stride_st, pos_ptr, out_ptr, stride_ot, K, S_MAX, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    """One program per row: the top K of scores[t, :positions[t] + 1] (never past the row's S_MAX)."""
    _after_previous(PDL)
    t = tl.program_id(0)
    n = tl.minimum(tl.load(pos_ptr + t) + 1, S_MAX).to(tl.int32)  # visible keys
    vals, out_idx = scores_ptr + t * stride_st, out_ptr + t * stride_ot
    if n <= K:
        _take_all(0, n, out_idx, BLOCK)
        _pad(tl.maximum(n, 0), K, out_idx, BLOCK)
    else:  # find the K-th largest key 8 bits at a time, most significant first; then take
        prefix = tl.full([], 0, tl.uint32)
        k_rem = K
        for p in tl.static_range(4):
            prefix, k_rem, d = _digit_step(_digit_hist(vals, 0, n, prefix, p, BLOCK), prefix, k_rem, p)
        _take(vals, 0, n, prefix, k_rem, 0, 0, out_idx, BLOCK)


# ---- radix select over chunks (few long rows) -----------------------------------------------------------
# hist int32 [4, T, n_chunks, 256]: pass p's histogram of digit p for each chunk of each row; then
# state int32 [T, 4, 2]: slot p (1..3) holds (prefix, k_rem) after digits 0..p-1, written by chunk 0's program of
# pass p (slot 0 is unused: pass 0 starts from the empty prefix).

@triton.jit
def _sum_chunks(hist_ptr, n_chunks, CB: tl.constexpr):
    """A row's histogram of one pass: the sum of its chunks' (n_chunks, 256) -> (256,)."""
    bins = tl.arange(0, 256)
    total = tl.zeros([256], tl.int32)
    for c0 in range(0, n_chunks, CB):
        offs_c = c0 + tl.arange(0, CB)
        total += tl.sum(tl.load(hist_ptr + offs_c[:, None] * 256 + bins[None, :], mask=(offs_c < n_chunks)[:, None],
                                other=0), axis=0)
    return total


@triton.jit
def _count_before(hist_ptr, c, d, CB: tl.constexpr):
    """Over chunks [0, c) of one pass: (keys whose digit is > d, keys whose digit is d)."""
    bins = tl.arange(0, 256)
    gt = tl.zeros([], tl.int32)
    eq = tl.zeros([], tl.int32)
    for c0 in range(0, c, CB):
        offs_c = c0 + tl.arange(0, CB)
        h = tl.load(hist_ptr + offs_c[:, None] * 256 + bins[None, :], mask=(offs_c < c)[:, None], other=0)
        gt += tl.sum(tl.where(bins[None, :] > d, h, 0))
        eq += tl.sum(tl.where(bins[None, :] == d, h, 0))
    return gt, eq


@triton.jit
def _prefix_through(hist_ptr, state_ptr, t, T, K, n_chunks, P: tl.constexpr, CB: tl.constexpr):
    """(prefix of digits 0..P-1 of row t's K-th largest key, keys still to take at it): the state after pass
    P - 1 (from pass P - 1's programs) advanced by digit P - 1, from the sum of that pass's chunk histograms."""
    if P == 1:
        prefix = tl.full([], 0, tl.uint32)
        k_rem = K + tl.zeros([], tl.int32)
    else:
        prefix = tl.load(state_ptr + (t * 4 + P - 1) * 2).to(tl.uint32, bitcast=True)
        k_rem = tl.load(state_ptr + (t * 4 + P - 1) * 2 + 1)
    prefix, k_rem, d = _digit_step(_sum_chunks(hist_ptr + ((P - 1) * T + t) * n_chunks * 256, n_chunks, CB),
                                   prefix, k_rem, P - 1)
    return prefix, k_rem


@triton.jit
def _topk_hist_kernel(scores_ptr, stride_st, pos_ptr, hist_ptr, state_ptr, T, K, S_MAX, n_chunks,
                      P: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr, PDL: tl.constexpr):
    """Pass P, program (t, c): the histogram of digit P in chunk c of row t, among the keys whose digits
    before P are the K-th largest key's."""
    if P == 0:
        _after_previous(PDL)  # the scores: from the launch before
    t = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.minimum(tl.load(pos_ptr + t) + 1, S_MAX).to(tl.int32)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = (offs < n) & (n > K)  # (a row with at most K keys takes them all: no histograms, none read)
    key = _ordered_key(tl.load(scores_ptr + t * stride_st + offs, mask=m, other=float("-inf")))  # in flight
    if P > 0:
        _after_previous(PDL)  # the chunk histograms of pass P - 1 (the scores were two launches back)
    if n > K:
        if P == 0:
            prefix = tl.full([], 0, tl.uint32)
        else:
            prefix, k_rem = _prefix_through(hist_ptr, state_ptr, t, T, K, n_chunks, P, CB)
            if c == 0:
                tl.store(state_ptr + (t * 4 + P) * 2, prefix.to(tl.int32, bitcast=True))
                tl.store(state_ptr + (t * 4 + P) * 2 + 1, k_rem)
        tl.store(hist_ptr + ((P * T + t) * n_chunks + c) * 256 + tl.arange(0, 256),
                 _digit_hist_block(key, m, prefix, P))


@triton.jit
def _topk_compact_kernel(scores_ptr, stride_st, pos_ptr, hist_ptr, state_ptr, out_ptr, stride_ot, T, K, S_MAX,
                         n_chunks, CHUNK: tl.constexpr, CB: tl.constexpr, PDL: tl.constexpr):
    """Program (t, c): write chunk c's selected positions of row t at their place in the row's output. The
    chunks before c took every key above the threshold (counted from their histograms: a key above it is
    above it at one digit) and, in position order, the first of the keys equal to it."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.minimum(tl.load(pos_ptr + t) + 1, S_MAX).to(tl.int32)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < n
    out_idx = out_ptr + t * stride_ot
    key = _ordered_key(tl.load(scores_ptr + t * stride_st + offs, mask=m & (n > K), other=float("-inf")))
    _after_previous(PDL)  # the histograms and state of the passes (the scores were launches back)
    if n <= K:
        tl.store(out_idx + offs, offs, mask=m)
        if c == 0:
            _pad(tl.maximum(n, 0), K, out_idx, CHUNK)
    else:
        threshold, n_eq = _prefix_through(hist_ptr, state_ptr, t, T, K, n_chunks, 4, CB)
        gt_before = tl.zeros([], tl.int32)
        eq_before = tl.zeros([], tl.int32)
        for p in tl.static_range(4):
            d = ((threshold >> (24 - 8 * p)) & 0xFF).to(tl.int32)
            gt, eq_before = _count_before(hist_ptr + (p * T + t) * n_chunks * 256, c, d, CB)
            gt_before += gt
        _take_block(key, offs, m, threshold, n_eq, gt_before + tl.minimum(eq_before, n_eq), eq_before, out_idx)


def _check_common(q_idx, weights, index_cache, block_table, req_indices, positions):
    T, H_I, D = check_tensor("q_idx", q_idx, shape=(None, None, None), dense_dims=1,
                             dtype=(torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)).shape
    fp8_keys = isinstance(index_cache, torch.Tensor) and index_cache.dtype == torch.uint8
    if q_idx.dtype == torch.float8_e4m3fn and not fp8_keys:
        raise ValueError(f"q_idx: fp8 queries score the FP8 key cache (uint8), got an index_cache of "
                         f"{getattr(index_cache, 'dtype', type(index_cache).__name__)}")
    if q_idx.dtype == torch.float8_e4m3fn and D < 32:
        raise ValueError(f"q_idx: fp8 queries need index_head_dim >= 32 (an 8-bit MMA's depth on sm_90), got {D}")
    for name, v in (("index_n_heads", H_I), ("index_head_dim", D)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"indexer_topk: {name} must be a power of two, got {v}")
    check_tensor("weights", weights, shape=(T, H_I), dtype=torch.float32, dense_dims=1)
    if fp8_keys:  # DeepGEMM's FP8 keys: each block's bytes in one piece
        check_tensor("index_cache", index_cache, shape=(None, None, D + 4), dense_dims=2)
        if index_cache.stride(0) % 16 or index_cache.data_ptr() % 16:
            raise ValueError(f"index_cache: fp8 blocks must start 16 bytes apart and aligned, got strides "
                             f"{tuple(index_cache.stride())} at address {index_cache.data_ptr():#x}")
    else:
        check_tensor("index_cache", index_cache, shape=(None, None, D), dtype=q_idx.dtype, dense_dims=1)
    if index_cache.shape[1] < 1:
        raise ValueError(f"index_cache: expected a block size (dim 1) >= 1, got shape {list(index_cache.shape)}")
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


def _check_pow2(caller: str, **values) -> None:
    for name, v in values.items():
        if not is_int(v) or v < 1 or v & (v - 1):
            raise ValueError(f"{caller}: {name} must be a power of two, got {v!r}")


def scores_tiles(rows: int, s_max: int, block_s: int, sms: int) -> int:
    """Key tiles per program: the most (a power of two, at most 16) that leaves more than one program per SM for
    `rows` token groups (an H200 tune, in the git history: with scores_stages, within 3 % of the best of the
    tile counts and depths it tried at every benchmarked case). Depends on shapes only (fixed within a graph)."""
    n_tiles = triton.cdiv(s_max, block_s)
    tiles = 1
    while tiles < 16 and rows * triton.cdiv(n_tiles, 2 * tiles) > sms:
        tiles *= 2
    return tiles


def scores_stages(tiles: int, tokens: int, programs: int, sms: int) -> int:
    """How deep a program pipelines its key-tile loads: 1 for one tile (nothing to overlap); 3 where the third
    buffer costs no residency: every program resident at once (at most two per SM), or a token group (its query's
    shared memory already holds it to two per SM); else 2 (more programs than that queue, and a 16 KiB buffer
    fewer keeps one more of them resident per SM). An H200 tune, in the git history."""
    if tiles == 1:
        return 1
    return 3 if tokens > 1 or programs <= 2 * sms else 2


def scores_tokens(T: int, H_I: int) -> int:
    """Tokens per program: one below 256 tokens (decode and short prefills: more programs beat shared reads), else
    as many as fill 256 MMA columns with their heads (a key tile read once for all of them): 4 at DeepSeek-V3.2's
    64 heads, 8 at GLM-5.2's 32 (an H200 probe, in the git history, found 4 slower at 64 tokens)."""
    return 1 if T < 256 else max(1, 256 // H_I)


WIDE_TILE_PROGRAMS = 8  # programs an SM that 128-key tiles must still make (scores_block)


def scores_block(fp8_keys: bool, fp8_queries: bool, tokens: int, heads: int, groups: int, s_max: int,
                 sms: int) -> int:
    """Keys per tile: 64, or 128 for fp8 queries over DeepGEMM's FP8 keys a token a program (decode, and prefills
    under 256 tokens) at up to 32 heads, where such tiles still make WIDE_TILE_PROGRAMS programs an SM. A 128-key
    tile moves about the bytes of 64 bf16 keys (16.5 against 16 KiB) in half the steps; over 64-token cache blocks
    it spans two, and each key looks up its own block. An H100 A/B (in the git history) found it faster at 32 heads
    and 2048 programs or more, slower at 256 programs (half the programs of 64-key tiles, too few to fill the SMs)
    and at 64 heads (187 registers a thread, built for sm_90a: two programs an SM); between 256 and 2048 programs
    (where the threshold of 8 an SM falls) nothing was timed. Queries of another dtype convert
    the keys to it: a 128-key tile would hold two to four times those bytes, and was not timed."""
    if not (fp8_keys and fp8_queries and tokens == 1 and heads <= 32):
        return 64
    programs = groups * triton.cdiv(s_max, 128 * scores_tiles(groups, s_max, 128, sms))  # the launcher's grid
    return 128 if programs >= WIDE_TILE_PROGRAMS * sms else 64


def indexer_scores_paged(q_idx, weights, index_cache, block_table, req_indices, positions, softmax_scale,
                         scores, block_s: int | None = None, num_warps: int = 4, tiles: int | None = None,
                         num_stages: int | None = None, num_sms: int | None = None, tokens: int | None = None):
    """scores[t, s] = sum_h weights[t, h] relu(q_idx[t, h] . k[s] * softmax_scale) for s <= positions[t].

    q_idx [T, H_I, D]; weights fp32 [T, H_I]; index_cache [NB, BS, D] in q_idx's dtype, or uint8 [NB, BS, D + 4]:
    DeepGEMM's FP8 keys (its [NB, BS, 1, D + 4] without the head dim; dsv32ref.reference.fp8_cache), each key's
    fp8 values times its fp32 scale, scored by float queries or by fp8 e4m3 ones (their scales in weights);
    scores fp32 [T, S_MAX] (caller-owned; entries past a token's position are left untouched). S_MAX must exceed
    every position.
    tokens: consecutive tokens per program (default scores_tokens(T, H_I)); tokens of one request share each
    key tile's read. A group that spans requests takes each of them in turn with the other tokens' columns
    masked, so a batch of one token per request (decode) should pass 1: its groups would share nothing and
    multiply `tokens` times the columns they use.
    block_s: keys per tile (default: scores_block). tiles: key tiles per program (default: scores_tiles); their
    loads are pipelined num_stages deep (default: scores_stages).
    """
    T, H_I, D = _check_common(q_idx, weights, index_cache, block_table, req_indices, positions)
    check_tensor("scores", scores, shape=(T, None), dtype=torch.float32, device=q_idx.device, dense_dims=1)
    check_fp32_scale("indexer_scores_paged: softmax_scale", softmax_scale)
    tokens = scores_tokens(T, H_I) if tokens is None else tokens
    _check_pow2("indexer_scores_paged", num_warps=num_warps, tokens=tokens)
    sms = _num_sms(q_idx.device, num_sms, "indexer_scores_paged")
    if block_s is None:
        block_s = scores_block(index_cache.dtype == torch.uint8, q_idx.dtype == torch.float8_e4m3fn, tokens, H_I,
                               triton.cdiv(T, tokens), scores.shape[1], sms)
    _check_pow2("indexer_scores_paged", block_s=block_s)
    if block_s > 1024 or num_warps > 16:  # a key tile holds block_s x D values; a program at most 16 warps
        raise ValueError(f"indexer_scores_paged: block_s must be at most 1024 and num_warps at most 16, got "
                         f"{block_s} and {num_warps}")
    if tokens * H_I > 256:  # (the H200 build scored 512 columns wrong; not understood, so refused)
        raise ValueError(f"indexer_scores_paged: tokens x index_n_heads must be at most 256 MMA columns, got "
                         f"{tokens} x {H_I} = {tokens * H_I}")
    if tiles is not None:
        _check_pow2("indexer_scores_paged", tiles=tiles)
    if num_stages is not None and (not is_int(num_stages) or num_stages < 1):
        raise ValueError(f"indexer_scores_paged: num_stages must be None or an int >= 1, got {num_stages!r}")
    if device_value_checks_on():
        check_disjoint("indexer_scores_paged", {"scores": scores},
                       dict(q_idx=q_idx, weights=weights, index_cache=index_cache, block_table=block_table,
                            req_indices=req_indices, positions=positions))
        check_range("positions", positions, 0, scores.shape[1], "scores.shape[1]")
    if T:
        groups = triton.cdiv(T, tokens)
        tiles = tiles or scores_tiles(groups, scores.shape[1], block_s, sms)
        grid = (groups, triton.cdiv(scores.shape[1], block_s * tiles))
        num_stages = num_stages or scores_stages(tiles, tokens, grid[0] * grid[1], sms)
        launch(_indexer_scores_kernel, grid,
            q_idx, q_idx.stride(0), q_idx.stride(1), weights, weights.stride(0),
            index_cache, index_cache.stride(0), index_cache.stride(1),
            block_table, block_table.stride(0), req_indices, positions, scores, scores.stride(0),
            softmax_scale, index_cache.shape[1],
            T, scores.shape[1], block_table.shape[0], block_table.shape[1], index_cache.shape[0],
            H_I=H_I, D=D, BLOCK_S=block_s, TILES=tiles, TOKENS=tokens,
            TILE_IN_BLOCK=index_cache.shape[1] % block_s == 0, FP8=index_cache.dtype == torch.uint8,
            FP8_Q=q_idx.dtype == torch.float8_e4m3fn, FLAG_NAN=q_idx.device.type != "cuda",
            PRECISION=dot_precision(q_idx.dtype, q_idx.device), num_warps=num_warps, num_stages=num_stages,
        )
    return scores


def topk_chunk(rows: int, s_max: int) -> int:
    """Positions per program of the chunked top-k (the best of an H200 probe, in the git history): about 32
    chunks per row, and with many rows at most 256 programs per pass up to 4096 per chunk (each program of a
    pass reads every chunk histogram of its row); at least 1024, at most 16384 (one block)."""
    per_row = triton.next_power_of_2(triton.cdiv(s_max, 32))
    per_pass = min(4096, triton.next_power_of_2(triton.cdiv(rows * s_max, 256)))
    return min(16384, max(1024, per_row, per_pass))


def topk_from_scores(scores, positions, out, block: int = 4096, num_warps: int = 8, chunk: int | None = None,
                     split_below_rows: int = 128, split_above: int = 16384, pdl: bool | None = None):
    """out[t] = the top out.shape[1] of scores[t, :positions[t] + 1] (int32, increasing, -1 padded).

    With fewer than `split_below_rows` rows wider than `split_above`, one program per row would leave the
    GPU idle: each row is cut into `chunk`-long pieces (default topk_chunk(T, S_MAX)) and each radix pass runs
    over all of them (five launches: four histogram passes, one compaction; 4 warps per program from 16
    rows on). The choice depends only on the shapes, so it is fixed within a captured graph.
    """
    T = check_tensor("scores", scores, shape=(None, None), dtype=torch.float32, dense_dims=1).shape[0]
    check_tensor("positions", positions, shape=(T,), dtype=(torch.int64, torch.int32), device=scores.device,
                 dense_dims=1)
    K = check_tensor("out", out, shape=(T, None), dtype=torch.int32, device=scores.device, dense_dims=1).shape[1]
    chunk = topk_chunk(T, scores.shape[1]) if chunk is None else chunk
    _check_pow2("topk_from_scores", block=block, chunk=chunk, num_warps=num_warps)
    for name, v, most in (("chunk", chunk, 16384), ("block", block, 16384), ("num_warps", num_warps, 16)):
        if v > most:  # chunk: one block a program; block: its scores in registers
            raise ValueError(f"topk_from_scores: {name} must be at most {most}, got {v}")
    for name, v in (("split_below_rows", split_below_rows), ("split_above", split_above)):
        if not is_int(v) or v < 0:
            raise ValueError(f"topk_from_scores: {name} must be an int >= 0, got {v!r}")
    pdl = _pdl(scores.device, pdl, "topk_from_scores")
    if device_value_checks_on():
        check_disjoint("topk_from_scores", {"out": out}, {"scores": scores, "positions": positions})
        check_range("positions", positions, 0, scores.shape[1], "scores.shape[1]")
    if T == 0:
        return out
    if T >= split_below_rows or scores.shape[1] <= split_above:
        launch(_topk_kernel, (T,), scores, scores.stride(0), positions, out, out.stride(0), K, scores.shape[1],
               BLOCK=block, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
        return out
    n_chunks = triton.cdiv(scores.shape[1], chunk)
    cb = min(32, triton.next_power_of_2(n_chunks))
    warps = num_warps if T < 16 else min(num_warps, 4)
    work = torch.empty(4 * T * n_chunks * 256 + T * 8, dtype=torch.int32, device=scores.device)
    hist, state = work[: 4 * T * n_chunks * 256], work[4 * T * n_chunks * 256:]  # [4, T, n_chunks, 256], [T, 4, 2]
    for p in range(4):
        launch(_topk_hist_kernel, (T, n_chunks), scores, scores.stride(0), positions, hist, state, T, K,
               scores.shape[1], n_chunks, P=p, CHUNK=chunk, CB=cb, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    launch(_topk_compact_kernel, (T, n_chunks), scores, scores.stride(0), positions, hist, state, out, out.stride(0),
           T, K, scores.shape[1], n_chunks, CHUNK=chunk, CB=cb, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


def indexer_topk_paged(q_idx, weights, index_cache, block_table, req_indices, positions, softmax_scale,
                       scores, out, block_s: int | None = None):
    """Both steps: the caller owns `scores` fp32 [T, S_MAX] (workspace) and `out` int32 [T, index_topk]."""
    indexer_scores_paged(q_idx, weights, index_cache, block_table, req_indices, positions, softmax_scale,
                         scores, block_s)
    return topk_from_scores(scores, positions, out)
