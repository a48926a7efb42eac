"""sparse_mla in Gluon (triton.experimental.gluon) for Hopper: the layouts, copies and MMAs written out.

An experiment beside the library's Triton kernel (same math, same result), for the benchmark: the query
tile sits in shared memory for the whole program (the Triton build reads it again every step), the two
warpgroups split S's 64 keys and the output's 512 columns by layout ([4, 2] warps on both MMAs), the next
step's rows are gathered with cp.async into the other half of a double buffer while this step computes,
and every wgmma is issued asynchronously and waited where its result is needed (with overlap_pv, a step's
PV is waited for only after the next step's QK^T was issued).

    shared memory (bf16): q 64 x 576 (72 KiB) + 2 stages of K 64 x 576 (144 KiB) + P 64 x 64 (8 KiB) = 224 KiB

One program per (token, 64 heads); bf16 only; no top-k splits; the top-k is resolved to cache rows by a
first launch (the library's `_resolve_rows`).

The library's sm_90 kernel (dsv32ref.kernels.sparse_mla_hopper) grew from this one: the same layouts, with the
gather moved to a producer warpgroup and barriers per stage.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from dsv32ref.kernels.sparse_mla import _program_keys, _resolve_rows, check_inputs
from dsv32ref.kernels.sparse_mla_hopper import _finish, _issue_pv, _shared_buffers, _softmax_step

__all__ = ["sparse_mla_gluon"]


@triton.jit
def _resolve_rows_kernel(req_ptr, seq_lens_ptr, idx_ptr, stride_it, block_table_ptr, stride_bt, rows_ptr, K, B,
                         max_blocks, block_size, rows_per_block, num_blocks):
    t = tl.program_id(0)
    req, seq_len, k_end, it0, it1 = _program_keys(req_ptr, seq_lens_ptr, t, 0, K, B, max_blocks, block_size, 64, 1,
                                                  False)
    _resolve_rows(idx_ptr + t * stride_it, block_table_ptr + req * stride_bt, rows_ptr + t * K, 0, K, seq_len,
                  block_size, rows_per_block, num_blocks)


@gluon.jit
def _issue_gather(cache_ptr, stride_cs, rows_row_ptr, step, K, k_lat_buf, k_pe_buf,
                  D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_N: gl.constexpr, ld: gl.constexpr):
    """cp.async the latent rows of `step`'s keys into one stage of the buffers (invalid rows: zeros)."""
    offs_n = step * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld))
    row = gl.load(rows_row_ptr + offs_n, mask=offs_n < K, other=-1)
    base = cache_ptr + row.to(gl.int64)[:, None] * stride_cs
    ok = (row >= 0)[:, None]
    offs_lat = gl.arange(0, D_LAT, gl.SliceLayout(0, ld))
    offs_pe = gl.arange(0, D_ROPE, gl.SliceLayout(0, ld))
    cp.async_copy_global_to_shared(k_lat_buf, base + offs_lat[None, :], mask=ok)
    cp.async_copy_global_to_shared(k_pe_buf, base + D_LAT + offs_pe[None, :], mask=ok)
    cp.commit_group()


