"""sparse_mla on Hopper (sm_90), warp-specialized, in Gluon: what `sparse_mla_paged` runs there past 32 heads over
FlashMLA's FP8 rows. Graph-safe. Over bf16 rows it runs dsv32ref.kernels.sparse_mla_pairs, FlashMLA's pair schedule
in full, which gives each consumer warpgroup a whole 64-key block; the kernel benchmark times this one beside it.

The math, the semantics and the program (one token, 64 heads, the top-k walked 64 keys a step) are those of the
Triton kernel in dsv32ref.kernels.sparse_mla; this one writes out a schedule of FlashMLA's kind, which Triton's
compiler does not find for that kernel:

    producer   one warpgroup: q once, then for each step the 64 keys' cache rows (the top-k index through the
               block table, as the Triton kernel resolves them), their cp.async gather into a free stage, and
               the stage's 64 validity flags (1 byte each) stored beside it
    consumers  two warpgroups: per step wait for the stage, read its flags, S = q K^T, online softmax,
               O += P V, free the stage; they split S's 64 keys (32 each) and O's 512 columns (256 each), and
               load nothing from global memory in the loop
    hand-offs  mbarriers, one `ready` and one `free` per stage, instead of CTA-wide waits on copies. `ready`
               completes when every producer thread's copies have landed (cp.async arrives) and one producer
               thread has arrived after the warpgroup's barrier (a release: the flags' plain stores are
               visible to the consumers' acquiring wait); the consumers issue no copy

    shared memory (bf16): q 64 x 576 (72 KiB) + 2 stages of K 64 x 576 (144 KiB) + P 64 x 64 (8 KiB) = 224 KiB,
    and 2 x 64 B of flags

Per step: 72 KiB gathered, 4.7 MFLOP in QK^T and 4.2 MFLOP in PV (64 heads). The row sums of P accumulate per
element and are reduced once after the loop: a reduction across the warpgroups costs three CTA barriers a step,
and the row max already needs one. Its times beside the Triton kernel's, on the H200: data/kernels.json
(notebook 02).

FlashMLA's FP8 rows (656 bytes: fp8 c_kv, four fp32 scales, bf16 k_pe): the producer copies k_pe as it is and loads
each row's fp8 values and scales into registers, multiplies them out into bf16 (exact: power-of-two scales) and
stores them into the stage, so the consumers run unchanged on bf16 stages (FlashMLA's FP8 sparse decode also
dequantises to bf16 before its MMAs). A register load must land before its value is used, so the producer keeps the
whole step's c_kv in flight (32 KiB, 64 registers a thread) and hides the rest behind it: the step's loads are
issued before its stage is free, the next step's block-table loads and the top-k entries of the one after while they
fly: one memory latency a step, where resolving a step and then loading it chains three. The producer takes 120
registers (the consumers 192: with fewer they spill more than the 8 bytes they do; with fewer the producer spills,
triton 3.6).

At 64 heads a program this kernel's step is bound by its consumers more than by its bytes: on an H100, at 128
requests, its step over no rows (nothing loaded) took most of its step over selected bf16 rows, so FP8's rows,
whose dequantisation adds to the producer's part of a step, have little to win here (scripts/ab_sparse_mla_heads.py
--schedules hopper --heads 64 --rows selected none). Two other FP8 producers were slower at 64 heads on that H100:
the word loads and conversion of dsv32ref.kernels.sparse_mla_heads_n; and fp8 words staged by cp.async in the
stage's second half and dequantised there (a producer without spills, no register holding a load in flight, but
its conversion waits for the copies), the only one of the two that was faster anywhere: a few per cent at 128
heads.

Top-k splits (decode: few tokens leave SMs idle) as the Triton kernel's: program_id(2) walks its share of the
steps and writes fp32 partials, which sparse_mla_paged merges.

Scope: bf16 q over bf16 or FP8 rows, D_LAT 512, D_ROPE 64, triton 3.6 to 3.8 (Gluon's API moves between releases:
3.7 renamed thread_barrier to barrier, 3.9 replaced async_copy_global_to_shared by async_load; the kernel
takes whichever name its triton has, and scripts/sass_sparse_mla.py compiles it for sm_90a offline under each
release). `why_not` says when it does not run; everything else runs the Triton kernel.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from dsv32ref.kernels.grid import cuda_capability
from dsv32ref.kernels.launch import launch

__all__ = ["SUPPORTED_TRITON", "sparse_mla_hopper", "why_not"]

# Releases this kernel was compiled for sm_90a with (scripts/sass_sparse_mla.py): 3.6.0 (also run on the H200 by
# the GPU tests), 3.7.1 and 3.8.0 (the same instruction counts as 3.6.0). 3.9's PTX needs a newer ptxas than
# the one it bundles for sm_90: not enabled.
SUPPORTED_TRITON = ("3.6", "3.7", "3.8")
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_async_copy = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared

BLOCK_H = gl.constexpr(64)  # heads per program
BLOCK_N = gl.constexpr(64)  # keys per step
LOAD_WARPS = gl.constexpr(4)  # the producer partition: one warpgroup
LOAD_REGS = gl.constexpr(64)  # few registers: it only resolves rows and copies
LOAD_REGS_FP8 = gl.constexpr(120)  # FP8: it also holds a step's fp8 values in flight (64 registers)
FLAGS_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))


_TRITON = ".".join(triton.__version__.split(".")[:2])


def why_not(q: torch.Tensor, d_lat: int, d_rope: int) -> str | None:
    """Why sparse_mla_paged does not run this kernel for q (None: it does). It needs a CUDA tensor on an sm_90
    device, bf16, DeepSeek's latent widths and a triton of SUPPORTED_TRITON. Called at every launch: the reasons
    are formatted only when one applies."""
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if q.dtype != torch.bfloat16:
        return f"{q.dtype} (the sm_90 kernel is bf16)"
    if (d_lat, d_rope) != (512, 64):
        return f"latent widths {d_lat} + {d_rope} (the sm_90 kernel is 512 + 64)"
    if _TRITON not in SUPPORTED_TRITON:
        return f"triton {triton.__version__} (the sm_90 kernel is built for {', '.join(SUPPORTED_TRITON)})"
    if cuda_capability(q.device) != (9, 0):
        return f"compute capability {cuda_capability(q.device)} (the kernel is sm_90's)"
    return None


@gluon.jit
def _step_indices(idx_row_ptr, i, k_end, layout: gl.constexpr):
    """Step i's BLOCK_N top-k entries (of the first k_end; -1 past them), (BLOCK_N,) in `layout`."""
    offs = i * BLOCK_N + gl.arange(0, BLOCK_N, layout)
    return gl.load(idx_row_ptr + offs, mask=offs < k_end, other=-1)


