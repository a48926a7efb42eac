"""Assemble the two queries the sparse path consumes, one launch per layer.

Motivation. After q_b_proj, the W_UK BMM and the indexer's wq_b / weights_proj GEMMs, the query side still
needs: RoPE (interleaved) on each head's q_pe; the MQA query [q~ | q_pe] that sparse attention reads
(q~ = W_UK^T q_nope, from the BMM); RoPE on the first qk_rope values of each indexer head (half-split on
DeepSeek-V3.2, interleaved on GLM-5.x); the indexer weights scaled by index_n_heads^-1/2. One program per
(token, head) does MLA head h (h < H) and indexer head h with its weight (h < index_n_heads); under tensor
parallelism a rank has fewer MLA heads than the replicated indexer, so the grid covers the larger count.
Memory-bound: per token, 2 (H (D_LAT + 2 D_ROPE) + 2 H_I D_I + H_I) bytes of bf16 plus 4 H_I of fp32 weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv32ref.checks import (check_bool, check_disjoint, check_range, check_rope_table, check_same_device, check_tensor,
                             device_value_checks_on)
from dsv32ref.kernels.fp8 import cast, hadamard, quantize_e4m3
from dsv32ref.kernels.fused_norm_rope import _rope_pairs, rope_apply, rope_layout
from dsv32ref.kernels.launch import launch

__all__ = ["fused_q"]


@triton.jit
def _rope_hadamard_fp8(src, cos, sin, hadamard_scale, ROPE: tl.constexpr, D_I: tl.constexpr, LOG2_D_I: tl.constexpr,
                       INTERLEAVED: tl.constexpr, DTYPE: tl.constexpr):
    """Deployed numerics of one indexer query head: RoPE, then the orthonormal Hadamard transform, each
    rounded to the activation dtype as the unfused path stores them, then fp8 e4m3 with one ue8m0 (power of
    two) scale for the D_I (<= 128) values, as fused_norm_rope writes an FP8 key. Returns (fp8 values (D_I,), scale)."""
    partner, angle, first, roped = rope_layout(D_I, ROPE, INTERLEAVED)
    x = tl.load(src + tl.arange(0, D_I)).to(tl.float32)
    xp = tl.load(src + partner, mask=roped, other=0.0).to(tl.float32)
    x = cast(rope_apply(x, xp, cos, sin, angle, first, roped), DTYPE).to(tl.float32)
    x = cast(hadamard(x, hadamard_scale, D_I, LOG2_D_I), DTYPE).to(tl.float32)
    codes, scale = quantize_e4m3(x, -22)
    return codes.to(tl.float8e4nv, bitcast=True), scale


@triton.jit
def _fused_q_kernel(
    q_lat_ptr, stride_lt, stride_lh,  # q~ [T, H, D_LAT] (W_UK BMM output)
    q_ptr, stride_qt, stride_qh,  # q [T, H, NOPE + ROPE] (q_b_proj output); q_pe at offset NOPE
    q_mqa_ptr, stride_mt, stride_mh,  # out [T, H, D_LAT + ROPE]
    qi_ptr, stride_it, stride_ih,  # indexer q [T, H_I, D_I] (wq_b output)
    qi_out_ptr, stride_ot, stride_oh,  # out [T, H_I, D_I]
    w_ptr, stride_wt, w_out_ptr, stride_wo,  # weights_proj output [T, H_I] -> fp32, scaled
    pos_ptr, cos_ptr, sin_ptr, stride_cs, n_pos, weight_scale, hadamard_scale, H, H_I,
    NOPE: tl.constexpr, ROPE: tl.constexpr, D_LAT: tl.constexpr, D_I: tl.constexpr,
    INDEXER_INTERLEAVED: tl.constexpr, HAS_INDEXER: tl.constexpr, FP8: tl.constexpr, LOG2_D_I: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # A position outside cos/sin [0, n_pos) is clamped into the table: never an out-of-bounds read, but that
    # token's RoPE is then meaningless (the launcher's debug mode raises on it instead).
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t), 0), n_pos - 1)
    cos = cos_ptr + pos * stride_cs
    sin = sin_ptr + pos * stride_cs
    if h < H:
        o = tl.arange(0, D_LAT)
        dst = q_mqa_ptr + t * stride_mt + h * stride_mh
        tl.store(dst + o, cast(tl.load(q_lat_ptr + t * stride_lt + h * stride_lh + o), q_mqa_ptr.dtype.element_ty))
        _rope_pairs(q_ptr + t * stride_qt + h * stride_qh + NOPE, dst + D_LAT, cos, sin, ROPE // 2, True)
    if HAS_INDEXER:
        if h < H_I:
            src = qi_ptr + t * stride_it + h * stride_ih
            out = qi_out_ptr + t * stride_ot + h * stride_oh
            oi = tl.arange(0, D_I)
            w = tl.load(w_ptr + t * stride_wt + h).to(tl.float32)
            if FP8:
                q8, q_scale = _rope_hadamard_fp8(src, cos, sin, hadamard_scale, ROPE, D_I, LOG2_D_I,
                                                 INDEXER_INTERLEAVED, qi_ptr.dtype.element_ty)
                tl.store(out + oi, q8)
                tl.store(w_out_ptr + t * stride_wo + h, w * weight_scale * q_scale)  # ReLU(s q.k) = s ReLU(q.k), s > 0
            else:
                nope = oi >= ROPE
                tl.store(out + oi, tl.load(src + oi, mask=nope).to(qi_out_ptr.dtype.element_ty), mask=nope)
                _rope_pairs(src, out, cos, sin, ROPE // 2, INDEXER_INTERLEAVED)
                tl.store(w_out_ptr + t * stride_wo + h, w * weight_scale)


def _check_indexer(q_idx, q_idx_out, weights, weights_out, T: int, rope: int) -> tuple[int, int]:
    """The indexer's inputs -> (index_n_heads, index_head_dim); (1, 16), unused, without q_idx."""
    given = {"q_idx_out": q_idx_out, "weights": weights, "weights_out": weights_out}
    if q_idx is None:
        if any(v is not None for v in given.values()):
            raise ValueError(f"fused_q: {[k for k, v in given.items() if v is not None]} given without q_idx")
        return 1, 16
    floats = (torch.bfloat16, torch.float16, torch.float32)
    _, h_i, d_i = check_tensor("q_idx", q_idx, shape=(T, None, None), dtype=floats, dense_dims=1).shape
    check_tensor("q_idx_out", q_idx_out, shape=(T, h_i, d_i), dtype=(q_idx.dtype, torch.float8_e4m3fn), dense_dims=1)
    check_tensor("weights", weights, shape=(T, h_i), dtype=floats, dense_dims=1)
    check_tensor("weights_out", weights_out, shape=(T, h_i), dtype=torch.float32, dense_dims=1)
    if d_i < rope:
        raise ValueError(f"fused_q: index_head_dim ({d_i}) must be >= qk_rope_head_dim ({rope})")
    return h_i, d_i