@gluon.jit
def _sparse_mla_gluon_kernel(q_ptr, stride_qt, stride_qh, cache_ptr, stride_cs, rows_ptr, out_ptr, stride_ot,
                             stride_oh, lse_ptr, stride_lt, sm_scale_log2, H, K,
                             D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                             OVERLAP_PV: gl.constexpr, num_warps: gl.constexpr):
    t = gl.program_id(0)
    h0 = gl.program_id(1) * BLOCK_H
    # registers: a copy layout (16 B per thread per cp.async), and the two MMAs' accumulators, each split
    # over the warpgroups along N (S: 32 of the 64 keys each; O: 256 of the 512 columns each)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    q_lat, q_pe, k_lat, k_pe, p_smem = _shared_buffers(D_LAT, D_ROPE)

    # q once: 64 heads x 576
    offs_h = h0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ld))
    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    h_ok = (offs_h < H)[:, None]
    cp.async_copy_global_to_shared(q_lat, q_row + gl.arange(0, D_LAT, gl.SliceLayout(0, ld))[None, :], mask=h_ok)
    cp.async_copy_global_to_shared(q_pe, q_row + D_LAT + gl.arange(0, D_ROPE, gl.SliceLayout(0, ld))[None, :],
                                   mask=h_ok)
    cp.commit_group()
    rows_row_ptr = rows_ptr + t * K
    _issue_gather(cache_ptr, stride_cs, rows_row_ptr, 0, K, k_lat.index(0), k_pe.index(0), D_LAT, D_ROPE, BLOCK_N, ld)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, o_l)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    if OVERLAP_PV:
        acc = warpgroup_mma_init(acc)  # carried through the loop as an in-flight accumulator
    n_steps = gl.cdiv(K, BLOCK_N)
    for i in range(n_steps):
        st = i % 2
        kl = k_lat.index(st)
        kp = k_pe.index(st)
        if OVERLAP_PV:
            cp.wait_group(0)  # this thread's copies of step i (and q) have landed
            gl.thread_barrier()  # ... and every thread's
            fence_async_shared()  # generic-proxy writes visible to the wgmma's async proxy
            s = warpgroup_mma(q_lat, kl.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_pe, kp.permute((1, 0)), s, is_async=True)
            # the previous step's PV ran meanwhile; wait for it (the two S groups may still run), then every
            # warpgroup is done with the other stage and with P
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc, ))
            gl.thread_barrier()
            _issue_gather(cache_ptr, stride_cs, rows_row_ptr, i + 1, K, k_lat.index(1 - st), k_pe.index(1 - st), D_LAT,
                          D_ROPE, BLOCK_N, ld)
        else:
            # the next step's rows into the other stage (read by step i - 1, whose MMAs were waited for)
            _issue_gather(cache_ptr, stride_cs, rows_row_ptr, i + 1, K, k_lat.index(1 - st), k_pe.index(1 - st), D_LAT,
                          D_ROPE, BLOCK_N, ld)
            cp.wait_group(1)  # this thread's copies of step i (and q) have landed
            gl.thread_barrier()  # ... and every thread's
            fence_async_shared()
            s = warpgroup_mma(q_lat, kl.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_pe, kp.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        offs_s = i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_l))
        valid = gl.load(rows_row_ptr + offs_s, mask=offs_s < K, other=-1) >= 0
        p, m_new, alpha = _softmax_step(s, valid, m_i, sm_scale_log2)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = _issue_pv(p, alpha, p_smem, kl, acc, o_l)
        if not OVERLAP_PV:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            gl.thread_barrier()  # every warp is done with stage st and P before they are written again
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    cp.wait_group(0)
    _finish(acc, m_i, l_i, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, h0, H, D_LAT, s_l, o_l)


def sparse_mla_gluon(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale, out, lse=None,
                     overlap_pv: bool = False):
    """sparse_mla_paged's result (bf16, D_LAT 512, D_ROPE 64, no splits) from the Gluon kernel. overlap_pv: a
    step's PV runs while the next step's copies are awaited and its QK^T issued (else each PV is waited for
    at once; the default: the overlap was 9 % slower on the H200, data/sparse_mla_gluon_sweep.json)."""
    T, H, d_lat, d_rope, B = check_inputs(q, latent_cache, block_table, req_indices, seq_lens, topk_indices, sm_scale,
                                          out, lse)
    if q.dtype != torch.bfloat16 or (d_lat, d_rope) != (512, 64):
        raise ValueError(f"sparse_mla_gluon: bf16 with D_LAT 512, D_ROPE 64 only, got {q.dtype}, {d_lat}, {d_rope}")
    if T == 0:
        return out, lse
    lse_arg = lse if lse is not None else torch.empty(T, H, dtype=torch.float32, device=q.device)
    K = topk_indices.shape[1]
    rows = torch.empty(T, K, dtype=torch.int32, device=q.device)
    _resolve_rows_kernel[(T,)](req_indices, seq_lens, topk_indices, topk_indices.stride(0), block_table,
                               block_table.stride(0), rows, K, B, block_table.shape[1], latent_cache.shape[1],
                               latent_cache.stride(0) // latent_cache.stride(1), latent_cache.shape[0], num_warps=4)
    _sparse_mla_gluon_kernel[(T, triton.cdiv(H, 64))](
        q, q.stride(0), q.stride(1), latent_cache, latent_cache.stride(1), rows, out, out.stride(0), out.stride(1),
        lse_arg, lse_arg.stride(0), sm_scale * math.log2(math.e), H, K,
        D_LAT=d_lat, D_ROPE=d_rope, BLOCK_H=64, BLOCK_N=64, OVERLAP_PV=overlap_pv, num_warps=8)
    return out, lse
