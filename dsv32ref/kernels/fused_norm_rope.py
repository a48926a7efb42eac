"""After the A-projections: every per-token normalisation, rotation and cache write of one layer, one launch.

Motivation. Between `kv_a_proj_with_mqa` / `q_a_proj` / `indexer.wk` and the next GEMMs, each token needs
    c_q   = RMSNorm(q_c)                           -> feeds q_b_proj and the indexer's wq_b
    c_kv  = RMSNorm(kv[:kv_lora_rank]); k_pe = RoPE_interleaved(kv[kv_lora_rank:])
            -> the latent-cache row [c_kv | k_pe] at slot_mapping[t]
    k^I   = RoPE(LayerNorm(wk x)) on its first qk_rope dims  -> the indexer-key cache at slot_mapping[t]
In PyTorch that is a dozen elementwise launches per layer. They share only the token index, so one
program per token does all of them: 1 launch per layer (IndexShare layers pass no indexer key and skip
that part). Memory-bound: bytes per token = 2 (q_lora + latent + index_head_dim) read
+ the same written (bf16), about 9.6 KB at DeepSeek-V3.2 sizes; FLOPs are negligible.
Slots < 0 are not written (padding tokens, as in vLLM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv32ref.checks import (check_range, check_rope_table, check_same_device, check_scale, check_tensor,
                             device_value_checks_on)
from dsv32ref.kernels.launch import launch

__all__ = ["fused_norm_rope"]


@triton.jit
def _rope_pairs(x_ptr, out_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rotate HALF pairs read at x_ptr, written at out_ptr; interleaved (2i, 2i+1) or halves (i, i+HALF)."""
    i = tl.arange(0, HALF)
    if INTERLEAVED:
        a_off, b_off = 2 * i, 2 * i + 1
    else:
        a_off, b_off = i, i + HALF
    a = tl.load(x_ptr + a_off).to(tl.float32)
    b = tl.load(x_ptr + b_off).to(tl.float32)
    c = tl.load(cos_ptr + i)
    s = tl.load(sin_ptr + i)
    tl.store(out_ptr + a_off, (a * c - b * s).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + b_off, (b * c + a * s).to(out_ptr.dtype.element_ty))