@gluon.jit
def _rows_of(idx, bt_row_ptr, seq_len, block_size, rows_per_block, num_blocks):
    """Top-k entries idx -> their cache rows (in units of the cache's row stride), -1 where the index is outside
    [0, seq_len) or its block id outside [0, num_blocks): never read."""
    ok = (idx >= 0) & (idx < seq_len)
    pos = gl.where(ok, idx, 0)
    blk = gl.load(bt_row_ptr + pos // block_size, mask=ok, other=0)
    ok = ok & (blk >= 0) & (blk < num_blocks)
    return gl.where(ok, blk * rows_per_block + pos % block_size, -1)


@gluon.jit
def _shared_buffers(D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """The program's shared memory in MMA-ready layouts: q (64 x 576), two stages of K (64 x 576), P (64 x 64)."""
    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LAT], gl.bfloat16)
    pe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_LAT], lat_sl)
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], pe_sl)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], lat_sl)
    k_pe = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], pe_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
    return q_lat, q_pe, k_lat, k_pe, p_smem


@gluon.jit
def _softmax_step(s, valid, m_i, sm_scale_log2):
    """One step of the online softmax on raw scores s (BLOCK_H, BLOCK_N) -> (p, the new running max, the rescale
    of the old terms); base 2, invalid keys -inf."""
    s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key yet
    return gl.exp2(s - m_safe[:, None]), m_new, gl.exp2(m_i - m_safe)


