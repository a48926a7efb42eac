"""After the A-projections: every per-token normalisation, rotation and cache write of one layer, one launch.

Motivation. Between `kv_a_proj_with_mqa` / `q_a_proj` / `indexer.wk` and the next GEMMs, each token needs
    c_q   = RMSNorm(q_c)                           -> feeds q_b_proj and the indexer's wq_b
    c_kv  = RMSNorm(kv[:kv_lora_rank]); k_pe = RoPE_interleaved(kv[kv_lora_rank:])
            -> the latent-cache row [c_kv | k_pe] at slot_mapping[t]
    k^I   = RoPE(LayerNorm(wk x)) on its first qk_rope dims  -> the indexer-key cache at slot_mapping[t]
            (an FP8 key cache: Hadamard-rotated, then quantised)
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

from dsv32ref.cache import LATENT_ROW_BYTES
from dsv32ref.checks import (check_bool, check_disjoint, check_eps, check_range, check_rope_table, check_same_device,
                             check_slots, check_tensor, device_value_checks_on)
from dsv32ref.kernels.fp8 import cast, e4m3_bytes, finite_amax, hadamard, pow2_scale, quantize_e4m3
from dsv32ref.kernels.launch import launch

__all__ = ["fused_norm_rope", "times_weight"]


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
    tl.store(out_ptr + a_off, cast(a * c - b * s, out_ptr.dtype.element_ty))
    tl.store(out_ptr + b_off, cast(b * c + a * s, out_ptr.dtype.element_ty))


@triton.jit
def times_weight(w, x):
    """w * x as the reference's norms compute it: x cast to w's dtype, the product rounded to w's dtype (fp32)."""
    return cast(w.to(tl.float32) * cast(x, w.dtype), w.dtype).to(tl.float32)


@triton.jit
def _layer_norm_at(x_ptr, w_ptr, b_ptr, offs, mean, rstd):
    """LayerNorm's values at offs of the vector at x_ptr, given its mean and 1 / std (fp32)."""
    x = tl.load(x_ptr + offs).to(tl.float32)
    return (x - mean) * rstd * tl.load(w_ptr + offs).to(tl.float32) + tl.load(b_ptr + offs).to(tl.float32)


