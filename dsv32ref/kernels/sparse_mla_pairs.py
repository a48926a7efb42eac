"""sparse_mla on Hopper (sm_90) with FlashMLA's sparse-prefill schedule, in Gluon: what `sparse_mla_paged` runs
there past 32 heads over bf16 rows. 64 heads a program, the top-k walked two 64-key blocks (a pair) at a time.
Graph-safe.

The math and the program's inputs are those of dsv32ref.kernels.sparse_mla_hopper (one token, 64 heads, its
top-k resolved through the block table by a producer warpgroup); the consumers' schedule is the one FlashMLA's
sm_90 sparse prefill uses (deepseek-ai/FlashMLA, csrc/sm90/prefill/sparse/phase1.cuh):

    the pair      two stages hold a pair of key blocks: block 0 (even) and block 1 (odd), each 64 x 576; each
                  stage is loaded in two halves with their own `ready` and `free` barriers, L (c_kv's columns
                  0-255) and R (columns 256-511 and k_pe), in the order the consumers need them
    consumer 0    (the default partition) S0 = q K0^T, 64 x 64 over all 576 columns; the softmax of S0 under
                  the running max; its max to consumer 1; O[:, :256] += P0 V0[:, :256] with P0 from registers;
                  then, once consumer 1 has the pair's max, P0 rescaled to it into shared memory (over block 0's
                  k_pe, which QK^T no longer needs) and O[:, :256] += P1 V1[:, :256] from consumer 1's P1; the
                  next pair's S0 is issued behind that MMA, before it is waited for, so that consumer 0 runs ahead
                  and the tensor cores have work across the pair boundary
    consumer 1    S1 = q K1^T; the pair's max (consumer 0's and S1's); O[:, 256:] += P1 V1[:, 256:] with P1
                  from registers, P1 into shared memory, O[:, 256:] += P0 V0[:, 256:]; block 1's R half freed
                  as soon as its MMA is done, before P0's
    producer      q once, then per pair the halves V0L, V1R, V0R, V1L (cp.async gathers through the block table)
                  and each block's validity flags with its first half

A token's head blocks are neighbours in the grid (program_id(0) = token x head blocks + head block), so that
the second one's gathers find the rows the first one's brought into L2.

Each warpgroup's QK^T is a 64 x 64 MMA over 576 columns (the warpgroups of sparse_mla_hopper each take 32 keys),
each P meets half of V from registers and the other half from shared memory, and the row statistics cross the
warpgroups once a pair (the max: one hand-off each way; the row sums: once, after the loop). The consumers'
hand-offs within a pair (the two maxima, P0 and P1) are hardware named barriers of both consumer warpgroups, as in
FlashMLA: the sender's threads arrive and go on, the receiver's wait (Triton's compiler still adds one barrier
inside a warpgroup a pair on the max's path: the statistics' rows share one allocation). The stages and the row
sums are mbarriers (one arrive after the warpgroup's barrier: a release of its shared-memory writes). With the
scale applied in the exponential's FFMA (exp2(s c - m)) rather than to S first, these hand-offs took 3 % off the
kernel's time against mbarriers behind a warpgroup barrier each, on one H100 (scripts/ab_package.py's
sparse_mla_prefill, 2 rounds, graph replay: GLM-5.2 at 512, 2048 and 8192 tokens x0.968, x0.971, x0.967;
DeepSeek-V3.2 at 512 and 2048 x0.964, x0.972).

    shared memory (bf16): q 64 x 576 (72 KiB) + 2 blocks 64 x 576 (144 KiB) + P1 64 x 64 (8 KiB) = 224 KiB;
    P0 lives in block 0's k_pe

At a few keys a program is one latency chain, not bytes: an 8-token prompt of 8 keys gives 8 programs of one
pair each, and on one H100 (ncu, 1 split) the kernel took 21.2-21.7 us, each consumer warp issuing about 1500
instructions at one per 20 cycles, 0.17 warps eligible per scheduler, DRAM 1 % busy (with an epilogue that
divided each of its 128 values a thread by l; under CUDA-graph replay 13.1 us a launch). Hence the epilogue's one
division a row and a multiply a value: ptxas's sm_90a build issues 4664 instructions, not 5416 (FMUL 1084, not
1588; FSEL 128, not 380), and the launch replays in 12.7 us.
At 2048 top-k slots the launch plan takes 16 splits there: this kernel and the merge of the one split with keys
then took 13.0 us together (sparse_mla_paged, replay, the indexer's valid-first top-k). In steps of few tokens
sparse_mla_paged therefore gives the tokens with at most 64 slots to visit to the Triton kernel's programs of 16
heads (its few-keys launch), and this kernel's programs for them return at once (few_keys).

Scope: bf16 q and bf16 rows, D_LAT 512, D_ROPE 64, top-k splits as sparse_mla_hopper's (fp32 partials merged by
sparse_mla_paged). sparse_mla.kernel_choice says where it runs. Over FlashMLA's FP8 rows sparse_mla_hopper runs: a producer
that dequantises into the stage holds a step's fp8 values in registers (120 a thread), which the 64K left beside
these consumers' do not allow.
"""