@gluon.jit
def _issue_pv(p, alpha, p_smem, kl, acc, o_l: gl.constexpr):
    """P to shared memory (both warpgroups' halves, then a barrier), O rescaled, O += P V issued (not waited)."""
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()  # both warpgroups' halves of P are written
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    return warpgroup_mma(p_smem, kl, acc, is_async=True)


@gluon.jit
def _finish(acc, m_i, l_i, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, split, C0: gl.constexpr,
            WRITE_LSE: gl.constexpr, D_LAT: gl.constexpr, NUM_SPLITS: gl.constexpr, s_l: gl.constexpr,
            o_l: gl.constexpr):
    """O / l (acc: O's columns C0 to C0 + acc.shape[1]) and, with WRITE_LSE, the natural-log logsumexp (+inf where
    no key was valid; NaN where a score was NaN or +inf, as in the reference), stored for the program's heads; with
    top-k splits, fp32 partials [T, H, NUM_SPLITS, D_LAT] and [T, H, NUM_SPLITS] (a head with no valid key in the
    split: lse -inf, weight 0 when sparse_mla merges them, and its out partial not written). A running max of +inf
    is a scaled score past fp32's range: the pair kernel's exponent FFMA (s * scale - max, the product unrounded)
    gives it p 0, not NaN, so it is made NaN here, never read as 'no valid key'."""
    l_i = gl.where(m_i == float("inf"), float("nan"), l_i)
    has_key = l_i != 0
    lse = (m_i + gl.log2(gl.where(has_key, l_i, 1.0))) * 0.6931471805599453
    inv_l = 1.0 / gl.where(has_key, l_i, 1.0)  # a division a row, then a multiply an element
    out = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_l))[:, None]
    offs_ho = h0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, o_l))
    offs_d = C0 + gl.arange(0, acc.shape[1], gl.SliceLayout(0, o_l))
    offs_hl = h0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, s_l))
    if NUM_SPLITS > 1:
        o_ptrs = out_ptr + ((t * H + offs_ho[:, None]) * NUM_SPLITS + split) * D_LAT + offs_d[None, :]
        has_o = gl.convert_layout(has_key, gl.SliceLayout(1, o_l))
        gl.store(o_ptrs, out, mask=((offs_ho < H) & has_o)[:, None])
        if WRITE_LSE:
            gl.store(lse_ptr + (t * H + offs_hl) * NUM_SPLITS + split, gl.where(has_key, lse, float("-inf")),
                     mask=offs_hl < H)
    else:
        gl.store(out_ptr + t * stride_ot + offs_ho[:, None] * stride_oh + offs_d[None, :], out.to(gl.bfloat16),
                 mask=(offs_ho < H)[:, None])
        if WRITE_LSE:
            gl.store(lse_ptr + t * stride_lt + offs_hl, gl.where(has_key, lse, float("inf")), mask=offs_hl < H)


@gluon.jit
def _fp8_group(base8, ok8, offs_g, g: gl.constexpr, D_LAT: gl.constexpr):
    """Group g of the rows at byte pointers base8 (BLOCK_N, 1): its 128 fp8 values (BLOCK_N, 128) and its fp32 scale
    (BLOCK_N, 1), zeros for invalid rows."""
    vals = gl.load((base8 + g * 128).to(gl.pointer_type(gl.float8e4nv)) + offs_g[None, :], mask=ok8[:, None], other=0.0)
    scale = gl.load((base8 + D_LAT + 4 * g).to(gl.pointer_type(gl.float32)), mask=ok8[:, None], other=0.0)
    return vals, scale