@triton.jit
def _store_latent_fp8(row_ptr, c_kv, KV_LORA: tl.constexpr):
    """c_kv fp32 (KV_LORA,) -> FlashMLA's row at row_ptr (bytes): fp8 values, then one power-of-two fp32 scale per 128
    (from the group's finite values; a NaN or inf is written as NaN). k_pe, bytes KV_LORA + KV_LORA / 32 on, is the
    caller's."""
    groups = tl.reshape(c_kv, (KV_LORA // 128, 128))  # (KV_LORA / 128, 128)
    amax = finite_amax(groups, axis=1)  # (KV_LORA / 128,)
    scale, inv = pow2_scale(amax, -13)
    codes = e4m3_bytes(groups * inv[:, None])  # (KV_LORA / 128, 128)
    tl.store(row_ptr + tl.arange(0, KV_LORA), tl.reshape(codes, (KV_LORA,)))
    tl.store((row_ptr + KV_LORA).to(tl.pointer_type(tl.float32)) + tl.arange(0, KV_LORA // 128), scale)


@triton.jit
def rope_layout(D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For each of a head's D values: (its RoPE partner, its angle, whether it leads its pair, whether it is roped);
    pairs (2i, 2i+1) at angle i when INTERLEAVED, else (i, i + ROPE/2)."""
    oi = tl.arange(0, D)
    if INTERLEAVED:
        partner, angle, first = oi ^ 1, oi // 2, (oi % 2) == 0
    else:
        partner = tl.where(oi < ROPE // 2, oi + ROPE // 2, oi - ROPE // 2)
        angle, first = oi % (ROPE // 2), oi < ROPE // 2
    return partner, angle, first, oi < ROPE


@triton.jit
def rope_apply(x, xp, cos_ptr, sin_ptr, angle, first, roped):
    """RoPE on a whole head held in registers: x (D,) fp32 and each value's partner xp (rope_layout) -> a c - b s
    for a pair's first value a, b c + a s for its second b (the expressions of _rope_pairs, so that both round
    alike), the values past the roped ones as they are (fp32)."""
    c = tl.load(cos_ptr + angle, mask=roped, other=1.0)
    s = tl.load(sin_ptr + angle, mask=roped, other=0.0)
    return tl.where(roped, tl.where(first, x * c - xp * s, x * c + xp * s), x)


@triton.jit
def _index_key_fp8(x_ptr, w_ptr, b_ptr, block, row, cos_ptr, sin_ptr, mean, rstd, hadamard_scale, block_size,
                   D_I: tl.constexpr, LOG2_D_I: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The FP8 key as deployed: RoPE(LayerNorm(x)), then the Hadamard rotation (each rounded to x's dtype, as the
    unfused path stores them), then fp8 with one ue8m0 scale: its values at `row` of the block at `block` (bytes),
    its scale after the block's values."""
    ty: tl.constexpr = x_ptr.dtype.element_ty
    partner, angle, first, roped = rope_layout(D_I, ROPE, INTERLEAVED)
    oi = tl.arange(0, D_I)
    x = cast(_layer_norm_at(x_ptr, w_ptr, b_ptr, oi, mean, rstd), ty).to(tl.float32)
    xp = cast(_layer_norm_at(x_ptr, w_ptr, b_ptr, partner, mean, rstd), ty).to(tl.float32)
    k = cast(rope_apply(x, xp, cos_ptr, sin_ptr, angle, first, roped), ty).to(tl.float32)
    k = cast(hadamard(k, hadamard_scale, D_I, LOG2_D_I), ty).to(tl.float32)
    codes, scale = quantize_e4m3(k, -22)
    tl.store(block + row * D_I + oi, codes)
    tl.store((block + block_size * D_I + 4 * row).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def _index_key(x_ptr, w_ptr, b_ptr, cache_ptr, slot, stride_slot, stride_block, block_size, cos_ptr, sin_ptr, ln_eps,
               hadamard_scale, D_I: tl.constexpr, LOG2_D_I: tl.constexpr, ROPE: tl.constexpr,
               INTERLEAVED: tl.constexpr, FP8: tl.constexpr):
    """k^I = RoPE(LayerNorm(x)) on its first ROPE values into the indexer-key cache: a row at slot in the cache's
    dtype, or (FP8) rotated and quantised into DeepGEMM's block layout (_index_key_fp8)."""
    oi = tl.arange(0, D_I)
    x = tl.load(x_ptr + oi).to(tl.float32)
    mean = tl.sum(x, axis=0) / D_I
    rstd = tl.rsqrt(tl.sum((x - mean) * (x - mean), axis=0) / D_I + ln_eps)
    if FP8:
        block = cache_ptr + (slot // block_size).to(tl.int64) * stride_block
        _index_key_fp8(x_ptr, w_ptr, b_ptr, block, slot % block_size, cos_ptr, sin_ptr, mean, rstd, hadamard_scale,
                       block_size, D_I, LOG2_D_I, ROPE, INTERLEAVED)
    else:
        ty: tl.constexpr = cache_ptr.dtype.element_ty
        i = tl.arange(0, ROPE // 2)
        if INTERLEAVED:
            a_off, b_off = 2 * i, 2 * i + 1
        else:
            a_off, b_off = i, i + ROPE // 2
        a = cast(_layer_norm_at(x_ptr, w_ptr, b_ptr, a_off, mean, rstd), ty).to(tl.float32)
        b = cast(_layer_norm_at(x_ptr, w_ptr, b_ptr, b_off, mean, rstd), ty).to(tl.float32)
        c = tl.load(cos_ptr + i)
        s = tl.load(sin_ptr + i)
        row = cache_ptr + slot * stride_slot
        tl.store(row + a_off, cast(a * c - b * s, ty))
        tl.store(row + b_off, cast(b * c + a * s, ty))
        rest = _layer_norm_at(x_ptr, w_ptr, b_ptr, oi, mean, rstd)  # (D_I,): the values past ROPE are kept
        tl.store(row + oi, cast(rest, ty), mask=oi >= ROPE)


@triton.jit
def _fused_norm_rope_kernel(
    q_c_ptr, stride_q, q_norm_w_ptr, q_c_out_ptr, stride_qo,  # q_c [T, Q_LORA] -> RMSNorm -> q_c_out
    kv_ptr, stride_kv, kv_norm_w_ptr,  # kv [T, KV_LORA + ROPE] (kv_a_proj_with_mqa output)
    latent_ptr, stride_lslot,  # latent cache viewed as [NB * BS, KV_LORA + ROPE]; FP8: bytes [NB * BS, 656]
    ik_ptr, stride_ik, ik_w_ptr, ik_b_ptr,  # indexer key [T, D_I] (wk output), LayerNorm weight/bias
    icache_ptr, stride_islot, stride_iblock,  # indexer-key cache [NB, BS, D_I]; FP8: bytes [NB, BS, D_I + 4]
    pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_cs,  # positions [T], slot_mapping [T], cos/sin [P, ROPE/2]
    rms_eps, ln_eps, n_slots, n_pos, block_size,  # bounds: slots in [0, NB * BS), positions in [0, P)
    hadamard_scale,  # D_I^-1/2 (the FP8 key's rotation)
    Q_LORA: tl.constexpr, BLOCK_Q: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    D_I: tl.constexpr, LOG2_D_I: tl.constexpr, HAS_INDEXER: tl.constexpr, INDEXER_INTERLEAVED: tl.constexpr,
    LATENT_FP8: tl.constexpr, INDEX_FP8: tl.constexpr,
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
    tl.store(q_c_out_ptr + t * stride_qo + oq, cast(times_weight(wq, x), q_c_out_ptr.dtype.element_ty), mask=mq)

    # A slot outside the cache, or a position outside cos/sin, writes nothing (as a padding token's -1 slot);
    # the launcher's debug mode (dsv32ref.checks.checking_device_values) raises on them instead.
    if (slot >= 0) & (slot < n_slots) & (pos >= 0) & (pos < n_pos):
        # latent row: [RMSNorm(c_kv) | RoPE_interleaved(k_pe)] straight into the paged cache
        ol = tl.arange(0, KV_LORA)
        c = tl.load(kv_ptr + t * stride_kv + ol).to(tl.float32)
        c = c * tl.rsqrt(tl.sum(c * c, axis=0) / KV_LORA + rms_eps)
        wkv = tl.load(kv_norm_w_ptr + ol)
        row = latent_ptr + slot * stride_lslot
        if LATENT_FP8:  # c_kv as the model's dtype holds it, quantised; k_pe bf16 after the scales
            c_kv = cast(times_weight(wkv, c), kv_ptr.dtype.element_ty)  # as a cache in kv's dtype would hold it
            _store_latent_fp8(row, c_kv.to(tl.float32), KV_LORA)
            k_pe = (row + KV_LORA + 4 * (KV_LORA // 128)).to(tl.pointer_type(tl.bfloat16))
        else:
            tl.store(row + ol, cast(times_weight(wkv, c), latent_ptr.dtype.element_ty))
            k_pe = row + KV_LORA
        _rope_pairs(kv_ptr + t * stride_kv + KV_LORA, k_pe, cos, sin, ROPE // 2, True)
        if HAS_INDEXER:
            _index_key(ik_ptr + t * stride_ik, ik_w_ptr, ik_b_ptr, icache_ptr, slot, stride_islot, stride_iblock,
                       block_size, cos, sin, ln_eps, hadamard_scale, D_I, LOG2_D_I, ROPE, INDEXER_INTERLEAVED, INDEX_FP8)


def _check_aligned(name: str, cache: torch.Tensor) -> None:
    if cache.data_ptr() % 16 or any(st % 16 for st in cache.stride()[:-2]):
        raise ValueError(f"{name}: an fp8 cache must start 16-byte aligned, its rows and blocks 16 bytes apart, got "
                         f"strides {tuple(cache.stride())} at address {cache.data_ptr():#x}")


def _check_q_c(q_c, q_c_out, q_a_norm_weight) -> tuple[int, int]:
    """q_c [T, q_lora], its output and its norm weight -> (T, q_lora)."""
    floats = (torch.bfloat16, torch.float16, torch.float32)
    T, q_lora = check_tensor("q_c", q_c, shape=(None, None), dtype=floats, dense_dims=1).shape
    if q_lora < 1:
        raise ValueError(f"q_c: expected q_lora_rank (dim 1) >= 1, got shape {list(q_c.shape)}")
    check_tensor("q_c_out", q_c_out, shape=(T, q_lora), dtype=q_c.dtype, dense_dims=1)
    check_tensor("q_a_norm_weight", q_a_norm_weight, shape=(q_lora,), dtype=floats, dense_dims=1)
    return T, q_lora


def _check_latent(kv, latent_cache, T: int, rope: int) -> tuple[int, int, int]:
    """kv [T, kv_lora + rope] and the latent cache [NB, BS, kv_lora + rope] (a float dtype), or FlashMLA's FP8 rows
    uint8 [NB, BS, 656] (kv_lora 512, rope 64) -> (NB, BS, kv_lora)."""
    floats = (torch.bfloat16, torch.float16, torch.float32)
    width = check_tensor("kv", kv, shape=(T, None), dtype=floats, dense_dims=1).shape[1]
    if isinstance(latent_cache, torch.Tensor) and latent_cache.dtype == torch.uint8:
        check_tensor("latent_cache", latent_cache, shape=(None, None, LATENT_ROW_BYTES), contiguous=True)
        _check_aligned("latent_cache", latent_cache)
        if (width, rope) != (576, 64):
            raise ValueError(f"fused_norm_rope: an fp8 latent_cache holds FlashMLA's rows of kv_lora_rank 512 and "
                             f"qk_rope_head_dim 64, got kv.shape[1] {width} and qk_rope_head_dim {rope}")
    else:
        check_tensor("latent_cache", latent_cache, shape=(None, None, width), dtype=floats, contiguous=True)
    if width <= rope:
        raise ValueError(f"fused_norm_rope: kv.shape[1] ({width}) must exceed qk_rope_head_dim "
                         f"(2 x cos.shape[1] = {rope})")
    if latent_cache.shape[1] < 1:
        raise ValueError(f"latent_cache: expected a block size (dim 1) >= 1, got shape {list(latent_cache.shape)}")
    return latent_cache.shape[0], latent_cache.shape[1], width - rope


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
    if isinstance(index_cache, torch.Tensor) and index_cache.dtype == torch.uint8:  # DeepGEMM's FP8 key blocks
        check_tensor("index_cache", index_cache, shape=(nb, bs, d_i + 4), contiguous=True)
        _check_aligned("index_cache", index_cache)
    else:
        check_tensor("index_cache", index_cache, shape=(nb, bs, d_i), dtype=floats, contiguous=True)
    check_tensor("k_norm_weight", k_norm_weight, shape=(d_i,), dtype=floats, dense_dims=1)
    check_tensor("k_norm_bias", k_norm_bias, shape=(d_i,), dtype=floats, dense_dims=1)
    if d_i < rope:
        raise ValueError(f"fused_norm_rope: index_head_dim ({d_i}) must be >= qk_rope_head_dim ({rope})")
    return d_i


def _check_device_values(tensors: dict, n_slots: int) -> None:
    """fused_norm_rope's debug mode: outputs apart from the inputs, positions within the rope table, slots within
    the cache and none given to two tokens (padding -1 aside): two rows for one slot race on a GPU."""
    outputs = ("q_c_out", "latent_cache", "index_cache")
    check_disjoint("fused_norm_rope", {k: tensors[k] for k in outputs},
                   {k: t for k, t in tensors.items() if k not in outputs})
    positions, slot_mapping = tensors["positions"], tensors["slot_mapping"]
    check_range("positions", positions, 0, tensors["cos"].shape[0], "cos.shape[0]")
    check_range("slot_mapping", slot_mapping, -1, n_slots, "-1 (padding) to num_blocks x block_size")
    check_slots("slot_mapping", slot_mapping[slot_mapping >= 0], n_slots)


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
    powers of two. A uint8 cache holds FP8 (dsv32ref.reference.fp8_cache), quantised on write from the values a
    cache in the activations' dtype would hold: latent_cache [NB, BS, 656], FlashMLA's rows (kv_lora 512, rope
    64: c_kv fp8 with a power-of-two scale per 128, k_pe bf16); index_cache [NB, BS, D_I + 4], DeepGEMM's blocks
    (fp8 keys, then one ue8m0 scale per key), each key rotated by the orthonormal Hadamard transform before it is
    quantised, as DeepSeek's inference code does (the indexer's fp8 queries are rotated alike: fused_q). A NaN or
    inf is written as fp8 NaN, not folded into a scale.
    """
    floats = (torch.bfloat16, torch.float16, torch.float32)
    check_bool("fused_norm_rope: indexer_interleaved", indexer_interleaved)
    T, q_lora = _check_q_c(q_c, q_c_out, q_a_norm_weight)
    rope = check_rope_table("fused_norm_rope", cos, sin)
    nb, bs, kv_lora = _check_latent(kv, latent_cache, T, rope)
    check_tensor("kv_a_norm_weight", kv_a_norm_weight, shape=(kv_lora,), dtype=floats, dense_dims=1)
    check_tensor("positions", positions, shape=(T,), dtype=(torch.int64, torch.int32), dense_dims=1)
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtype=(torch.int64, torch.int32), dense_dims=1)
    check_eps("fused_norm_rope: rms_eps", rms_eps)
    check_eps("fused_norm_rope: ln_eps", ln_eps)
    has_indexer = index_k is not None
    d_i = _check_indexer(index_k, k_norm_weight, k_norm_bias, index_cache, T, nb, bs, rope)
    for name, v in (("kv_lora_rank", kv_lora), ("qk_rope_head_dim", rope), ("index_head_dim", d_i)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"fused_norm_rope: {name} must be a power of two, got {v}")
    tensors = dict(q_c=q_c, q_a_norm_weight=q_a_norm_weight, q_c_out=q_c_out, kv=kv, kv_a_norm_weight=kv_a_norm_weight,
                   latent_cache=latent_cache, positions=positions, slot_mapping=slot_mapping, cos=cos, sin=sin,
                   index_k=index_k, k_norm_weight=k_norm_weight, k_norm_bias=k_norm_bias, index_cache=index_cache)
    check_same_device(**tensors)
    if device_value_checks_on():  # debug mode: syncs
        _check_device_values(tensors, nb * bs)
    if T == 0:
        return
    dummy = kv  # never dereferenced when HAS_INDEXER is False
    index_fp8 = has_indexer and index_cache.dtype == torch.uint8
    launch(_fused_norm_rope_kernel, (T,),
        q_c, q_c.stride(0), q_a_norm_weight, q_c_out, q_c_out.stride(0),
        kv, kv.stride(0), kv_a_norm_weight, latent_cache, latent_cache.stride(1),
        index_k if has_indexer else dummy, index_k.stride(0) if has_indexer else 0,
        k_norm_weight if has_indexer else dummy, k_norm_bias if has_indexer else dummy,
        index_cache if has_indexer else dummy, d_i, index_cache.stride(0) if has_indexer else 0,
        positions, slot_mapping, cos, sin, cos.stride(0), rms_eps, ln_eps, nb * bs, cos.shape[0], bs, d_i ** -0.5,
        Q_LORA=q_lora, BLOCK_Q=triton.next_power_of_2(q_lora), KV_LORA=kv_lora, ROPE=rope, D_I=d_i,
        LOG2_D_I=d_i.bit_length() - 1,
        HAS_INDEXER=has_indexer, INDEXER_INTERLEAVED=indexer_interleaved,
        LATENT_FP8=latent_cache.dtype == torch.uint8, INDEX_FP8=index_fp8, num_warps=4,
    )
