"""sparse_mla on Hopper (sm_90) for few heads per token: the keys as the MMA's M, the heads as its N. Graph-safe.

Motivation. A warpgroup MMA is at least 64 rows (M) tall. The kernel of dsv32ref.kernels.sparse_mla_hopper puts
the heads on M, so a tensor-parallel rank's 16 heads (GLM-5.2 at TP4, DeepSeek-V3.2 at TP8) fill a quarter of
every tile: per 64-key step its consumers multiply 8.9 MFLOP of which 2.2 are wanted, and decode, which should
be bound by the bytes of the gathered rows, is bound by those padded MMAs instead. Here the products are turned
around, so that the step's 64 keys are M and the program's HB = 16 or 32 heads are N:

    S^T (64 keys x HB)    = K (64 x 576, the stage in shared memory)  .  q^T (576 x HB)
    O^T (512 x HB)       += V^T (512 x 64, the same stage, transposed) .  P^T (64 x HB)

and nothing is padded but the heads past H within the last program. The softmax runs along M (the keys), per
column (head). One consumer warpgroup does both products; its accumulator O^T is 512 x HB fp32 (64 registers a
thread at HB = 16), which leaves the producers registers to hold rows in flight.

    producers  bf16 rows: one warpgroup, sparse_mla_hopper's own (q once; per step the 64 keys' rows gathered by
               cp.async into a free stage, their validity flags beside it). FlashMLA's FP8 rows: two warpgroups,
               each 32 of every step's 64 rows (the first also loads q): register loads of the fp8 values (int32
               words) and scales, dequantised into the stage's bf16 by one inline-asm conversion a word; each
               issues the next step's loads before it waits for a free stage and stores this step's
    consumer   one warpgroup: per step wait for the stage, S^T, online softmax along the keys, P^T to shared
               memory, O^T += V^T P^T, free the stage
    shared     q HB x 576 + 2 stages of 64 x 576 + P^T 64 x HB, bf16: 164 KiB at HB = 16, 185 KiB at 32

Per step and program: 2 * 64 * HB * (576 + 512) FLOPs (2.2 MFLOP at HB = 16) for 72 KiB (bf16) or 41 KiB (FP8) of
gathered rows. What the FP8 producers learned on the H200 (Nsight Compute, B = 128 decode tokens at 16 heads): one
warpgroup converting a whole step issued a third of the time and held the consumer waiting; a byte tensor carried
across the loop took a register a byte (hence words); a quarter warp's 16-byte stores must span two rows to meet the
stage's 128-byte swizzle without a two-way bank conflict (the load layout below). The stage's reads by the MMAs (K,
then V: 136 KiB a step) and the dequantised stores (64 KiB) keep the shared-memory pipe busy, so the FP8 step costs
about what the bf16 one does even though it reads 57 % of the bytes, and more loads in flight make it slower, not
faster (the loads are not waiting on latency): the loop below, as compiled, waits for the next step's loads at its
back edge, where its registers change roles, so one step's loads fly at a time; a loop over two steps an iteration,
which kept them in flight across it (no register copies), was no faster at 16 heads and slower at 32 on an H100. On
an H100, whose HBM is slower (3.0 TB/s copied), the bf16 rows are bound by their bytes and the FP8 rows win: 16
heads, 16 to 128 requests, 8k-128k contexts, 1.17-1.20x bf16's speed (bench.fp8, graph replay), yet at 63-64 % of
the copy rate at 128 requests against bf16's 92-94 %: there, too, the FP8 step is bound inside the SM, not by its
bytes.
A warp's load spans 8 rows x 64 bytes, and a 656-byte row starts half a sector off on every other row, so those
rows' 64 bytes take three 32-byte sectors: a quarter more sectors than the bytes need, and under Nsight Compute
(scripts/gpu_experiments.sh's ncu step) the L1/TEX pipe is busier than DRAM. Fewer rows a load was tried on an
H100: two rows of 128 bytes a load (8 bytes a thread, so that a quarter warp's stores still fill one row's 128
bytes without conflicts; the scales loaded for the step being stored, which frees the registers the narrower loads
take) was a few per cent slower at 16 heads and a few per cent faster at 32, so it was not kept: the shared-memory
pipe, more than the excess sectors, seems to bound the FP8 step.
scripts/ab_sparse_mla_heads.py times both caches and both kernels in one process, and a copy of this module from
another revision beside them.

Top-k splits and the outputs (bf16 out and lse, or fp32 partials for sparse_mla_paged to merge) are the other
kernel's, as are the semantics: invalid or unselected keys never count, a NaN or +inf score at a valid key makes
that head's out and lse NaN, a head with no valid key gets out 0 and lse +inf.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from dsv32ref.kernels.launch import launch
from dsv32ref.kernels.sparse_mla_hopper import (BLOCK_N, LOAD_WARPS, _async_copy, _cta_barrier, _load_partition,
                                                _load_q, _program_steps, _release_stage, _rows_of, _stage_barriers)

__all__ = ["MAX_HEADS", "heads_per_program", "sparse_mla_heads_n"]

MAX_HEADS = 32  # heads per token up to which sparse_mla_paged runs this kernel (past it: 64 heads on M)
LOAD_REGS = gl.constexpr(64)  # the producer over bf16 rows: it resolves rows and issues copies
LOAD_REGS_FP8 = gl.constexpr(152)  # each of two producers over FP8 rows: half of two steps held (80 registers)


def heads_per_program(H: int) -> int:
    """HB, the MMA's N: 16 heads a program, or 32 where H needs more than 16."""
    return 16 if H <= 16 else 32


