"""Sparse MLA attention over top-k indices on the paged latent cache (absorbed MQA form). Graph-safe.

Motivation. After the indexer, each query token attends to index_topk = 2048 of its sequence's tokens.
In the absorbed form all H heads share one latent row per key, [c_kv (D_LAT) | k_pe (D_ROPE)], and V is
c_kv itself: a program loads a tile of gathered latent rows once and uses it for a block of heads, twice
(QK^T, then PV). Nothing on the host depends on the data: the grid is (tokens, head blocks, top-k splits),
sequence lengths and block tables are read on the device, so the launch can be captured in a CUDA graph.

Work per query token (DeepSeek-V3.2: H = 128, k = 2048, D_LAT = 512, D_ROPE = 64):
    FLOPs  = 2 H k (D_LAT + D_ROPE) [QK] + 2 H k D_LAT [PV]          = 570 MFLOP
    bytes >= k (D_LAT + D_ROPE) * 2 [gathered rows, bf16] + H (D_LAT + D_ROPE + D_LAT) * 2 [q, out]
           = 2.36 MB + 0.28 MB
so about 216 FLOP/byte at H = 128: past the H200's ridge (160-185 FLOP/B measured): compute-bound. At GLM-5.2's
H = 64, half the FLOPs over the same rows: memory-bound if every gathered row comes from HBM (decode batches);
in a long prefill the rows are shared by many tokens and sit in L2, and the compute bound applies.

FP8 cache (FlashMLA's rows, dsv32ref.reference.fp8_cache): 656 bytes per gathered row instead of 1152, so a
memory-bound decode reads 57 % of the bytes. Each step loads the fp8 values, their four scales and k_pe, and
forms c_kv = fp8 x scale in q's dtype (exact: the scales are powers of two) before the same MMAs. (On sm_90 the
warp-specialized kernels' producers do that work into shared memory instead, off the MMAs' path.)

The program. One program owns BLOCK_H = 64 heads of one token (a DeepSeek-V3.2 token takes two) and walks its
top-k BLOCK_N = 64 keys at a time, as the fused-attention tutorial walks K/V blocks:
    resolve    the program's top-k slice to cache rows, once, into an int32 workspace (below);
    each step  gather the step's 64 latent rows, S = q K^T, online softmax, O += P V (`_attend`);
    finish     O / l and the logsumexp, or fp32 partials when the top-k is split across programs (decode).
Two warpgroups share a program: each owns 256 of the 512 output columns in PV and 32 of the 64 keys in QK^T.

Addresses. A key's row is block_table[top-k index / BS] * rows_per_block + index % BS: two dependent loads.
Resolved inside the loop, each thread chains ~16 of them per step, which the compiler serialises under register
pressure; that, not bandwidth, was the kernel's limit (the sweep that showed it is in the git history). Here
they are resolved once per program before the loop, and each step reads the next step's rows while it computes
this one.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv32ref.cache import LATENT_ROW_BYTES
from dsv32ref.checks import (check_bool, check_disjoint, check_fp32_scale, check_keys, check_range, check_same_device,
                             check_tensor, device_value_checks_on, is_int, shown)
from dsv32ref.kernels.fp8 import cast, load_e4m3
from dsv32ref.kernels.grid import dot_precision, mma
from dsv32ref.kernels.grid import num_sms as _num_sms
from dsv32ref.kernels.launch import launch

try:  # the warp-specialized Gluon kernels that sm_90 runs (need triton.experimental.gluon)
    from dsv32ref.kernels import sparse_mla_heads_n as _heads_n
    from dsv32ref.kernels import sparse_mla_hopper as _hopper
    from dsv32ref.kernels import sparse_mla_pairs as _pairs
except ImportError:  # an older triton: every device runs the Triton kernel below
    _hopper = _heads_n = _pairs = None

__all__ = ["sparse_mla_paged", "DEFAULT_CONFIG", "FEW_KEYS", "few_keys_launch", "kernel_choice", "launch_plan",
           "merge_splits"]


SLOT_CHUNK = tl.constexpr(2048)  # top-k entries resolved to cache rows per step of the prologue


@triton.jit
def _token_keys(req_ptr, seq_lens_ptr, t, K, B, max_blocks, block_size, VALID_FIRST: tl.constexpr):
    """-> (token t's request, its length, the end of the top-k slots to visit). sparse_mla_hopper._program_steps
    computes the same in Gluon: which launch takes a few-keys token rests on the two agreeing."""
    req = tl.load(req_ptr + t)
    # A request index outside [0, B) attends to nothing; a sequence longer than its block-table row (or
    # negative) is cut to what the row can address.
    seq_len = tl.load(seq_lens_ptr + req, mask=(req >= 0) & (req < B), other=0)
    seq_len = tl.maximum(tl.minimum(seq_len, max_blocks * block_size), 0)
    # With VALID_FIRST the caller promises the valid indices come first (the indexer's output): at most
    # seq_len of the K slots need visiting. A short prompt then skips most of the 2048 slots.
    k_end = tl.minimum(K, seq_len) if VALID_FIRST else K
    return req, seq_len, k_end


@triton.jit
def _program_keys(req_ptr, seq_lens_ptr, t, split, K, B, max_blocks, block_size,
                  BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, VALID_FIRST: tl.constexpr):
    """-> (request, its length, end of the top-k slots to visit, first step, end step) of this program."""
    req, seq_len, k_end = _token_keys(req_ptr, seq_lens_ptr, t, K, B, max_blocks, block_size, VALID_FIRST)
    steps = tl.cdiv(k_end, BLOCK_N)
    per_split = tl.cdiv(steps, NUM_SPLITS)
    it0 = split * per_split
    return req, seq_len, k_end, it0, tl.minimum(it0 + per_split, steps)


@triton.jit
def _resolve_rows(idx_row_ptr, bt_row_ptr, rows_row_ptr, k0, k1, seq_len, block_size, rows_per_block, num_blocks):
    """Top-k slots [k0, k1) of one token -> their rows in the cache (in units of its row stride), -1 where the
    index is outside [0, seq_len) or its block id outside [0, num_blocks): never read."""
    for k in tl.range(k0, k1, SLOT_CHUNK):
        offs = k + tl.arange(0, SLOT_CHUNK)
        idx = tl.load(idx_row_ptr + offs, mask=offs < k1, other=-1)
        ok = (idx >= 0) & (idx < seq_len)
        pos = tl.where(ok, idx, 0)
        blk = tl.load(bt_row_ptr + pos // block_size, mask=ok, other=0)
        ok = ok & (blk >= 0) & (blk < num_blocks)
        tl.store(rows_row_ptr + offs, tl.where(ok, blk * rows_per_block + pos % block_size, -1), mask=offs < k1)


@triton.jit
def _step_rows(rows_row_ptr, it, k_end, stride_cs, BLOCK_N: tl.constexpr):
    """Step it's BLOCK_N keys -> (element offsets of their latent rows int64, valid mask)."""
    offs = it * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.load(rows_row_ptr + offs, mask=offs < k_end, other=-1)
    return row.to(tl.int64) * stride_cs, row >= 0


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
def _gather_keys(cache_ptr, row, valid, dtype: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
                 FP8: tl.constexpr, FLAG_NAN: tl.constexpr):
    """The step's latent rows at element offsets row (BLOCK_N,) -> (c_kv (BLOCK_N, D_LAT), k_pe (BLOCK_N, D_ROPE))
    in dtype. FP8: the cache is bytes, FlashMLA's rows [c_kv fp8 e4m3 (D_LAT) | D_LAT / 128 fp32 scales | k_pe
    bf16 (D_ROPE)]; c_kv = fp8 x its group's scale, formed in dtype (exact for bf16 and fp32: a power-of-two
    scale), as FlashMLA's decode does before its bf16 MMAs."""
    offs_lat = tl.arange(0, D_LAT)
    offs_rope = tl.arange(0, D_ROPE)
    if FP8:
        base = cache_ptr + row  # (BLOCK_N,) byte pointers to the rows
        vals, nan = load_e4m3(base[:, None] + offs_lat[None, :], valid[:, None], FLAG_NAN)  # (BLOCK_N, D_LAT)
        scale = tl.load((base + D_LAT).to(tl.pointer_type(tl.float32))[:, None] + tl.arange(0, D_LAT // 128)[None, :],
                        mask=valid[:, None], other=0.0)  # (BLOCK_N, D_LAT / 128)
        if FLAG_NAN:  # a NaN in a row: its scores NaN, as the reference gives (compiled, the conversion gives them)
            scale = tl.where(nan[:, None], float("nan"), scale)
        groups = tl.reshape(vals.to(dtype), (vals.shape[0], D_LAT // 128, 128))  # (BLOCK_N, D_LAT / 128, 128)
        k_lat = tl.reshape(groups * scale.to(dtype)[:, :, None], (vals.shape[0], D_LAT))  # (BLOCK_N, D_LAT)
        k_pe = tl.load((base + D_LAT + 4 * (D_LAT // 128)).to(tl.pointer_type(tl.bfloat16))[:, None] +
                       offs_rope[None, :], mask=valid[:, None], other=0.0).to(dtype)  # (BLOCK_N, D_ROPE)
    else:
        k_lat = tl.load(cache_ptr + row[:, None] + offs_lat[None, :], mask=valid[:, None], other=0.0)  # (BLOCK_N, D_LAT)
        k_pe = tl.load(cache_ptr + row[:, None] + D_LAT + offs_rope[None, :], mask=valid[:, None], other=0.0)  # (BLOCK_N, D_ROPE)
    return k_lat, k_pe


@triton.jit
def _attend(q_row, h_mask, cache_ptr, row, valid, m_i, l_i, acc, sm_scale_log2, seq_len,
            D_LAT: tl.constexpr, D_ROPE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
            FLAG_NAN: tl.constexpr):
    """One step over BLOCK_N keys: gather their latent rows, S = q K^T, online softmax, O += P V with V = c_kv.
    Per step at BLOCK_H = BLOCK_N = 64 (bf16): 72 KiB gathered, 4.7 MFLOP in QK^T, 4.2 MFLOP in PV."""
    offs_lat = tl.arange(0, D_LAT)
    offs_rope = tl.arange(0, D_ROPE)
    # q is read again every step (from L1): a query tile held across the loop beside the branch below makes
    # triton 3.6's software pipeliner fail.
    q_lat = tl.load(q_row + offs_lat[None, :], mask=h_mask[:, None], other=0.0)  # (BLOCK_H, D_LAT)
    q_pe = tl.load(q_row + D_LAT + offs_rope[None, :], mask=h_mask[:, None], other=0.0)  # (BLOCK_H, D_ROPE)
    # (interpreted, bf16 arithmetic is wrong: the keys are formed in fp32, as mma multiplies them)
    kv_dtype: tl.constexpr = tl.float32 if PRECISION == "upcast" else q_lat.dtype
    k_lat, k_pe = _gather_keys(cache_ptr, row, valid, kv_dtype, D_LAT, D_ROPE, FP8, FLAG_NAN)
    # QK^T as two dots scaled before they are summed (an add of two dot results would fold into one dot).
    s = mma(q_lat, tl.trans(k_lat), PRECISION) * sm_scale_log2 + \
        mma(q_pe, tl.trans(k_pe), PRECISION) * sm_scale_log2  # (BLOCK_H, BLOCK_N)
    # A sequence with no keys leaves the state as it is. The branch is there for the layout as much: Triton
    # lays out a dot whose result flows into another dot in the same region (S -> P -> PV) with every warp
    # along the rows, so that the softmax's row reductions stay inside a warp; with 64 heads both warpgroups
    # would then compute all of S (twice the QK^T MMAs). Behind the branch the QK^T dots count as unchained
    # and the warpgroups take 32 keys each; Triton adds the cross-warpgroup row reductions and hands P to PV
    # through shared memory.
    if seq_len > 0:
        p, m_new, alpha, l_i = _online_softmax(s, valid, m_i, l_i)
    else:  # the same (every key is invalid here): Triton needs both arms to define the results
        p, m_new, alpha, l_i = _online_softmax(s, valid, m_i, l_i)
    # P in the rows' dtype (the interpreter truncates it to bf16 where the GPU rounds: within the comparator's
    # bf16 tolerance, and not worth integer rounding on the hot path)
    acc = acc * alpha[:, None] + mma(p.to(k_lat.dtype), k_lat, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _finish(acc, m_i, l_i, t, offs_h, h_mask, split, H, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
            D_LAT: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """O / l and the natural-log logsumexp (+inf where no key was valid); fp32 partials with splits."""
    # l_i is 0 exactly when no valid key scored above -inf; NaN when a score was NaN or +inf (a non-finite
    # query or key row), which then reaches out and lse as NaN, as in the reference.
    has_key = l_i != 0
    out = acc * (1.0 / tl.where(has_key, l_i, 1.0))[:, None]  # a division a head, then a multiply an element
    lse = (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453
    offs_d = tl.arange(0, D_LAT)
    if NUM_SPLITS > 1:  # partials in fp32; a head without a valid key here: lse -inf, its out not written
        o_ptrs = out_ptr + ((t * H + offs_h[:, None]) * NUM_SPLITS + split) * D_LAT + offs_d[None, :]
        tl.store(o_ptrs, out, mask=(h_mask & has_key)[:, None])
        tl.store(lse_ptr + (t * H + offs_h) * NUM_SPLITS + split, tl.where(has_key, lse, float("-inf")), mask=h_mask)
    else:
        o_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, cast(out, out_ptr.dtype.element_ty), mask=h_mask[:, None])
        tl.store(lse_ptr + t * stride_lt + offs_h, tl.where(has_key, lse, float("inf")), mask=h_mask)


@triton.jit
def _sparse_mla_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, H, D_LAT + D_ROPE]
    cache_ptr, stride_cb, stride_cs,  # latent cache [NB, BS, D_LAT + D_ROPE]; FP8: bytes [NB, BS, 656]
    block_table_ptr, stride_bt,  # [B, max_blocks]
    req_ptr, seq_lens_ptr,  # [T], [B]
    idx_ptr, stride_it,  # top-k [T, K] int32 (token positions, -1 = none)
    out_ptr, stride_ot, stride_oh,  # out [T, H, D_LAT]; with splits: partial out fp32 [T, H, NUM_SPLITS, D_LAT]
    lse_ptr, stride_lt,  # lse [T, H] fp32; with splits: partial lse [T, H, NUM_SPLITS]
    rows_ptr,  # int32 workspace [T, K]: each top-k entry's row in the cache, in units of stride_cs (-1: skip)
    sm_scale_log2,  # sm_scale * log2(e): softmax in base 2
    H, K, block_size, rows_per_block,  # rows_per_block = stride_cb / stride_cs
    B, max_blocks, num_blocks,  # bounds of req_indices, of a block-table row, of block ids (masked, never read)
    keys_lo, keys_hi,  # the tokens this launch takes: those with keys_lo < (slots to visit) <= keys_hi
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr, VALID_FIRST: tl.constexpr, FP8: tl.constexpr,
    FLAG_NAN: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    split = tl.program_id(2)  # split-K: a slice of the top-k (decode)
    req, seq_len, k_end, it0, it1 = _program_keys(req_ptr, seq_lens_ptr, t, split, K, B, max_blocks, block_size,
                                                  BLOCK_N, NUM_SPLITS, VALID_FIRST)
    if (k_end <= keys_lo) | (k_end > keys_hi):  # the other launch's token (sparse_mla_paged's few-keys launch)
        return
    # Resolve this program's slice of the top-k to cache rows once (two dependent loads per entry), so each
    # step needs one independent, contiguous load before its gather. The head blocks of a token each resolve
    # the same slice and write the same values: cheaper than coordinating programs.
    rows_row_ptr = rows_ptr + t * K
    _resolve_rows(idx_ptr + t * stride_it, block_table_ptr + req * stride_bt, rows_row_ptr, it0 * BLOCK_N,
                  tl.minimum(it1 * BLOCK_N, k_end), seq_len, block_size, rows_per_block, num_blocks)
    tl.debug_barrier()  # this program's writes are visible to all its threads

    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
    row, valid = _step_rows(rows_row_ptr, it0, k_end, stride_cs, BLOCK_N)
    for it in tl.range(it0, it1):
        row_next, valid_next = _step_rows(rows_row_ptr, it + 1, k_end, stride_cs, BLOCK_N)  # in flight meanwhile
        m_i, l_i, acc = _attend(q_row, h_mask, cache_ptr, row, valid, m_i, l_i, acc, sm_scale_log2, seq_len,
                                D_LAT, D_ROPE, PRECISION, FP8, FLAG_NAN)
        row, valid = row_next, valid_next
    _finish(acc, m_i, l_i, t, offs_h, h_mask, split, H, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
            D_LAT, NUM_SPLITS)


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, H,
                           req_ptr, seq_lens_ptr, K, B, max_blocks, block_size, few_keys,
                           NUM_SPLITS: tl.constexpr, D_LAT: tl.constexpr, SKIP_FEW: tl.constexpr):
    """out[t, h] = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse); lse = max + log(sum w). A split whose
    lse is -inf saw no valid key (weight 0) and its out partial is not read: the kernels may leave it unwritten (the
    Triton kernel and sparse_mla_hopper's epilogue do). A short prompt's token has most splits empty (8 keys with the
    valid indices first: one split of 16 holds them), so this drops most of the merge's reads. SKIP_FEW: a token
    with at most few_keys top-k slots to visit (valid first) is the few-keys launch's, which wrote its out and lse:
    its partials were not written and it is left as it is."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if SKIP_FEW:
        _, _, k_end = _token_keys(req_ptr, seq_lens_ptr, t, K, B, max_blocks, block_size, True)
        if k_end <= few_keys:
            return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D_LAT)
    lse_s = tl.load(part_lse_ptr + (t * H + h) * NUM_SPLITS + offs_s)  # (S,)
    nan_s = lse_s != lse_s  # a split that saw a NaN / +inf score: the result is NaN
    m = tl.max(tl.where(nan_s, float("-inf"), lse_s), axis=0)
    any_key = (m > float("-inf")) | (tl.max(nan_s.to(tl.int32), axis=0) > 0)
    w = tl.exp(lse_s - tl.where(m > float("-inf"), m, 0.0))  # (S,); 0 for empty splits, NaN for NaN ones
    o_s = tl.load(part_o_ptr + ((t * H + h) * NUM_SPLITS + offs_s[:, None]) * D_LAT + offs_d[None, :],
                  mask=(lse_s != float("-inf"))[:, None], other=0.0)  # (S, D_LAT); NaN splits read
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o_s, axis=0) / tl.where(any_key, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, cast(out, out_ptr.dtype.element_ty))
    tl.store(lse_ptr + t * stride_lt + h, tl.where(any_key, m + tl.log(tl.where(any_key, total, 1.0)), float("inf")))


# Tiles: BLOCK_H heads x BLOCK_N keys per step; num_stages - 1 key tiles in flight (cp.async) while one is
# used. The bf16 default is the best of the H200 runs (data/kernels.json, notebook 02). fp32 tiles take
# twice the shared memory: smaller ones, no multi-stage buffering.
DEFAULT_CONFIG = dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2)
FP32_CONFIG = dict(BLOCK_H=32, BLOCK_N=16, num_warps=4, num_stages=1)
# FP8 rows are dequantised in registers on their way to the MMA: 32-key steps, the tile that compiles for sm_90a
# without spills (scripts/sass_sparse_mla.py; 64-key steps spill). Not yet timed against FlashMLA's kernel.
FP8_CONFIG = dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)
CONFIG_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "NUM_SPLITS")
CONFIG_MOST = dict(BLOCK_H=128, BLOCK_N=256, num_warps=16, num_stages=8)  # bounds past any tile tuned or tested
# Few keys. A step of a few tokens may hold tokens with few keys to visit (an 8-token prompt's have 1 to 8): a
# program of 64 heads (the sm_90 kernels', DEFAULT_CONFIG's) is then one long latency chain, on as many SMs as
# there are tokens. Such a step launches twice: the tokens with at most FEW_KEYS top-k slots to visit (valid first:
# min(K, seq_len), read on the device) in programs of 16 heads and one split (FEW_KEYS_CONFIG), every other token
# in the launch the plan chose, which leaves the few-keys tokens alone (as does its merge). Steps of at most
# FEW_KEYS_TOKENS tokens over more than FEW_KEYS_HEADS heads, valid-first top-k, no tile config given.
FEW_KEYS = 64
FEW_KEYS_TOKENS = 16
FEW_KEYS_HEADS = 32
FEW_KEYS_CONFIG = dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2)
FEW_KEYS_FP32_CONFIG = dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1)


def _check_fp8_cache(q, latent_cache, d_lat: int, d_rope: int) -> None:
    """FlashMLA's FP8 rows: uint8 [NB, BS, 656] (its [NB, BS, 1, 656] without the head dim), for a bf16 or fp32 q
    of DeepSeek-V3.2's widths; rows and blocks 16-byte aligned (the fp32 scales and bf16 k_pe are read in place)."""
    check_tensor("latent_cache", latent_cache, shape=(None, None, LATENT_ROW_BYTES), dtype=torch.uint8, dense_dims=1)
    if (d_lat, d_rope) != (512, 64):
        raise ValueError(f"sparse_mla_paged: an fp8 latent_cache holds FlashMLA's rows of kv_lora_rank 512 and "
                         f"qk_rope_head_dim 64, got {d_lat} and {d_rope}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q: expected bfloat16 or float32 with an fp8 latent_cache (fp8 x scale may overflow "
                         f"float16), got {q.dtype}")
    if latent_cache.stride(1) % 16 or latent_cache.stride(0) % 16 or latent_cache.data_ptr() % 16:
        raise ValueError(f"latent_cache: fp8 rows and blocks must start 16 bytes apart and aligned, got strides "
                         f"{tuple(latent_cache.stride())} at address {latent_cache.data_ptr():#x}")


def check_inputs(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale, out, lse):
    """The checks of sparse_mla_paged -> (T, H, D_LAT, D_ROPE, B)."""
    T, H, D = check_tensor("q", q, shape=(None, None, None), dtype=(torch.bfloat16, torch.float16, torch.float32),
                           dense_dims=1).shape
    if H < 1:
        raise ValueError(f"q: expected at least one head (dim 1), got shape {list(q.shape)}")
    d_lat = check_tensor("out", out, shape=(T, H, None), dtype=q.dtype, dense_dims=1).shape[-1]
    d_rope = D - d_lat
    for name, v in (("kv_lora_rank (out.shape[-1])", d_lat), ("qk_rope_head_dim (q.shape[-1] - out.shape[-1])", d_rope)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"sparse_mla_paged: {name} must be a power of two, got {v}")
    if isinstance(latent_cache, torch.Tensor) and latent_cache.dtype == torch.uint8:
        _check_fp8_cache(q, latent_cache, d_lat, d_rope)
    else:
        check_tensor("latent_cache", latent_cache, shape=(None, None, D), dtype=q.dtype, dense_dims=1)
    nb, bs = latent_cache.shape[:2]
    if bs < 1:
        raise ValueError(f"latent_cache: expected a block size (dim 1) >= 1, got shape {list(latent_cache.shape)}")
    if latent_cache.stride(1) == 0 or latent_cache.stride(0) % latent_cache.stride(1):
        raise ValueError(f"latent_cache: stride(0) must be a multiple of stride(1) > 0 (blocks a whole number of rows "
                         f"apart), got strides {tuple(latent_cache.stride())}")
    if nb * (latent_cache.stride(0) // latent_cache.stride(1)) >= 2 ** 31:
        raise ValueError(f"latent_cache: at most 2^31 rows (int32 row numbers), got {nb} blocks x "
                         f"{latent_cache.stride(0) // latent_cache.stride(1)} rows")
    B = check_tensor("seq_lens", seq_lens, shape=(None,), dtype=torch.int32, dense_dims=1).shape[0]
    check_tensor("block_table", block_table, shape=(B, None), dtype=torch.int32, dense_dims=1)
    check_tensor("req_indices", req_indices, shape=(T,), dtype=torch.int32, dense_dims=1)
    check_tensor("topk_indices", topk_indices, shape=(T, None), dtype=torch.int32, dense_dims=1)
    if lse is not None:
        check_tensor("lse", lse, shape=(T, H), dtype=torch.float32, dense_dims=1)
    check_fp32_scale("sparse_mla_paged: sm_scale", sm_scale, math.log2(math.e))  # the kernels scale by it in base 2
    if device_value_checks_on():  # debug mode (dsv32ref.checks.checking_device_values): syncs
        check_disjoint("sparse_mla_paged", {"out": out, "lse": lse},
                       dict(q=q, latent_cache=latent_cache, block_table=block_table, req_indices=req_indices,
                            seq_lens=seq_lens, topk_indices=topk_indices))
        check_range("req_indices", req_indices, 0, B, "seq_lens.shape[0]")
        check_range("seq_lens", seq_lens, 0, block_table.shape[1] * bs + 1, "block_table.shape[1] x block_size + 1")
        for b, n in enumerate(seq_lens.tolist()):
            check_range(f"block_table[{b}] (its first {-(-n // bs)} blocks)", block_table[b, : -(-n // bs)], 0, nb,
                        "latent_cache.shape[0]")
    check_same_device(q=q, latent_cache=latent_cache, block_table=block_table, req_indices=req_indices,
                      seq_lens=seq_lens, topk_indices=topk_indices, out=out, lse=lse)
    return T, H, d_lat, d_rope, B


def num_splits(T: int, head_blocks: int, sms: int) -> int:
    """Top-k splits per (token, head block): split only while the programs leave SMs idle. A bf16 program
    takes most of an SM's shared memory (one per SM), so splitting a full wave further adds waves and a
    combine, not parallelism. The largest power of two that keeps every program in one wave (the launcher caps
    it at 16 and at the top-k's steps)."""
    fill = sms // (T * head_blocks)
    return 1 << (fill.bit_length() - 1) if fill >= 2 else 1


def kernel_choice(q: torch.Tensor, d_lat: int, splits: int, config: dict | None, fp8: bool = False
                  ) -> tuple[str, str]:
    """(the kernel sparse_mla_paged runs, why): on sm_90 one of the warp-specialized Gluon kernels, "sm_90 heads
    as N" for at most 32 heads a token (dsv32ref.kernels.sparse_mla_heads_n), past them "sm_90 key pairs" over bf16
    rows (dsv32ref.kernels.sparse_mla_pairs, FlashMLA's pair schedule) or "sm_90 warp-specialized" over FP8 rows
    (dsv32ref.kernels.sparse_mla_hopper); elsewhere "triton" (the kernel of this module). fp8: the latent cache
    holds FlashMLA's FP8 rows."""
    if config:
        reason = "a tile config was given"
    elif _hopper is None:
        reason = f"triton {triton.__version__} has no triton.experimental.gluon"
    else:
        reason = _hopper.why_not(q, d_lat, q.shape[-1] - d_lat)
    if reason is not None:
        return "triton", reason
    rows = "FP8 rows dequantised by the producer" if fp8 else "bf16 rows"
    H = q.shape[1]
    if H <= _heads_n.MAX_HEADS:
        return "sm_90 heads as N", (f"sm_90, bf16 q, {rows}, {H} heads: keys as the MMA's M, "
                                    f"{_heads_n.heads_per_program(H)} heads as its N, {splits} top-k split(s)")
    if fp8:
        return "sm_90 warp-specialized", f"sm_90, bf16 q, {rows}, 64 heads a program, {splits} top-k split(s)"
    return "sm_90 key pairs", (f"sm_90, bf16 q, {rows}, 64 heads a program, a pair of 64-key blocks a step (one per "
                               f"consumer warpgroup), {splits} top-k split(s)")


def launch_plan(q: torch.Tensor, d_lat: int, K: int, config: dict | None, sms: int, fp8: bool = False
                ) -> tuple[dict, int, int, bool]:
    """What sparse_mla_paged launches for q [T, H, D_LAT + D_ROPE] (T >= 1) and K top-k slots -> (tiles, heads
    per program, top-k splits, whether the warp-specialized Gluon kernel runs: `kernel_choice`). Shapes only,
    so it is fixed within a captured graph."""
    base = FP32_CONFIG if q.dtype == torch.float32 else FP8_CONFIG if fp8 else DEFAULT_CONFIG
    cfg = dict(base, **(config or {}))
    for key, most in CONFIG_MOST.items():  # tiles and warps: powers of two (tl.arange's, triton's), and bounded
        v = cfg[key]
        if not is_int(v) or v < 1 or v > most or (key != "num_stages" and v & (v - 1)):
            what = "an int" if key == "num_stages" else "a power of two"
            raise ValueError(f"sparse_mla_paged: config {key} must be {what} in [1, {most}], got {shown(v)}")
    T, H = q.shape[:2]
    block_h = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(H)))
    splits = cfg.get("NUM_SPLITS")
    if splits is None:
        splits = num_splits(T, triton.cdiv(H, block_h), sms)
    elif not is_int(splits) or splits < 1 or splits & (splits - 1):
        raise ValueError(f"sparse_mla_paged: NUM_SPLITS must be a power of two, got {splits!r}")
    splits = min(splits, 16, triton.next_power_of_2(triton.cdiv(K, cfg["BLOCK_N"])))
    return cfg, block_h, splits, kernel_choice(q, d_lat, splits, config, fp8)[0] != "triton"


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
    few_keys: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out[t, h] = softmax_j(sm_scale q[t, h] . kv_j) @ c_kv_j over the valid top-k keys of token t.

    q             [T, H, D_LAT + D_ROPE]   bf16 / fp16 / fp32 (the absorbed query [q~ | q_pe])
    latent_cache  [NB, BS, D_LAT + D_ROPE] same dtype, last dim contiguous; or uint8 [NB, BS, 656], FlashMLA's
                                           FP8 rows (dsv32ref.reference.fp8_cache; bf16 or fp32 q, 512 + 64 wide):
                                           dequantised in the kernel (fp8 x power-of-two scale, exact in q's dtype)
    block_table   int32 [B, max_blocks]; req_indices int32 [T]; seq_lens int32 [B]
    topk_indices  int32 [T, K]             token positions in the sequence; < 0 or >= seq_len: skipped
    out           [T, H, D_LAT]            written in place (caller-owned: graph-safe)
    lse           fp32 [T, H] or None      natural-log logsumexp; +inf where no key is valid
    Semantics are the reference's (dsv32ref.reference.sparse_mla): keys not selected are never read; a NaN or
    +inf score at a valid key (a non-finite query or key row) makes that (token, head)'s out and lse NaN.
    D_LAT is taken as out.shape[-1] (kv_lora_rank); both it and D_ROPE must be powers of two.
    valid_first   the valid indices of each row come first (as the indexer writes them): only the first
                  min(K, seq_len) slots are visited. Off by default (FlashMLA accepts any order).
    config        tiles (CONFIG_KEYS) over DEFAULT_CONFIG (FP32_CONFIG for fp32 inputs). Without one, an sm_90
                  GPU runs a warp-specialized Gluon kernel (`kernel_choice`: sparse_mla_heads_n up to 32 heads,
                  past them sparse_mla_pairs over bf16 rows and sparse_mla_hopper over FP8 ones) where they apply
                  (bf16 q, D_LAT 512, D_ROPE 64); with one, always the Triton kernel.
    When T x head blocks leaves SMs idle (decode), the top-k is split across NUM_SPLITS programs (`num_splits`,
    or config["NUM_SPLITS"], a power of two) and a second launch merges the partial results; the split count
    depends only on shapes, so it is fixed within a captured graph. `num_sms`: the SMs to fill (default: the
    device's; 4 for CPU tensors). Each launch of the Triton kernel allocates an int32 [T, K] workspace (the
    resolved rows).
    few_keys      with valid_first, no config, more than FEW_KEYS_HEADS heads and at most FEW_KEYS_TOKENS tokens:
                  the tokens with at most FEW_KEYS slots to visit in a launch of their own (FEW_KEYS). A step
                  whose tokens all have more keys (decode past its first steps) pays that launch for nothing, which
                  is why a caller that knows (the engine, at decode) turns it off.
    """
    check_keys("sparse_mla_paged: config", config, CONFIG_KEYS)
    check_bool("sparse_mla_paged: valid_first", valid_first)
    check_bool("sparse_mla_paged: few_keys", few_keys)
    T, H, d_lat, d_rope, B = check_inputs(q, latent_cache, block_table, req_indices, seq_lens, topk_indices,
                                          sm_scale, out, lse)
    sms, K = _num_sms(q.device, num_sms, "sparse_mla_paged"), topk_indices.shape[1]
    fp8 = latent_cache.dtype == torch.uint8
    if T == 0 or K == 0:  # no key selected: every head's out 0 and lse +inf, as the reference (no program would run)
        return out.zero_(), lse if lse is None else lse.fill_(float("inf"))
    plan = launch_plan(q, d_lat, K, config, sms, fp8)
    few = FEW_KEYS if few_keys and few_keys_launch(T, H, config, valid_first) else -1
    lse_arg = lse if lse is not None else torch.empty(T, H, dtype=torch.float32, device=q.device)
    _launch_kernels((q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale), out, lse_arg, plan,
                    few, valid_first)
    return out, lse


def _launch_kernels(inputs: tuple, out: torch.Tensor, lse: torch.Tensor, plan: tuple, few: int,
                    valid_first: bool) -> None:
    """The plan's launch (`launch_plan`) into out and lse, its merge with top-k splits, and with few >= 0 the
    few-keys launch (the tokens with at most `few` slots to visit, which the others leave alone)."""
    q, latent_cache, block_table, req_indices, seq_lens, topk_indices, _ = inputs
    cfg, block_h, splits, hopper = plan
    K = topk_indices.shape[1]
    if few < K:  # (no token has more than K slots to visit: with K <= few the few-keys launch takes them all)
        outputs = _kernel_outputs(out, lse, splits)
        if hopper:
            _sm90_launcher(q.shape[1], latent_cache.dtype == torch.uint8)(
                *inputs, outputs, splits, valid_first, **({"few_keys": few} if few >= 0 else {}))
        else:
            _launch_triton(*inputs, outputs, cfg, block_h, splits, valid_first, keys=(few, K))
        if splits > 1:  # the partials merged into out and lse
            merge_splits(outputs, out, lse, inputs, few)
    if few >= 0:  # the few-keys tokens, into out and lse
        small = FEW_KEYS_FP32_CONFIG if q.dtype == torch.float32 else FEW_KEYS_CONFIG
        _launch_triton(*inputs, _kernel_outputs(out, lse, 1), small, small["BLOCK_H"], 1, valid_first,
                       keys=(-1, few))


def few_keys_launch(T: int, H: int, config: dict | None, valid_first: bool) -> bool:
    """Whether sparse_mla_paged gives the step's tokens with few keys a launch of their own (FEW_KEYS)."""
    return config is None and valid_first and T <= FEW_KEYS_TOKENS and H > FEW_KEYS_HEADS


def merge_splits(outputs: tuple, out: torch.Tensor, lse: torch.Tensor, inputs: tuple | None = None,
                 few: int = -1) -> None:
    """The split path's second launch: the fp32 partials of `outputs` (_kernel_outputs) merged into out [T, H, D_LAT]
    and lse [T, H]. With few >= 0, the tokens with at most `few` top-k slots to visit (valid first) are the few-keys
    launch's and left as they are: inputs = sparse_mla_paged's (q, latent_cache, block_table, req_indices, seq_lens,
    topk_indices, sm_scale) tell which."""
    T, H, d_lat = out.shape
    part_o, part_lse = outputs[0], outputs[3]
    if few >= 0:
        _, latent_cache, table, req, seq_lens, topk, _ = inputs
        tokens = (req, seq_lens, topk.shape[1], seq_lens.shape[0], table.shape[1], latent_cache.shape[1], few)
    else:  # nothing to skip: the pointers are not read
        tokens = (part_lse, part_lse, 0, 0, 0, 1, -1)
    launch(_combine_splits_kernel, (T, H), part_o, part_lse, out, out.stride(0), out.stride(1), lse, lse.stride(0), H,
           *tokens, NUM_SPLITS=part_o.shape[2], D_LAT=d_lat, SKIP_FEW=few >= 0, num_warps=4)


def _sm90_launcher(H: int, fp8: bool):
    """The launcher of the Gluon kernel `kernel_choice` names for H heads a token and the cache's rows."""
    if H <= _heads_n.MAX_HEADS:
        return _heads_n.sparse_mla_heads_n
    return _hopper.sparse_mla_hopper if fp8 else _pairs.sparse_mla_pairs


def _kernel_outputs(out: torch.Tensor, lse_arg: torch.Tensor, splits: int) -> tuple:
    """Where the kernel writes: (out, its two strides, lse, its stride); with top-k splits, fp32 partials
    [T, H, splits, D_LAT] and [T, H, splits] instead (strides unused), which _combine_splits_kernel merges."""
    if splits == 1:
        return out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0)
    T, H, d_lat = out.shape
    return (torch.empty(T, H, splits, d_lat, dtype=torch.float32, device=out.device), 0, 0,
            torch.empty(T, H, splits, dtype=torch.float32, device=out.device), 0)


def _launch_triton(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale, outputs, cfg,
                   block_h, splits, valid_first, keys: tuple[int, int]) -> None:
    """This module's kernel into outputs (out, its strides, lse, its stride; or the fp32 partials with splits), for
    the tokens with keys[0] < (top-k slots to visit) <= keys[1]."""
    (T, H, D), K, B = q.shape, topk_indices.shape[1], seq_lens.shape[0]
    o_arg, o_s0, o_s1, l_arg, l_s0 = outputs
    d_lat = o_arg.shape[-1]
    head_blocks, d_rope = triton.cdiv(H, block_h), D - d_lat
    rows = torch.empty(T, K, dtype=torch.int32, device=q.device)
    launch(_sparse_mla_kernel, (T, head_blocks, splits),
        q, q.stride(0), q.stride(1),
        latent_cache, latent_cache.stride(0), latent_cache.stride(1),
        block_table, block_table.stride(0), req_indices, seq_lens,
        topk_indices, topk_indices.stride(0),
        o_arg, o_s0, o_s1,
        l_arg, l_s0,
        rows,
        sm_scale * math.log2(math.e), H, K, latent_cache.shape[1], latent_cache.stride(0) // latent_cache.stride(1),
        B, block_table.shape[1], latent_cache.shape[0], *keys,
        D_LAT=d_lat, D_ROPE=d_rope, BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"],
        PRECISION=dot_precision(q.dtype, q.device), NUM_SPLITS=splits, VALID_FIRST=valid_first,
        FP8=latent_cache.dtype == torch.uint8, FLAG_NAN=q.device.type != "cuda", num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