@gluon.jit
def _load_fp8_rows(cache_ptr, row, stride_cs, D_LAT: gl.constexpr):
    """Issue the loads of FlashMLA's FP8 c_kv at the step's rows (`row`, in units of stride_cs bytes; -1: invalid,
    read as zeros): the four 128-value groups' fp8 values and fp32 scales, in registers (64 per thread). Nothing
    waits for them here: the caller resolves the next step's rows and waits for a free stage meanwhile."""
    gl.static_assert(D_LAT == 512, "FlashMLA's rows: 4 groups of 128")
    ld8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [LOAD_WARPS, 1], [1, 0])  # 16 fp8 bytes per thread per load
    row8 = gl.convert_layout(row, gl.SliceLayout(1, ld8))
    ok8 = row8 >= 0
    base8 = cache_ptr + row8.to(gl.int64)[:, None] * stride_cs  # (BLOCK_N, 1) byte pointers
    offs_g = gl.arange(0, 128, gl.SliceLayout(0, ld8))
    v0, s0 = _fp8_group(base8, ok8, offs_g, 0, D_LAT)
    v1, s1 = _fp8_group(base8, ok8, offs_g, 1, D_LAT)
    v2, s2 = _fp8_group(base8, ok8, offs_g, 2, D_LAT)
    v3, s3 = _fp8_group(base8, ok8, offs_g, 3, D_LAT)
    return v0, s0, v1, s1, v2, s2, v3, s3


@gluon.jit
def _store_dequantized(k_lat_st, v0, s0, v1, s1, v2, s2, v3, s3):
    """Each group's fp8 values times its fp32 scale (a power of two: exact in bf16) -> the stage's bf16 c_kv
    (BLOCK_N, 512), group by group, as their loads land."""
    k_lat_st.slice(0, 128, dim=1).store((v0.to(gl.float32) * s0).to(gl.bfloat16))
    k_lat_st.slice(128, 128, dim=1).store((v1.to(gl.float32) * s1).to(gl.bfloat16))
    k_lat_st.slice(256, 128, dim=1).store((v2.to(gl.float32) * s2).to(gl.bfloat16))
    k_lat_st.slice(384, 128, dim=1).store((v3.to(gl.float32) * s3).to(gl.bfloat16))


@gluon.jit
def _release_stage(ready_st):
    """The stage is the consumers': when this thread's copies land (cp.async arrives), and once the producer
    warpgroup's plain stores (flags, FP8 values) are all made (the barrier) by one thread's arrive (a release)."""
    cp.mbarrier_arrive(ready_st, increment_count=False)
    _cta_barrier()
    mbarrier.arrive(ready_st)