@triton.jit
def _fused_norm_rope_kernel(
    q_c_ptr, stride_q, q_norm_w_ptr, q_c_out_ptr, stride_qo,  # q_c [T, Q_LORA] -> RMSNorm -> q_c_out
    kv_ptr, stride_kv, kv_norm_w_ptr,  # kv [T, KV_LORA + ROPE] (kv_a_proj_with_mqa output)
    latent_ptr, stride_lslot,  # latent cache viewed as [NB * BS, KV_LORA + ROPE]
    ik_ptr, stride_ik, ik_w_ptr, ik_b_ptr,  # indexer key [T, D_I] (wk output), LayerNorm weight/bias
    icache_ptr, stride_islot,  # indexer-key cache viewed as [NB * BS, D_I]
    pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_cs,  # positions [T], slot_mapping [T], cos/sin [P, ROPE/2]
    rms_eps, ln_eps, n_slots, n_pos,  # bounds: slots in [0, NB * BS), positions in [0, P)
    Q_LORA: tl.constexpr, BLOCK_Q: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    D_I: tl.constexpr, HAS_INDEXER: tl.constexpr, INDEXER_INTERLEAVED: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    cos = cos_ptr + pos * stride_cs
    sin = sin_ptr + pos * stride_cs

    # c_q = RMSNorm(q_c): computed in fp32, cast back before the weight (as the reference does)
    oq = tl.arange(0, BLOCK_Q)
    mq = oq < Q_LORA
    x = tl.load(q_c_ptr + t * stride_q + oq, mask=mq, other=0.0).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, axis=0) / Q_LORA + rms_eps)
    wq = tl.load(q_norm_w_ptr + oq, mask=mq, other=0.0)
    tl.store(q_c_out_ptr + t * stride_qo + oq, (wq * x.to(wq.dtype)).to(q_c_out_ptr.dtype.element_ty), mask=mq)

    # A slot outside the cache, or a position outside cos/sin, writes nothing (as a padding token's -1 slot);
    # the launcher's debug mode (dsv32ref.checks.checking_device_values) raises on them instead.
    if (slot >= 0) & (slot < n_slots) & (pos >= 0) & (pos < n_pos):
        # latent row: [RMSNorm(c_kv) | RoPE_interleaved(k_pe)] straight into the paged cache
        ol = tl.arange(0, KV_LORA)
        c = tl.load(kv_ptr + t * stride_kv + ol).to(tl.float32)
        c = c * tl.rsqrt(tl.sum(c * c, axis=0) / KV_LORA + rms_eps)
        wkv = tl.load(kv_norm_w_ptr + ol)
        row = latent_ptr + slot * stride_lslot
        tl.store(row + ol, (wkv * c.to(wkv.dtype)).to(latent_ptr.dtype.element_ty))
        _rope_pairs(kv_ptr + t * stride_kv + KV_LORA, row + KV_LORA, cos, sin, ROPE // 2, True)

        if HAS_INDEXER:
            # k^I = LayerNorm(wk x), then RoPE on its first ROPE values, into the indexer-key cache
            oi = tl.arange(0, D_I)
            k = tl.load(ik_ptr + t * stride_ik + oi).to(tl.float32)
            mean = tl.sum(k, axis=0) / D_I
            kc = k - mean
            k = kc * tl.rsqrt(tl.sum(kc * kc, axis=0) / D_I + ln_eps)
            k = k * tl.load(ik_w_ptr + oi).to(tl.float32) + tl.load(ik_b_ptr + oi).to(tl.float32)
            irow = icache_ptr + slot * stride_islot
            tl.store(irow + oi, k.to(icache_ptr.dtype.element_ty))
            tl.debug_barrier()  # the rotation re-reads what this program just stored
            _rope_pairs(irow, irow, cos, sin, ROPE // 2, INDEXER_INTERLEAVED)


def _check_indexer(index_k, k_norm_weight, k_norm_bias, index_cache, T: int, nb: int, bs: int, rope: int) -> int:
    """The indexer key's inputs -> index_head_dim (16, unused, without an indexer key)."""
    if index_k is None:
        given = {"index_cache": index_cache, "k_norm_weight": k_norm_weight, "k_norm_bias": k_norm_bias}
        if any(v is not None for v in given.values()):
            raise ValueError(f"fused_norm_rope: {[k for k, v in given.items() if v is not None]} given without "
                             f"index_k")
        return 16
    floats = (torch.bfloat16, torch.float16, torch.float32)
    d_i = check_tensor("index_k", index_k, shape=(T, None), dtype=floats, dense_dims=1).shape[1]
    check_tensor("index_cache", index_cache, shape=(nb, bs, d_i), dtype=floats, contiguous=True)
    check_tensor("k_norm_weight", k_norm_weight, shape=(d_i,), dtype=floats, dense_dims=1)
    check_tensor("k_norm_bias", k_norm_bias, shape=(d_i,), dtype=floats, dense_dims=1)
    if d_i < rope:
        raise ValueError(f"fused_norm_rope: index_head_dim ({d_i}) must be >= qk_rope_head_dim ({rope})")
    return d_i


def fused_norm_rope(
    q_c: torch.Tensor, q_a_norm_weight: torch.Tensor, q_c_out: torch.Tensor,
    kv: torch.Tensor, kv_a_norm_weight: torch.Tensor, latent_cache: torch.Tensor,
    positions: torch.Tensor, slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    rms_eps: float,
    index_k: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    k_norm_bias: torch.Tensor | None = None, index_cache: torch.Tensor | None = None,
    indexer_interleaved: bool = False, ln_eps: float = 1e-6,
) -> None:
    """One launch: q_c_out = RMSNorm(q_c); latent_cache[slot] = [RMSNorm(kv[:L]) | RoPE(kv[L:])];
    index_cache[slot] = RoPE(LayerNorm(index_k)) when an indexer key is given.

    q_c [T, q_lora]; kv [T, kv_lora + rope]; index_k [T, D_I]; cos/sin fp32 [max_pos, rope/2] (a table
    indexed by positions [T]); slot_mapping int64 [T]; caches [NB, BS, width]. kv_lora, rope and D_I must be
    powers of two.
    """
    floats = (torch.bfloat16, torch.float16, torch.float32)
    T, q_lora = check_tensor("q_c", q_c, shape=(None, None), dtype=floats, dense_dims=1).shape
    check_tensor("q_c_out", q_c_out, shape=(T, q_lora), dtype=q_c.dtype, dense_dims=1)
    check_tensor("q_a_norm_weight", q_a_norm_weight, shape=(q_lora,), dtype=floats, dense_dims=1)
    nb, bs, width = check_tensor("latent_cache", latent_cache, shape=(None, None, None), dtype=floats,
                                 contiguous=True).shape
    check_tensor("kv", kv, shape=(T, width), dtype=floats, dense_dims=1)
    rope = check_rope_table("fused_norm_rope", cos, sin)
    kv_lora = width - rope
    if kv_lora <= 0:
        raise ValueError(f"fused_norm_rope: latent_cache.shape[-1] ({width}) must exceed qk_rope_head_dim "
                         f"(2 x cos.shape[1] = {rope})")
    check_tensor("kv_a_norm_weight", kv_a_norm_weight, shape=(kv_lora,), dtype=floats, dense_dims=1)
    check_tensor("positions", positions, shape=(T,), dtype=(torch.int64, torch.int32), dense_dims=1)
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtype=(torch.int64, torch.int32), dense_dims=1)
    check_scale("fused_norm_rope: rms_eps", rms_eps)
    check_scale("fused_norm_rope: ln_eps", ln_eps)
    has_indexer = index_k is not None
    d_i = _check_indexer(index_k, k_norm_weight, k_norm_bias, index_cache, T, nb, bs, rope)
    for name, v in (("kv_lora_rank", kv_lora), ("qk_rope_head_dim", rope), ("index_head_dim", d_i)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"fused_norm_rope: {name} must be a power of two, got {v}")
    check_same_device(q_c=q_c, q_a_norm_weight=q_a_norm_weight, q_c_out=q_c_out, kv=kv,
                      kv_a_norm_weight=kv_a_norm_weight, latent_cache=latent_cache, positions=positions,
                      slot_mapping=slot_mapping, cos=cos, sin=sin, index_k=index_k, k_norm_weight=k_norm_weight,
                      k_norm_bias=k_norm_bias, index_cache=index_cache)
    if device_value_checks_on():  # debug mode: syncs
        check_range("positions", positions, 0, cos.shape[0], "cos.shape[0]")
        check_range("slot_mapping", slot_mapping, -1, nb * bs, "-1 (padding) to num_blocks x block_size")
    if T == 0:
        return
    dummy = kv  # never dereferenced when HAS_INDEXER is False
    launch(_fused_norm_rope_kernel, (T,),
        q_c, q_c.stride(0), q_a_norm_weight, q_c_out, q_c_out.stride(0),
        kv, kv.stride(0), kv_a_norm_weight, latent_cache, width,
        index_k if has_indexer else dummy, index_k.stride(0) if has_indexer else 0,
        k_norm_weight if has_indexer else dummy, k_norm_bias if has_indexer else dummy,
        index_cache if has_indexer else dummy, d_i,
        positions, slot_mapping, cos, sin, cos.stride(0), rms_eps, ln_eps, nb * bs, cos.shape[0],
        Q_LORA=q_lora, BLOCK_Q=triton.next_power_of_2(q_lora), KV_LORA=kv_lora, ROPE=rope, D_I=d_i,
        HAS_INDEXER=has_indexer, INDEXER_INTERLEAVED=indexer_interleaved, num_warps=4,
    )