@gluon.jit
def _load_fp8_words(cache_ptr, row, stride_cs, D_LAT: gl.constexpr):
    """Issue the loads of FlashMLA's FP8 c_kv at the rows `row` (-1: invalid, read as zeros): per 128-value group,
    its fp8 values as int32 words (rows, 32), four a word (value 4j + b is byte b of word j), and its fp32 scale
    (rows, 1). Words, not fp8 tensors: carried across a loop iteration, a byte tensor takes a register a byte."""
    gl.static_assert(D_LAT == 512, "FlashMLA's rows: 4 groups of 128")
    # 16 bytes a thread a load; a quarter warp (8 lanes) spans two rows, so that the 16-byte stores of the
    # dequantised rows hit 8 distinct bank groups of the stage's 128-byte swizzle (one row: two lanes a group)
    ldw: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LOAD_WARPS, 1], [1, 0])
    row_w = gl.convert_layout(row, gl.SliceLayout(1, ldw))
    ok = (row_w >= 0)[:, None]
    base = cache_ptr + row_w.to(gl.int64)[:, None] * stride_cs  # (BLOCK_N, 1) byte pointers
    offs_w = gl.arange(0, 32, gl.SliceLayout(0, ldw))[None, :]
    w0 = gl.load(base.to(gl.pointer_type(gl.int32)) + offs_w, mask=ok, other=0)
    w1 = gl.load((base + 128).to(gl.pointer_type(gl.int32)) + offs_w, mask=ok, other=0)
    w2 = gl.load((base + 256).to(gl.pointer_type(gl.int32)) + offs_w, mask=ok, other=0)
    w3 = gl.load((base + 384).to(gl.pointer_type(gl.int32)) + offs_w, mask=ok, other=0)
    scales = (base + D_LAT).to(gl.pointer_type(gl.float32))
    s0 = gl.load(scales, mask=ok, other=0.0)
    s1 = gl.load(scales + 1, mask=ok, other=0.0)
    s2 = gl.load(scales + 2, mask=ok, other=0.0)
    s3 = gl.load(scales + 3, mask=ok, other=0.0)
    return w0, s0, w1, s1, w2, s2, w3, s3