@gluon.jit
def _load_q(q_ptr, stride_qt, stride_qh, t, h0, H, q_lat, q_pe, q_bar, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """The program's q (its q_lat.shape[0] heads; missing heads zero) into shared memory, by cp.async onto q_bar."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])  # 16 B per thread per copy
    offs_h = h0 + gl.arange(0, q_lat.shape[0], gl.SliceLayout(1, ld))
    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    h_ok = (offs_h < H)[:, None]
    _async_copy(q_lat, q_row + gl.arange(0, D_LAT, gl.SliceLayout(0, ld))[None, :], mask=h_ok)
    _async_copy(q_pe, q_row + D_LAT + gl.arange(0, D_ROPE, gl.SliceLayout(0, ld))[None, :], mask=h_ok)
    cp.mbarrier_arrive(q_bar, increment_count=False)


@gluon.jit
def _produce_bf16(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size, rows_per_block,
                  num_blocks, k_lat, k_pe, valid_smem, ready, free, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """bf16 rows: each step's cp.async gathers, issued as soon as its stage is free; the next step's rows are
    resolved while they fly."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])  # 16 B per thread per copy
    offs_lat = gl.arange(0, D_LAT, gl.SliceLayout(0, ld))
    offs_pe = gl.arange(0, D_ROPE, gl.SliceLayout(0, ld))
    for i in range(it0, it1):  # the program's steps (its split of the top-k)
        st = (i - it0) % 2
        idx = _step_indices(idx_row_ptr, i, k_end, gl.SliceLayout(1, ld))
        row = _rows_of(idx, bt_row_ptr, seq_len, block_size, rows_per_block, num_blocks)
        base = cache_ptr + row.to(gl.int64)[:, None] * stride_cs
        ok = row >= 0  # an invalid row is not read: its stage rows are zero-filled, its flag is 0
        # step i - 2's consumers are done (a fresh one passes)
        mbarrier.wait(free.index(st), (((i - it0) // 2) & 1) ^ 1)
        valid_smem.index(st).store(ok.to(gl.int8))
        _async_copy(k_lat.index(st), base + offs_lat[None, :], mask=ok[:, None])
        _async_copy(k_pe.index(st), base + D_LAT + offs_pe[None, :], mask=ok[:, None])
        _release_stage(ready.index(st))


@gluon.jit
def _produce_fp8(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size, rows_per_block,
                 num_blocks, k_lat, k_pe, valid_smem, ready, free, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """FlashMLA's FP8 rows (stride_cs bytes apart): loads into registers, which must land before they are
    dequantised, so nothing else waits behind them: a step's c_kv loads are issued before its stage is free, and
    while they fly the next step's block-table loads and the top-k entries of the step after; k_pe is copied as
    it is. One load latency a step, where resolving then loading would chain three."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])  # 16 B per thread per copy
    rows_l: gl.constexpr = gl.SliceLayout(1, ld)
    offs_pe = gl.arange(0, D_ROPE, gl.SliceLayout(0, ld))
    row = _rows_of(_step_indices(idx_row_ptr, it0, k_end, rows_l), bt_row_ptr, seq_len, block_size, rows_per_block,
                   num_blocks)
    idx_next = _step_indices(idx_row_ptr, it0 + 1, k_end, rows_l)
    for i in range(it0, it1):
        st = (i - it0) % 2
        v0, s0, v1, s1, v2, s2, v3, s3 = _load_fp8_rows(cache_ptr, row, stride_cs, D_LAT)
        mbarrier.wait(free.index(st), (((i - it0) // 2) & 1) ^ 1)
        ok = row >= 0  # an invalid row is not read: its stage rows are zero-filled, its flag is 0
        valid_smem.index(st).store(ok.to(gl.int8))
        pe = (cache_ptr + row.to(gl.int64)[:, None] * stride_cs + D_LAT + 4 * (D_LAT // 128)).to(
            gl.pointer_type(gl.bfloat16))
        _async_copy(k_pe.index(st), pe + offs_pe[None, :], mask=ok[:, None])
        row = _rows_of(idx_next, bt_row_ptr, seq_len, block_size, rows_per_block, num_blocks)  # step i + 1's
        idx_next = _step_indices(idx_row_ptr, i + 2, k_end, rows_l)
        _store_dequantized(k_lat.index(st), v0, s0, v1, s1, v2, s2, v3, s3)
        fence_async_shared()  # the stage's plain stores, visible to the consumers' wgmma (async proxy)
        _release_stage(ready.index(st))


@gluon.jit
def _load_partition(q_ptr, stride_qt, stride_qh, cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, t, h0, H, k_end,
                    it0, it1, seq_len, block_size, rows_per_block, num_blocks, q_lat, q_pe, k_lat, k_pe, valid_smem,
                    q_bar, ready, free, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, FP8: gl.constexpr):
    """The producer: q once, then each step's rows into a free stage, and which of them are valid into the stage's
    flags, so the consumers resolve nothing."""
    _load_q(q_ptr, stride_qt, stride_qh, t, h0, H, q_lat, q_pe, q_bar, D_LAT, D_ROPE)
    if FP8:
        _produce_fp8(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size,
                     rows_per_block, num_blocks, k_lat, k_pe, valid_smem, ready, free, D_LAT, D_ROPE)
    else:
        _produce_bf16(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size,
                      rows_per_block, num_blocks, k_lat, k_pe, valid_smem, ready, free, D_LAT, D_ROPE)


@gluon.jit
def _compute_partition(q_lat, q_pe, k_lat, k_pe, p_smem, valid_smem, q_bar, ready, free, out_ptr, stride_ot,
                       stride_oh, lse_ptr, stride_lt, sm_scale_log2, t, h0, H, it0, it1, split, D_LAT: gl.constexpr,
                       NUM_SPLITS: gl.constexpr):
    """The consumers (the kernel's 8 warps), then the epilogue (_finish)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, o_l)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    mbarrier.wait(q_bar, 0)
    for i in range(it0, it1):
        st = (i - it0) % 2
        kl = k_lat.index(st)
        mbarrier.wait(ready.index(st), ((i - it0) // 2) & 1)
        valid = valid_smem.index(st).load(gl.SliceLayout(0, s_l)) != 0  # (BLOCK_N,): the producer's flags
        fence_async_shared()  # the copies' generic-proxy writes, visible to the wgmma's async proxy
        s = warpgroup_mma(q_lat, kl.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, k_pe.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))  # (BLOCK_H, BLOCK_N)
        p, m_new, alpha = _softmax_step(s, valid, m_i, sm_scale_log2)
        l_acc = l_acc * alpha[:, None] + p
        m_i = m_new
        acc = _issue_pv(p, alpha, p_smem, kl, acc, o_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _cta_barrier()  # every consumer warp is done with P and with this stage
        mbarrier.arrive(free.index(st))
    _finish(acc, m_i, gl.sum(l_acc, axis=1), out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, split, 0,
            True, D_LAT, NUM_SPLITS, s_l, o_l)


@gluon.jit
def _program_steps(req_ptr, seq_lens_ptr, idx_ptr, stride_it, block_table_ptr, stride_bt, t, K, B, max_blocks,
                   block_size, VALID_FIRST: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """Token t's program: (its sequence length, the end of the top-k slots to visit, its split, first and end step,
    its top-k row, its block-table row). A request index outside [0, B) attends to nothing; a sequence longer than
    its block-table row (or negative) is cut to what the row can address. With VALID_FIRST the caller promises the
    valid indices come first: at most seq_len slots need visiting. Split-K (decode): program_id(2) takes its share
    of the steps; an empty share leaves lse -inf."""
    req = gl.load(req_ptr + t)
    req_ok = (req >= 0) & (req < B)
    seq_len = gl.load(seq_lens_ptr + gl.where(req_ok, req, 0), mask=req_ok, other=0)
    seq_len = gl.where(req_ok, gl.maximum(gl.minimum(seq_len, max_blocks * block_size), 0), 0)
    k_end = gl.minimum(K, seq_len) if VALID_FIRST else K
    split = gl.program_id(2)
    per_split = gl.cdiv(gl.cdiv(k_end, BLOCK_N), NUM_SPLITS)
    it0 = split * per_split
    it1 = gl.minimum(it0 + per_split, gl.cdiv(k_end, BLOCK_N))
    return (seq_len, k_end, split, it0, it1, idx_ptr + t * stride_it,
            block_table_ptr + gl.where(req_ok, req, 0) * stride_bt)


@gluon.jit
def _stage_barriers(PRODUCERS: gl.constexpr):
    """q's barrier, the stages' validity flags, and their `ready` and `free` barriers, initialised: q_bar completes
    when the first producer warpgroup's copies land, `ready` when every producer thread's copies have landed and
    each producer warpgroup has released the stage, `free` on one arrive (the consumers', after their barrier)."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    valid_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], FLAGS_LAYOUT)  # per stage: which rows are valid
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=LOAD_WARPS * 32)
    for st in gl.static_range(2):
        mbarrier.init(ready.index(st), count=(LOAD_WARPS * 32 + 1) * PRODUCERS)
        mbarrier.init(free.index(st), count=1)
    return q_bar, valid_smem, ready, free


@gluon.jit
def _sparse_mla_ws_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, H, D_LAT + D_ROPE] bf16
    cache_ptr, stride_cs,  # latent cache rows (stride_cs: one token's row)
    block_table_ptr, stride_bt, req_ptr, seq_lens_ptr,  # [B, max_blocks], [T], [B]
    idx_ptr, stride_it,  # top-k [T, K] int32
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,  # out [T, H, D_LAT] bf16, lse [T, H] fp32
    sm_scale_log2, H, K, block_size, rows_per_block, B, max_blocks, num_blocks,
    few_keys,  # tokens with at most this many top-k slots to visit are left alone (sparse_mla's few-keys launch)
    D_LAT: gl.constexpr, D_ROPE: gl.constexpr, VALID_FIRST: gl.constexpr, FP8: gl.constexpr,
    NUM_SPLITS: gl.constexpr, num_warps: gl.constexpr,
):
    t = gl.program_id(0)
    h0 = gl.program_id(1) * BLOCK_H
    seq_len, k_end, split, it0, it1, idx_row_ptr, bt_row_ptr = _program_steps(
        req_ptr, seq_lens_ptr, idx_ptr, stride_it, block_table_ptr, stride_bt, t, K, B, max_blocks, block_size,
        VALID_FIRST, NUM_SPLITS)
    if k_end <= few_keys:
        return
    q_lat, q_pe, k_lat, k_pe, p_smem = _shared_buffers(D_LAT, D_ROPE)
    q_bar, valid_smem, ready, free = _stage_barriers(1)
    gl.warp_specialize([
        (_compute_partition, (q_lat, q_pe, k_lat, k_pe, p_smem, valid_smem, q_bar, ready, free, out_ptr, stride_ot,
                              stride_oh, lse_ptr, stride_lt, sm_scale_log2, t, h0, H, it0, it1, split, D_LAT,
                              NUM_SPLITS)),
        (_load_partition, (q_ptr, stride_qt, stride_qh, cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, t, h0, H,
                           k_end, it0, it1, seq_len, block_size, rows_per_block, num_blocks, q_lat, q_pe, k_lat, k_pe,
                           valid_smem, q_bar, ready, free, D_LAT, D_ROPE, FP8)),
    ], [LOAD_WARPS], [LOAD_REGS_FP8 if FP8 else LOAD_REGS])


def sparse_mla_hopper(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale, outputs,
                      splits: int, valid_first: bool = False, few_keys: int = -1) -> None:
    """The launch (inputs checked by sparse_mla_paged, `why_not` None): one program per (token, 64 heads, top-k
    split); outputs = (out, out's two strides, lse, lse's stride), or with splits > 1 the fp32 partials
    sparse_mla_paged merges (strides unused); valid_first as sparse_mla_paged's; the tokens with at most few_keys
    top-k slots to visit are left alone (sparse_mla_paged's few-keys launch writes them)."""
    T, H = q.shape[:2]
    nb, bs = latent_cache.shape[:2]
    o_arg, o_s0, o_s1, l_arg, l_s0 = outputs
    launch(_sparse_mla_ws_kernel, (T, triton.cdiv(H, 64), splits),
        q, q.stride(0), q.stride(1), latent_cache, latent_cache.stride(1),
        block_table, block_table.stride(0), req_indices, seq_lens, topk_indices, topk_indices.stride(0),
        o_arg, o_s0, o_s1, l_arg, l_s0,
        sm_scale * math.log2(math.e), H, topk_indices.shape[1], bs,
        latent_cache.stride(0) // latent_cache.stride(1), seq_lens.shape[0], block_table.shape[1], nb, few_keys,
        D_LAT=q.shape[-1] - 64, D_ROPE=64, VALID_FIRST=valid_first,
        FP8=latent_cache.dtype == torch.uint8, NUM_SPLITS=splits, num_warps=8)