from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from dsv32ref.kernels.launch import launch
from dsv32ref.kernels.sparse_mla_hopper import (BLOCK_H, BLOCK_N, FLAGS_LAYOUT, LOAD_REGS, LOAD_WARPS, _async_copy,
                                                _cta_barrier, _finish, _load_q, _program_steps, _release_stage,
                                                _rows_of, _step_indices)

__all__ = ["sparse_mla_pairs"]

# consumer 1's registers a thread (O's half takes 128; S, P and the running statistics the rest); consumer 0 gets
# what the producer's and these leave of the 64K (232)
ODD_REGS = gl.constexpr(208)
HALF = gl.constexpr(256)  # the columns of c_kv each consumer owns in O, and a stage's L half
L = gl.constexpr(0)  # a stage's halves: index of its barriers
R = gl.constexpr(1)
# rows of the consumers' statistics in shared memory: consumer 0's running max, the pair's max, and after the loop
# each one's row sums (those two handed over by mbarriers: `hand`, indexed from L_EVEN)
M_EVEN = gl.constexpr(0)
M_PAIR = gl.constexpr(1)
L_EVEN = gl.constexpr(2)
L_ODD = gl.constexpr(3)
# the hand-offs within a pair: hardware named barriers of the two consumer warpgroups (2 x 128 threads: the 256 in
# _arrive's and _wait's asm), ids past the ones Triton's own barriers take (0-3 in its sm_90a builds of this
# kernel): the two maxima, P0 (over block 0's k_pe) and P1
BAR_M_EVEN = gl.constexpr(8)
BAR_M_PAIR = gl.constexpr(9)
BAR_P_EVEN = gl.constexpr(10)
BAR_P_ODD = gl.constexpr(11)
# each consumer's register layouts (one warpgroup): S (64 x 64), O's half (64 x 256), P as an MMA's A operand
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))