# One word of four fp8 e4m3 values ($4, value b in byte b) times a power-of-two scale ($5, fp32 bits) -> four bf16
# ($0..$3): two fp8x2 -> f16x2 conversions, each f16 to f32, the products (exact), packed to bf16 pairs.
_WORD_TIMES_SCALE = gl.constexpr("""{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 a, b, p, q;
.reg .f32 f0, f1, f2, f3, s;
mov.b32 s, $5;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 a, lo;
cvt.rn.f16x2.e4m3x2 b, hi;
mov.b32 {h0, h1}, a;
mov.b32 {h2, h3}, b;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
mul.f32 f0, f0, s;
mul.f32 f1, f1, s;
mul.f32 f2, f2, s;
mul.f32 f3, f3, s;
cvt.rn.bf16x2.f32 p, f1, f0;
cvt.rn.bf16x2.f32 q, f3, f2;
mov.b32 {$0, $1}, p;
mov.b32 {$2, $3}, q;
}""")


@gluon.jit
def _dequantize_words(w, s):
    """A group's words (rows, 32) and scale (rows, 1) -> its values (rows, 128) bf16, in order."""
    c0, c1, c2, c3 = gl.inline_asm_elementwise(_WORD_TIMES_SCALE, "=h,=h,=h,=h,r,r", [w, s.to(gl.int32, bitcast=True)],
                                               dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                               is_pure=True, pack=1)
    v = gl.join(gl.join(c0, c2), gl.join(c1, c3))  # (BLOCK_N, 32, 2, 2): [r, j, x, y] is byte 2x + y of word j
    return gl.reshape(v, [w.shape[0], 4 * w.shape[1]])


@gluon.jit
def _store_dequantized_words(k_lat_st, w0, s0, w1, s1, w2, s2, w3, s3):
    """The four groups, dequantised, into the stage's bf16 c_kv rows k_lat_st (rows, 512)."""
    k_lat_st.slice(0, 128, dim=1).store(_dequantize_words(w0, s0))
    k_lat_st.slice(128, 128, dim=1).store(_dequantize_words(w1, s1))
    k_lat_st.slice(256, 128, dim=1).store(_dequantize_words(w2, s2))
    k_lat_st.slice(384, 128, dim=1).store(_dequantize_words(w3, s3))


@gluon.jit
def _rows_slice_indices(idx_row_ptr, i, R0: gl.constexpr, ROWS: gl.constexpr, k_stop, layout: gl.constexpr):
    """Rows R0 .. R0 + ROWS of step i's BLOCK_N top-k entries (of the first k_stop; -1 past them), in `layout`."""
    offs = i * BLOCK_N + R0 + gl.arange(0, ROWS, layout)
    return gl.load(idx_row_ptr + offs, mask=offs < k_stop, other=-1)