def fused_q(
    q_lat: torch.Tensor, q: torch.Tensor, q_mqa: torch.Tensor, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor,
    q_idx: torch.Tensor | None = None, q_idx_out: torch.Tensor | None = None,
    weights: torch.Tensor | None = None, weights_out: torch.Tensor | None = None,
    indexer_interleaved: bool = False,
) -> None:
    """q_mqa[t, h] = [q_lat[t, h] | RoPE(q[t, h, nope:])]; q_idx_out = q_idx with RoPE on its first rope values;
    weights_out = weights * index_n_heads^-1/2.

    q_lat [T, H, D_LAT]; q [T, H, nope + rope]; q_mqa [T, H, D_LAT + rope]; cos/sin fp32 [max_pos, rope/2];
    q_idx / q_idx_out [T, H_I, D_I]; weights [T, H_I] (weights_proj's output, in any float dtype: taken in
    fp32); weights_out fp32 [T, H_I].
    Deployed numerics: a float8_e4m3fn q_idx_out (D_I <= 128) receives fp8(Hadamard(RoPE(q_idx)) / s), with
    one ue8m0 scale s per head folded into weights_out (weights * index_n_heads^-1/2 * s), as DeepSeek's
    inference code does. fp8_round_trip(hadamard_transform(.)) in dsv32ref.reference is the same numerics.
    """
    floats = (torch.bfloat16, torch.float16, torch.float32)
    check_bool("fused_q: indexer_interleaved", indexer_interleaved)
    T, H, d_lat = check_tensor("q_lat", q_lat, shape=(None, None, None), dtype=floats, dense_dims=1).shape
    rope = check_rope_table("fused_q", cos, sin)
    nope = check_tensor("q", q, shape=(T, H, None), dtype=floats, dense_dims=1).shape[2] - rope
    if nope < 0:
        raise ValueError(f"fused_q: q.shape[-1] ({q.shape[2]}) must hold qk_nope_head_dim >= 0 plus "
                         f"qk_rope_head_dim (2 x cos.shape[1] = {rope})")
    check_tensor("q_mqa", q_mqa, shape=(T, H, d_lat + rope), dtype=floats, dense_dims=1)
    check_tensor("positions", positions, shape=(T,), dtype=(torch.int64, torch.int32), dense_dims=1)
    has_indexer = q_idx is not None
    h_i, d_i = _check_indexer(q_idx, q_idx_out, weights, weights_out, T, rope)
    for name, v in (("kv_lora_rank", d_lat), ("qk_rope_head_dim", rope), ("index_head_dim", d_i)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"fused_q: {name} must be a power of two, got {v}")
    if device_value_checks_on():  # debug mode: syncs
        check_disjoint("fused_q", {"q_mqa": q_mqa, "q_idx_out": q_idx_out, "weights_out": weights_out},
                       dict(q_lat=q_lat, q=q, positions=positions, cos=cos, sin=sin, q_idx=q_idx, weights=weights))
        check_range("positions", positions, 0, cos.shape[0], "cos.shape[0]")
    fp8 = has_indexer and q_idx_out.dtype == torch.float8_e4m3fn
    if fp8 and d_i > 128:
        raise ValueError(f"fused_q: fp8 q_idx_out needs index_head_dim <= 128 (one scale per head), got {d_i}")
    check_same_device(q_lat=q_lat, q=q, q_mqa=q_mqa, positions=positions, cos=cos, sin=sin, q_idx=q_idx,
                      q_idx_out=q_idx_out, weights=weights, weights_out=weights_out)
    if T == 0:
        return
    qi, qo, w, wo = (q_idx, q_idx_out, weights, weights_out) if has_indexer else (q, q, cos, cos)
    launch(_fused_q_kernel, (T, max(H, h_i)),
        q_lat, q_lat.stride(0), q_lat.stride(1), q, q.stride(0), q.stride(1),
        q_mqa, q_mqa.stride(0), q_mqa.stride(1),
        qi, qi.stride(0), qi.stride(1), qo, qo.stride(0), qo.stride(1),
        w, w.stride(0), wo, wo.stride(0),
        positions, cos, sin, cos.stride(0), cos.shape[0], h_i ** -0.5, d_i ** -0.5, H, h_i,
        NOPE=nope, ROPE=rope, D_LAT=d_lat, D_I=d_i, INDEXER_INTERLEAVED=indexer_interleaved,
        HAS_INDEXER=has_indexer, FP8=fp8, LOG2_D_I=d_i.bit_length() - 1, num_warps=4,
    )