@gluon.jit
def _opaque_zero(j):
    """0, computed from the loop counter j where the compiler cannot see it: shared-memory views indexed by it are
    rebuilt each step instead of being hoisted out of the loop (the MMAs' 64-bit descriptors, dozens of them,
    otherwise spill)."""
    return gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [j], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _arrive(j, bar: gl.constexpr):
    """This warpgroup's threads arrive at named barrier `bar` and go on (bar.arrive): what each stored to shared
    memory before is visible to the other consumer once its _wait(bar) passes. (The id goes to the asm as a register
    made from the loop counter j: inline asm takes tensors.)"""
    gl.inline_asm_elementwise("bar.arrive $1, 256;\nmov.u32 $0, 0;", "=r,r", [_opaque_zero(j) + bar],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait(j, bar: gl.constexpr):
    """This warpgroup waits at named barrier `bar` until the other consumer's threads have arrived (bar.sync over
    both warpgroups). Each barrier is used once a pair by each side, and neither side can arrive twice before the
    other has waited: the next arrive follows a hand-off the other way."""
    gl.inline_asm_elementwise("bar.sync $1, 256;\nmov.u32 $0, 0;", "=r,r", [_opaque_zero(j) + bar],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pair_views(q_lat, q_pe, k_lat, k_pe, j):
    """Pair j's views: q's two parts, block 0's c_kv and k_pe, block 1's (indexed by _opaque_zero(j))."""
    z = _opaque_zero(j)
    return q_lat.index(z), q_pe.index(z), k_lat.index(z), k_pe.index(z), k_lat.index(z + 1), k_pe.index(z + 1)


@gluon.jit
def _masked_scores(s, valid_st, s_l: gl.constexpr):
    """Raw scores (64 heads x 64 keys), -inf at the keys the stage's flags mark invalid. The scale comes later, in
    one FFMA with the max (exp2(s sm_scale_log2 - m)), and on the row max (the scale is > 0: the max of the scaled
    scores, bit for bit)."""
    valid = valid_st.load(gl.SliceLayout(0, s_l)) != 0
    return gl.where(valid[None, :], s, float("-inf"))


@gluon.jit
def _publish(smem, value, bar):
    """value into shared memory, visible to the other partitions once mbarrier `bar` completes (read by plain
    loads: no proxy fence)."""
    smem.store(value)
    _cta_barrier()  # the warpgroup's stores are all made
    mbarrier.arrive(bar)


@gluon.jit
def _release(bar):
    """Every warp of the warpgroup is done with what `bar` guards (their MMAs waited), then one arrive."""
    _cta_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _rescale(m_old, m_new):
    """exp2(m_old - m_new), 0 where m_old is -inf, 1 where both are (a row with no valid key yet)."""
    return gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_old - m_new))


@gluon.jit
def _row_sums(l_i, stats, mine: gl.constexpr, theirs: gl.constexpr, hand, s_l: gl.constexpr):
    """This consumer's row sums published, the other's added: P's row sums over the whole top-k."""
    _publish(stats.index(mine), l_i, hand.index(mine - L_EVEN))
    mbarrier.wait(hand.index(theirs - L_EVEN), 0)
    return l_i + stats.index(theirs).load(gl.SliceLayout(1, s_l))


@gluon.jit
def _consumer_start(q_bar):
    """A consumer's running max (-inf), row sums, O's half, S's zeros; once q has landed."""
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_L)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
    mbarrier.wait(q_bar, 0)
    return m_i, l_i, acc, s_zero


@gluon.jit
def _write_half(acc, m_i, l_i, out, C0: gl.constexpr, WRITE_LSE: gl.constexpr, D_LAT: gl.constexpr,
                NUM_SPLITS: gl.constexpr):
    """This consumer's columns of O (from C0) and, with WRITE_LSE, the logsumexp: sparse_mla_hopper's epilogue.
    out = (out_ptr, its two strides, lse_ptr, its stride, token, first head, heads, split)."""
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, split = out
    _finish(acc, m_i, l_i, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, split, C0, WRITE_LSE, D_LAT,
            NUM_SPLITS, S_L, O_L)


@gluon.jit
def _scores_even_l(q_lat, k_lat, ready, j, s_zero):
    """Pair j's S0 = q K0^T, its first part issued (not waited): c_kv's first half, once block 0's L half has
    landed."""
    z = _opaque_zero(j)
    mbarrier.wait(ready.index(2 * 0 + L), j & 1)
    fence_async_shared()  # the copies' generic-proxy writes, visible to the wgmma's async proxy
    return warpgroup_mma(q_lat.index(z).slice(0, HALF, dim=1), k_lat.index(z).slice(0, HALF, dim=1).permute((1, 0)),
                         s_zero, use_acc=False, is_async=True)