@gluon.jit
def _produce_fp8_ahead(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size,
                       rows_per_block, num_blocks, k_lat, k_pe, valid_smem, ready, free, R0: gl.constexpr,
                       ROWS: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """FlashMLA's FP8 rows R0 .. R0 + ROWS of every step, one step ahead: step i + 1's fp8 values and scales are
    loaded into registers while step i's (loaded one iteration earlier) wait for a free stage and are dequantised
    and stored, and step i + 2's rows are resolved meanwhile; the back edge, where the registers change roles,
    waits for step i + 1's loads. Nothing past the program's own steps is read."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])  # 16 B per thread per copy
    rows_l: gl.constexpr = gl.SliceLayout(1, ld)
    offs_pe = gl.arange(0, D_ROPE, gl.SliceLayout(0, ld))
    k_stop = gl.minimum(k_end, it1 * BLOCK_N)  # the end of this program's top-k slots
    row = _rows_of(_rows_slice_indices(idx_row_ptr, it0, R0, ROWS, k_stop, rows_l), bt_row_ptr, seq_len, block_size,
                   rows_per_block, num_blocks)
    v0, s0, v1, s1, v2, s2, v3, s3 = _load_fp8_words(cache_ptr, row, stride_cs, D_LAT)
    row_next = _rows_of(_rows_slice_indices(idx_row_ptr, it0 + 1, R0, ROWS, k_stop, rows_l), bt_row_ptr, seq_len,
                        block_size, rows_per_block, num_blocks)
    idx_after = _rows_slice_indices(idx_row_ptr, it0 + 2, R0, ROWS, k_stop, rows_l)
    for i in range(it0, it1):
        st = (i - it0) % 2
        n0, t0, n1, t1, n2, t2, n3, t3 = _load_fp8_words(cache_ptr, row_next, stride_cs, D_LAT)  # step i + 1's
        row_after = _rows_of(idx_after, bt_row_ptr, seq_len, block_size, rows_per_block, num_blocks)  # i + 2's
        idx_after = _rows_slice_indices(idx_row_ptr, i + 3, R0, ROWS, k_stop, rows_l)
        mbarrier.wait(free.index(st), (((i - it0) // 2) & 1) ^ 1)  # step i - 2's consumer is done
        ok = row >= 0  # an invalid row is not read: its stage rows are zero-filled, its flag is 0
        valid_smem.index(st).slice(R0, ROWS).store(ok.to(gl.int8))
        pe = (cache_ptr + row.to(gl.int64)[:, None] * stride_cs + D_LAT + 4 * (D_LAT // 128)).to(
            gl.pointer_type(gl.bfloat16))
        _async_copy(k_pe.index(st).slice(R0, ROWS, dim=0), pe + offs_pe[None, :], mask=ok[:, None])
        _store_dequantized_words(k_lat.index(st).slice(R0, ROWS, dim=0), v0, s0, v1, s1, v2, s2, v3, s3)
        fence_async_shared()  # the stage's plain stores, visible to the consumer's wgmma (async proxy)
        _release_stage(ready.index(st))
        row, row_next = row_next, row_after
        v0, s0, v1, s1, v2, s2, v3, s3 = n0, t0, n1, t1, n2, t2, n3, t3


@gluon.jit
def _fp8_half_partition(q_ptr, stride_qt, stride_qh, t, h0, H, q_lat, q_pe, q_bar, cache_ptr, stride_cs, idx_row_ptr,
                        bt_row_ptr, k_end, it0, it1, seq_len, block_size, rows_per_block, num_blocks, k_lat, k_pe,
                        valid_smem, ready, free, HALF: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """One of two FP8 producer warpgroups: half HALF of every step's rows; the first also loads q."""
    if HALF == 0:
        _load_q(q_ptr, stride_qt, stride_qh, t, h0, H, q_lat, q_pe, q_bar, D_LAT, D_ROPE)
    _produce_fp8_ahead(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size,
                       rows_per_block, num_blocks, k_lat, k_pe, valid_smem, ready, free, HALF * (BLOCK_N // 2),
                       BLOCK_N // 2, D_LAT, D_ROPE)


@gluon.jit
def _finish(acc, m_i, l_acc, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, split, HB: gl.constexpr,
            D_LAT: gl.constexpr, NUM_SPLITS: gl.constexpr, o_l: gl.constexpr):
    """O^T / l and the natural-log logsumexp per head (+inf where no key was valid, NaN where a score was NaN or
    +inf), stored for the program's heads; with top-k splits, fp32 partials [T, H, NUM_SPLITS, D_LAT] and
    [T, H, NUM_SPLITS] (an empty split's lse -inf; the combine does not read its out partial)."""
    l_i = gl.sum(l_acc, axis=0)  # (HB,)
    has_key = l_i != 0
    lse = (m_i + gl.log2(gl.where(has_key, l_i, 1.0))) * 0.6931471805599453
    inv_l = 1.0 / gl.where(has_key, l_i, 1.0)  # a division a head, then a multiply an element
    out = acc * gl.convert_layout(inv_l, gl.SliceLayout(0, o_l))[None, :]  # (D_LAT, HB)
    offs_d = gl.arange(0, D_LAT, gl.SliceLayout(1, o_l))
    offs_ho = h0 + gl.arange(0, HB, gl.SliceLayout(0, o_l))
    offs_hl = h0 + gl.arange(0, HB, m_i.type.layout)
    if NUM_SPLITS > 1:
        o_ptrs = out_ptr + ((t * H + offs_ho[None, :]) * NUM_SPLITS + split) * D_LAT + offs_d[:, None]
        # every head's partial, keys or not: a has_key mask here costs the FP8 producer registers (it spills)
        gl.store(o_ptrs, out, mask=(offs_ho < H)[None, :])
        gl.store(lse_ptr + (t * H + offs_hl) * NUM_SPLITS + split, gl.where(has_key, lse, float("-inf")),
                 mask=offs_hl < H)
    else:
        gl.store(out_ptr + t * stride_ot + offs_ho[None, :] * stride_oh + offs_d[:, None], out.to(gl.bfloat16),
                 mask=(offs_ho < H)[None, :])
        gl.store(lse_ptr + t * stride_lt + offs_hl, gl.where(has_key, lse, float("inf")), mask=offs_hl < H)


@gluon.jit
def _compute_partition(q_lat, q_pe, k_lat, k_pe, pt_smem, valid_smem, q_bar, ready, free, out_ptr, stride_ot,
                       stride_oh, lse_ptr, stride_lt, sm_scale_log2, t, h0, H, it0, it1, split, HB: gl.constexpr,
                       D_LAT: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """The consumer warpgroup: per step S^T, the online softmax along the keys, O^T += V^T P^T; then _finish."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
    m_i = gl.full([HB], float("-inf"), gl.float32, gl.SliceLayout(0, mma_l))
    l_acc = gl.zeros([BLOCK_N, HB], gl.float32, mma_l)  # row sums accumulated per element, reduced after the loop
    acc = gl.zeros([D_LAT, HB], gl.float32, mma_l)  # O^T
    s_zero = gl.zeros([BLOCK_N, HB], gl.float32, mma_l)
    mbarrier.wait(q_bar, 0)
    for i in range(it0, it1):
        st = (i - it0) % 2
        kl = k_lat.index(st)
        mbarrier.wait(ready.index(st), ((i - it0) // 2) & 1)
        valid = valid_smem.index(st).load(gl.SliceLayout(1, mma_l)) != 0  # (BLOCK_N,): the producer's flags
        fence_async_shared()  # the copies' generic-proxy writes, visible to the wgmma's async proxy
        s = warpgroup_mma(kl, q_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(k_pe.index(st), q_pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))  # S^T (BLOCK_N, HB)
        s = gl.where(valid[:, None], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a head with no valid key yet
        p = gl.exp2(s - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        pt_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()  # P^T is written
        acc = warpgroup_mma(kl.permute((1, 0)), pt_smem, acc * alpha[None, :], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _cta_barrier()  # every consumer warp is done with P^T and with this stage
        mbarrier.arrive(free.index(st))
    _finish(acc, m_i, l_acc, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, split, HB, D_LAT,
            NUM_SPLITS, mma_l)


@gluon.jit
def _shared_buffers(HB: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """q (HB x 576), two stages of K (64 x 576) and P^T (64 x HB), in MMA-ready layouts."""
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [HB, D_LAT],
                                      gl.NVMMASharedLayout.get_default_for([HB, D_LAT], gl.bfloat16))
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [HB, D_ROPE],
                                     gl.NVMMASharedLayout.get_default_for([HB, D_ROPE], gl.bfloat16))
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LAT], gl.bfloat16))
    k_pe = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.bfloat16))
    pt_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HB],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, HB], gl.bfloat16))
    return q_lat, q_pe, k_lat, k_pe, pt_smem


@gluon.jit
def _sparse_mla_heads_n_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, H, D_LAT + D_ROPE] bf16
    cache_ptr, stride_cs,  # latent cache rows (stride_cs: one token's row)
    block_table_ptr, stride_bt, req_ptr, seq_lens_ptr,  # [B, max_blocks], [T], [B]
    idx_ptr, stride_it,  # top-k [T, K] int32
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,  # out [T, H, D_LAT] bf16, lse [T, H] fp32
    sm_scale_log2, H, K, block_size, rows_per_block, B, max_blocks, num_blocks,
    HB: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, VALID_FIRST: gl.constexpr, FP8: gl.constexpr,
    NUM_SPLITS: gl.constexpr, num_warps: gl.constexpr,
):
    t = gl.program_id(0)
    h0 = gl.program_id(1) * HB
    seq_len, k_end, split, it0, it1, idx_row_ptr, bt_row_ptr = _program_steps(
        req_ptr, seq_lens_ptr, idx_ptr, stride_it, block_table_ptr, stride_bt, t, K, B, max_blocks, block_size,
        VALID_FIRST, NUM_SPLITS)
    q_lat, q_pe, k_lat, k_pe, pt_smem = _shared_buffers(HB, D_LAT, D_ROPE)
    q_bar, valid_smem, ready, free = _stage_barriers(2 if FP8 else 1)  # two producer warpgroups over FP8 rows
    if FP8:
        gl.warp_specialize([
            (_compute_partition, (q_lat, q_pe, k_lat, k_pe, pt_smem, valid_smem, q_bar, ready, free, out_ptr,
                                  stride_ot, stride_oh, lse_ptr, stride_lt, sm_scale_log2, t, h0, H, it0, it1, split,
                                  HB, D_LAT, NUM_SPLITS)),
            (_fp8_half_partition, (q_ptr, stride_qt, stride_qh, t, h0, H, q_lat, q_pe, q_bar, cache_ptr, stride_cs,
                                   idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size, rows_per_block,
                                   num_blocks, k_lat, k_pe, valid_smem, ready, free, 0, D_LAT, D_ROPE)),
            (_fp8_half_partition, (q_ptr, stride_qt, stride_qh, t, h0, H, q_lat, q_pe, q_bar, cache_ptr, stride_cs,
                                   idx_row_ptr, bt_row_ptr, k_end, it0, it1, seq_len, block_size, rows_per_block,
                                   num_blocks, k_lat, k_pe, valid_smem, ready, free, 1, D_LAT, D_ROPE)),
        ], [LOAD_WARPS, LOAD_WARPS], [LOAD_REGS_FP8, LOAD_REGS_FP8])
    else:
        gl.warp_specialize([
            (_compute_partition, (q_lat, q_pe, k_lat, k_pe, pt_smem, valid_smem, q_bar, ready, free, out_ptr,
                                  stride_ot, stride_oh, lse_ptr, stride_lt, sm_scale_log2, t, h0, H, it0, it1, split,
                                  HB, D_LAT, NUM_SPLITS)),
            (_load_partition, (q_ptr, stride_qt, stride_qh, cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, t, h0, H,
                               k_end, it0, it1, seq_len, block_size, rows_per_block, num_blocks, q_lat, q_pe, k_lat,
                               k_pe, valid_smem, q_bar, ready, free, D_LAT, D_ROPE, False)),
        ], [LOAD_WARPS], [LOAD_REGS])


def sparse_mla_heads_n(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale, outputs,
                       splits: int, valid_first: bool = False) -> None:
    """The launch (inputs checked by sparse_mla_paged; sparse_mla_hopper.why_not None; H <= MAX_HEADS): one program
    per (token, HB heads, top-k split); outputs as sparse_mla_hopper's."""
    T, H = q.shape[:2]
    hb = heads_per_program(H)
    nb, bs = latent_cache.shape[:2]
    o_arg, o_s0, o_s1, l_arg, l_s0 = outputs
    launch(_sparse_mla_heads_n_kernel, (T, triton.cdiv(H, hb), splits),
        q, q.stride(0), q.stride(1), latent_cache, latent_cache.stride(1),
        block_table, block_table.stride(0), req_indices, seq_lens, topk_indices, topk_indices.stride(0),
        o_arg, o_s0, o_s1, l_arg, l_s0,
        sm_scale * math.log2(math.e), H, topk_indices.shape[1], bs,
        latent_cache.stride(0) // latent_cache.stride(1), seq_lens.shape[0], block_table.shape[1], nb,
        HB=hb, D_LAT=q.shape[-1] - 64, D_ROPE=64, VALID_FIRST=valid_first,
        FP8=latent_cache.dtype == torch.uint8, NUM_SPLITS=splits, num_warps=4)