@gluon.jit
def _scores_even_r(q_lat, q_pe, k_lat, k_pe, ready, j, s):
    """Pair j's S0 finished: c_kv's second half and k_pe, once block 0's R half has landed; every MMA waited."""
    z = _opaque_zero(j)
    mbarrier.wait(ready.index(2 * 0 + R), j & 1)
    fence_async_shared()
    s = warpgroup_mma(q_lat.index(z).slice(HALF, HALF, dim=1), k_lat.index(z).slice(HALF, HALF, dim=1).permute((1, 0)),
                      s, is_async=True)
    s = warpgroup_mma(q_pe.index(z), k_pe.index(z).permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s, ))


@gluon.jit
def _even_pair(smem, sm_scale_log2, j, s, m_i, l_i, acc, s_zero, NEXT: gl.constexpr):
    """Consumer 0's pair j, its S0 given (waited); with NEXT, pair j + 1's S0 issued behind P1 V1 (the tensor cores
    get work across the pair boundary) and returned waited. -> (S0 of pair j + 1 or s, m_i, l_i, acc)."""
    q_lat, q_pe, k_lat, k_pe, p_odd, valid_smem, stats, q_bar, ready, free, hand = smem
    qz, qz_pe, k0, k0_pe, k1, k1_pe = _pair_views(q_lat, q_pe, k_lat, k_pe, j)
    s = _masked_scores(s, valid_smem.index(0), S_L)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * sm_scale_log2)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * sm_scale_log2 - m_safe[:, None])
    alpha = _rescale(m_i, m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    stats.index(M_EVEN).store(m_new)
    _arrive(j, BAR_M_EVEN)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_L), k0.slice(0, HALF, dim=1), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(free.index(2 * 0 + L))
    _wait(j, BAR_M_PAIR)  # the pair's max, from consumer 1
    m_pair = stats.index(M_PAIR).load(gl.SliceLayout(1, S_L))
    beta = _rescale(m_new, m_pair)
    k0_pe.store((p * beta[:, None]).to(gl.bfloat16))  # P0 over block 0's k_pe
    fence_async_shared()  # for consumer 1's MMA (the async proxy)
    _arrive(j, BAR_P_EVEN)
    l_i = l_i * beta
    acc = acc * gl.convert_layout(beta, gl.SliceLayout(1, O_L))[:, None]
    _wait(j, BAR_P_ODD)
    acc = warpgroup_mma(p_odd, k1.slice(0, HALF, dim=1), acc, is_async=True)
    if NEXT:  # pair j + 1's first QK^T part behind P1 V1; then P1 V1 waited for (MMA groups retire in order)
        s_next = _scores_even_l(q_lat, k_lat, ready, j + 1, s_zero)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        _release(free.index(2 * 1 + L))
        s = _scores_even_r(q_lat, q_pe, k_lat, k_pe, ready, j + 1, s_next)
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _release(free.index(2 * 1 + L))
    return s, m_pair, l_i, acc


@gluon.jit
def _consume_even(smem, out, sm_scale_log2, n_pairs, D_LAT: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """Consumer 0: block 0 of each pair, O's columns 0-255 (the module docstring); the first pair's S0 before the
    loop, each later one issued inside the pair before it (_even_pair)."""
    q_lat, q_pe, k_lat, k_pe, p_odd, valid_smem, stats, q_bar, ready, free, hand = smem
    m_i, l_i, acc, s_zero = _consumer_start(q_bar)
    if n_pairs > 0:
        s = _scores_even_r(q_lat, q_pe, k_lat, k_pe, ready, 0, _scores_even_l(q_lat, k_lat, ready, 0, s_zero))
        for j in range(n_pairs - 1):
            s, m_i, l_i, acc = _even_pair(smem, sm_scale_log2, j, s, m_i, l_i, acc, s_zero, True)
        s, m_i, l_i, acc = _even_pair(smem, sm_scale_log2, n_pairs - 1, s, m_i, l_i, acc, s_zero, False)
    l_i = _row_sums(l_i, stats, L_EVEN, L_ODD, hand, S_L)
    _write_half(acc, m_i, l_i, out, 0, False, D_LAT, NUM_SPLITS)


@gluon.jit
def _consume_odd(smem, out, sm_scale_log2, n_pairs, D_LAT: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """Consumer 1: block 1 of each pair, O's columns 256-511, and the logsumexp (the module docstring)."""
    q_lat, q_pe, k_lat, k_pe, p_odd, valid_smem, stats, q_bar, ready, free, hand = smem
    m_i, l_i, acc, s_zero = _consumer_start(q_bar)
    for j in range(n_pairs):
        ph = j & 1
        qz, qz_pe, k0, k0_pe, k1, k1_pe = _pair_views(q_lat, q_pe, k_lat, k_pe, j)
        mbarrier.wait(ready.index(2 * 1 + R), ph)
        fence_async_shared()
        s = warpgroup_mma(qz.slice(HALF, HALF, dim=1), k1.slice(HALF, HALF, dim=1).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma(qz_pe, k1_pe.permute((1, 0)), s, is_async=True)
        mbarrier.wait(ready.index(2 * 1 + L), ph)
        fence_async_shared()
        s = warpgroup_mma(qz.slice(0, HALF, dim=1), k1.slice(0, HALF, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = _masked_scores(s, valid_smem.index(1), S_L)
        _wait(j, BAR_M_EVEN)  # consumer 0's running max (the last pair's max included)
        m_pair = gl.maximum(stats.index(M_EVEN).load(gl.SliceLayout(1, S_L)), gl.max(s, axis=1) * sm_scale_log2)
        stats.index(M_PAIR).store(m_pair)
        _arrive(j, BAR_M_PAIR)
        m_safe = gl.where(m_pair == float("-inf"), 0.0, m_pair)
        p = gl.exp2(s * sm_scale_log2 - m_safe[:, None])
        alpha = _rescale(m_i, m_pair)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        pb = p.to(gl.bfloat16)
        acc = warpgroup_mma(gl.convert_layout(pb, P_L), k1.slice(HALF, HALF, dim=1), acc, is_async=True)
        p_odd.store(pb)
        fence_async_shared()
        _arrive(j, BAR_P_ODD)
        _wait(j, BAR_P_EVEN)
        acc = warpgroup_mma(k0_pe, k0.slice(HALF, HALF, dim=1), acc, is_async=True)  # P0, over block 0's k_pe
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # P1 V1 done: block 1's R half is free
        _release(free.index(2 * 1 + R))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _release(free.index(2 * 0 + R))
        m_i = m_pair
    l_i = _row_sums(l_i, stats, L_ODD, L_EVEN, hand, S_L)
    _write_half(acc, m_i, l_i, out, HALF, True, D_LAT, NUM_SPLITS)


@gluon.jit
def _copy_half(k_lat_st, k_pe_st, base, ok, half: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """One half of a block's rows into its stage by cp.async: L = c_kv's first 256 columns, R = the other 256 and
    k_pe. Invalid rows (ok False) are not read: their stage rows are zero-filled."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])  # 16 B per thread per copy
    offs = gl.arange(0, HALF, gl.SliceLayout(0, ld))
    c0: gl.constexpr = half * HALF
    _async_copy(k_lat_st.slice(c0, HALF, dim=1), base + c0 + offs[None, :], mask=ok[:, None])
    if half == R:
        offs_pe = gl.arange(0, D_ROPE, gl.SliceLayout(0, ld))
        _async_copy(k_pe_st, base + D_LAT + offs_pe[None, :], mask=ok[:, None])


@gluon.jit
def _block_rows(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, i, end, seq_len, block_size, rows_per_block,
                num_blocks):
    """Step i's 64 rows: (their base pointers (64, 1), which are valid (64,)); entries past `end` are invalid."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])
    idx = _step_indices(idx_row_ptr, i, end, gl.SliceLayout(1, ld))
    row = _rows_of(idx, bt_row_ptr, seq_len, block_size, rows_per_block, num_blocks)
    return cache_ptr + row.to(gl.int64)[:, None] * stride_cs, row >= 0


@gluon.jit
def _fill(k_lat, k_pe, valid_smem, ready, free, b: gl.constexpr, half: gl.constexpr, base, ok, ph,
          FLAGS: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """Block b's half into its stage once the consumers have freed it (a fresh barrier passes); with FLAGS, the
    block's validity flags too; then `ready`."""
    mbarrier.wait(free.index(2 * b + half), ph ^ 1)
    if FLAGS:
        valid_smem.index(b).store(ok.to(gl.int8))
    _copy_half(k_lat.index(b), k_pe.index(b), base, ok, half, D_LAT, D_ROPE)
    _release_stage(ready.index(2 * b + half))


@gluon.jit
def _produce_pairs(q_ptr, stride_qt, stride_qh, cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, t, h0, H, k_end, it0,
                   it1, n_pairs, seq_len, block_size, rows_per_block, num_blocks, q_lat, q_pe, k_lat, k_pe,
                   valid_smem, q_bar, ready, free, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """The producer: q once, then per pair V0L, V1R, V0R, V1L. A pair's second block past the program's steps
    (an odd count) is all invalid: zero-filled, flagged 0."""
    _load_q(q_ptr, stride_qt, stride_qh, t, h0, H, q_lat.index(0), q_pe.index(0), q_bar, D_LAT, D_ROPE)
    end = gl.minimum(k_end, it1 * BLOCK_N)  # this split's entries
    for j in range(n_pairs):
        ph = j & 1
        base0, ok0 = _block_rows(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, it0 + 2 * j, end, seq_len,
                                 block_size, rows_per_block, num_blocks)
        base1, ok1 = _block_rows(cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, it0 + 2 * j + 1, end, seq_len,
                                 block_size, rows_per_block, num_blocks)
        _fill(k_lat, k_pe, valid_smem, ready, free, 0, L, base0, ok0, ph, True, D_LAT, D_ROPE)
        _fill(k_lat, k_pe, valid_smem, ready, free, 1, R, base1, ok1, ph, True, D_LAT, D_ROPE)
        _fill(k_lat, k_pe, valid_smem, ready, free, 0, R, base0, ok0, ph, False, D_LAT, D_ROPE)
        _fill(k_lat, k_pe, valid_smem, ready, free, 1, L, base1, ok1, ph, False, D_LAT, D_ROPE)


@gluon.jit
def _pair_buffers(D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """Shared memory: q, the pair's two blocks, P1, the blocks' flags, the consumers' row statistics (M_EVEN,
    M_PAIR, L_EVEN, L_ODD rows), and the barriers: q's, each stage half's `ready` (every producer thread's copies
    plus one release) and `free` (one arrive), the row sums' hand-offs (one arrive)."""
    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LAT], gl.bfloat16)
    pe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    gl.static_assert(D_ROPE == BLOCK_N, "P0 is stored over block 0's k_pe (64 x 64)")
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, D_LAT], lat_sl)  # [1, ...]: see _opaque_zero
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, D_ROPE], pe_sl)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_LAT], lat_sl)
    k_pe = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], pe_sl)
    p_odd = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
    valid_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], FLAGS_LAYOUT)
    stats = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], FLAGS_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=LOAD_WARPS * 32)
    for i in gl.static_range(4):
        mbarrier.init(ready.index(i), count=LOAD_WARPS * 32 + 1)
        mbarrier.init(free.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(hand.index(i), count=1)
    return q_lat, q_pe, k_lat, k_pe, p_odd, valid_smem, stats, q_bar, ready, free, hand


@gluon.jit
def _sparse_mla_pairs_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, H, D_LAT + D_ROPE] bf16
    cache_ptr, stride_cs,  # latent cache rows (stride_cs: one token's row)
    block_table_ptr, stride_bt, req_ptr, seq_lens_ptr,  # [B, max_blocks], [T], [B]
    idx_ptr, stride_it,  # top-k [T, K] int32
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,  # out [T, H, D_LAT] bf16, lse [T, H] fp32
    sm_scale_log2, H, K, block_size, rows_per_block, B, max_blocks, num_blocks,
    few_keys,  # tokens with at most this many top-k slots to visit are left alone (sparse_mla's few-keys launch)
    D_LAT: gl.constexpr, D_ROPE: gl.constexpr, VALID_FIRST: gl.constexpr, NUM_SPLITS: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(D_LAT == 2 * HALF, "each consumer owns half of c_kv's 512 columns")
    n_hb = gl.cdiv(H, BLOCK_H)  # a token's head blocks are neighbours in the grid: their gathers share L2
    t = gl.program_id(0) // n_hb
    h0 = (gl.program_id(0) % n_hb) * BLOCK_H
    seq_len, k_end, split, it0, it1, idx_row_ptr, bt_row_ptr = _program_steps(
        req_ptr, seq_lens_ptr, idx_ptr, stride_it, block_table_ptr, stride_bt, t, K, B, max_blocks, block_size,
        VALID_FIRST, NUM_SPLITS)
    if k_end <= few_keys:
        return
    n_pairs = gl.cdiv(gl.maximum(it1 - it0, 0), 2)
    q_lat, q_pe, k_lat, k_pe, p_odd, valid_smem, stats, q_bar, ready, free, hand = _pair_buffers(D_LAT, D_ROPE)
    smem = (q_lat, q_pe, k_lat, k_pe, p_odd, valid_smem, stats, q_bar, ready, free, hand)
    out = (out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, split)
    gl.warp_specialize([  # constexprs passed on their own: inside a tuple they turn into values
        (_consume_even, (smem, out, sm_scale_log2, n_pairs, D_LAT, NUM_SPLITS)),
        (_consume_odd, (smem, out, sm_scale_log2, n_pairs, D_LAT, NUM_SPLITS)),
        (_produce_pairs, (q_ptr, stride_qt, stride_qh, cache_ptr, stride_cs, idx_row_ptr, bt_row_ptr, t, h0, H,
                          k_end, it0, it1, n_pairs, seq_len, block_size, rows_per_block, num_blocks, q_lat, q_pe,
                          k_lat, k_pe, valid_smem, q_bar, ready, free, D_LAT, D_ROPE)),
    ], [4, LOAD_WARPS], [ODD_REGS, LOAD_REGS])


def sparse_mla_pairs(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale, outputs,
                     splits: int, valid_first: bool = False, few_keys: int = -1) -> None:
    """The launch (inputs checked by sparse_mla_paged, `why_not` None): one program per (token, 64 heads, top-k
    split) into outputs = (out, out's two strides, lse, lse's stride), or the fp32 partials with splits > 1; the
    tokens with at most few_keys top-k slots to visit are left alone (sparse_mla_paged's few-keys launch writes
    them)."""
    T, H = q.shape[:2]
    nb, bs = latent_cache.shape[:2]
    o_arg, o_s0, o_s1, l_arg, l_s0 = outputs
    launch(_sparse_mla_pairs_kernel, (T * triton.cdiv(H, 64), 1, splits),
        q, q.stride(0), q.stride(1), latent_cache, latent_cache.stride(1),
        block_table, block_table.stride(0), req_indices, seq_lens, topk_indices, topk_indices.stride(0),
        o_arg, o_s0, o_s1, l_arg, l_s0,
        sm_scale * math.log2(math.e), H, topk_indices.shape[1], bs,
        latent_cache.stride(0) // latent_cache.stride(1), seq_lens.shape[0], block_table.shape[1], nb, few_keys,
        D_LAT=q.shape[-1] - 64, D_ROPE=64, VALID_FIRST=valid_first, NUM_SPLITS=splits, num_warps=4)
