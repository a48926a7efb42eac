"""The FP8 caches deployed engines keep for DeepSeek-V3.2, byte by byte, and the reference over them.

FlashMLA's sparse latent cache (vLLM's "fp8_ds_mla"): one row of 656 bytes per token,

    bytes   0 - 511   c_kv: 512 fp8 e4m3 values, in order
    bytes 512 - 527   4 fp32 scales, little-endian; scale i covers c_kv[128 i : 128 (i + 1)]; value = fp8 x scale
    bytes 528 - 655   k_pe: 64 bf16 values, not quantised (the interleaved RoPE layout of the bf16 cache)

in a uint8 tensor [num_blocks, block_size, 1, 656] whose rows are 656 bytes apart (blocks may be further
apart). Sparse decode addresses it by flat slots, block x block_size + offset, -1 for none. The scales are
powers of two: FlashMLA's quantiser (its tests/quant.py) takes s = 2^ceil(log2(max(amax / 448, 1e-4))) per
128 values, and its kernel multiplies the dequantised values by the scale cast to bf16, exact only for a power
of two.

DeepGEMM's paged indexer-key cache (what vLLM's indexer keeps: 132 bytes per token at D = 128): per block of
block_kv tokens,

    bytes 0 .. block_kv x D - 1               the block's keys, token by token: D fp8 e4m3 values each
    bytes block_kv x D .. block_kv x (D + 4)  one fp32 scale per token, in token order; value = fp8 x scale

in a uint8 tensor [num_blocks, block_kv, 1, D + 4] (the block's bytes, not one row per token). vLLM quantises
each key with one power-of-two scale, s = 2^ceil(log2(max(amax, 1e-4) / 448)) (ue8m0); block_kv is 64 on sm_90.
The keys stored are the model's business: DeepSeek's inference code rotates keys and queries by a Hadamard
transform before the fp8 cast, and scores fp8 queries (one scale per head, folded into the weights); the
reference model does the same over an FP8 key cache (dsv32ref.reference.mla).

Both scales are computed exactly (numerics.pow2_scale). The fp8 casts round to nearest even and saturate at
+-448. Every quantiser refuses NaN and inf, and takes its input to fp32 first (where the formats compute: a float64
value is rounded twice); every dequantiser refuses a scale that is not a finite power of two (the formats' own) and
a value times its scale past fp32's range (no quantiser writes one); all name the tensor.
"""

from __future__ import annotations

import torch

from dsv32ref.cache import FP8_LATENT_DIMS, LATENT_ROW_BYTES, indexer_key_bytes, token_slots
from dsv32ref.checks import check_slots, check_tensor
from dsv32ref.reference.indexer import indexer_scores
from dsv32ref.reference.numerics import FP8_E4M3_MAX, fp8_dequantize, pow2_scale, ue8m0_scale
from dsv32ref.reference.sparse_attention import sparse_mla

__all__ = ["LATENT_ROW_BYTES", "dequantize_indexer_keys", "dequantize_latent", "gather_indexer_keys",
           "gather_latent", "indexer_key_bytes", "indexer_key_parts", "indexer_scores_fp8", "latent_parts",
           "latent_scale", "quantize_indexer_keys", "quantize_latent", "sparse_mla_fp8", "write_indexer_keys",
           "write_latent"]

D_LAT, D_ROPE, GROUP = FP8_LATENT_DIMS + (128,)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _finite(name: str, x: torch.Tensor) -> None:
    bad = ~torch.isfinite(x.float())  # in fp32, where the formats compute: a float64 past its range is inf there
    if bad.any():
        raise ValueError(f"{name}: expected finite values, got {int(bad.sum())} NaN or inf (in float32; first at "
                         f"{tuple(int(i) for i in bad.nonzero()[0])})")


def _powers_of_two(name: str, s: torch.Tensor) -> None:
    ok = torch.isfinite(s) & (s > 0)
    ok &= torch.where(ok, torch.frexp(s.float()).mantissa == 0.5, False)
    if not ok.all():
        raise ValueError(f"{name}: expected finite powers of two > 0, got {s[~ok][:4].tolist()}")


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in fp8 e4m3 (round to nearest even, saturated at +-448), as bytes."""
    q = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8)


def latent_scale(amax: torch.Tensor) -> torch.Tensor:
    """FlashMLA's scale of a 128-value group: 2^ceil(log2(max(amax / 448, 1e-4))), at least 2^-13 (numerics.pow2_scale:
    exact where FlashMLA's fp32 log2 rounds a quotient just above a power of two down)."""
    return pow2_scale(amax, -13)


def quantize_latent(latent: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """latent [..., 576] ([c_kv (512) | k_pe (64)], any float dtype) -> rows uint8 [..., 656] (module docstring),
    with FlashMLA's scales (latent_scale) or the given ones [..., 4] (powers of two: e.g. a row's own, which
    makes quantize_latent(dequantize_latent(rows), latent_parts(rows)[1]) give back the same bytes)."""
    check_tensor("latent", latent, shape=(..., D_LAT + D_ROPE), dtype=_FLOATS)
    _finite("latent", latent)
    lead = latent.shape[:-1]
    c_kv = latent[..., :D_LAT].float().reshape(*lead, D_LAT // GROUP, GROUP)  # (..., 4, 128)
    if scale is None:
        scale = latent_scale(c_kv.abs().amax(-1))  # (..., 4)
    else:
        check_tensor("scale", scale, shape=tuple(lead) + (D_LAT // GROUP,), dtype=torch.float32, device=latent.device)
        _powers_of_two("scale", scale)
    values = _to_fp8(c_kv, scale[..., None]).reshape(*lead, D_LAT)
    scales = scale.contiguous().view(torch.uint8).reshape(*lead, 4 * (D_LAT // GROUP))
    k_pe = latent[..., D_LAT:].to(torch.bfloat16)
    _finite("latent: k_pe (stored in bfloat16)", k_pe)  # a finite fp32 past bf16's range rounds to inf
    k_pe = k_pe.contiguous().view(torch.uint8)  # (..., 128)
    return torch.cat((values, scales, k_pe), dim=-1)


def latent_parts(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows uint8 [..., 656] -> (c_kv fp8 e4m3 [..., 512], scales fp32 [..., 4], k_pe bf16 [..., 64]), the bytes
    read as they are laid out."""
    check_tensor("rows", rows, shape=(..., LATENT_ROW_BYTES), dtype=torch.uint8)
    rows = rows.contiguous()
    scale = rows[..., D_LAT:D_LAT + 16].contiguous().view(torch.float32)
    _powers_of_two("rows: c_kv scales (bytes 512-527)", scale)
    return (rows[..., :D_LAT].contiguous().view(torch.float8_e4m3fn), scale,
            rows[..., D_LAT + 16:].contiguous().view(torch.bfloat16))


def dequantize_latent(rows: torch.Tensor) -> torch.Tensor:
    """rows uint8 [..., 656] -> latent fp32 [..., 576]: c_kv = fp8 x scale, k_pe as stored (bf16, exact in fp32)."""
    values, scale, k_pe = latent_parts(rows)
    c_kv = fp8_dequantize(values, scale, GROUP, name="rows: c_kv")  # a product past fp32's range refused
    return torch.cat((c_kv, k_pe.float()), dim=-1)


def quantize_indexer_keys(keys: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """keys [num_blocks, block_kv, D] (any float dtype) -> cache uint8 [num_blocks, block_kv, 1, D + 4] in
    DeepGEMM's block layout (module docstring), one ue8m0 scale per token, or the given scales [num_blocks,
    block_kv] (powers of two)."""
    nb, bk, d = check_tensor("keys", keys, shape=(None, None, None), dtype=_FLOATS).shape
    if min(bk, d) < 1:
        raise ValueError(f"keys: expected block_kv and D >= 1, got shape {list(keys.shape)}")
    _finite("keys", keys)
    k = keys.float()
    if scale is None:
        scale = ue8m0_scale(k.abs().amax(-1))  # (NB, BK)
    else:
        check_tensor("scale", scale, shape=(nb, bk), dtype=torch.float32, device=keys.device)
        _powers_of_two("scale", scale)
    values = _to_fp8(k, scale[..., None]).reshape(nb, bk * d)
    scales = scale.contiguous().view(torch.uint8).reshape(nb, 4 * bk)
    return torch.cat((values, scales), dim=-1).view(nb, bk, 1, d + 4)


def indexer_key_parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cache uint8 [num_blocks, block_kv, 1, D + 4] -> (keys fp8 e4m3 [num_blocks, block_kv, D], scales fp32
    [num_blocks, block_kv]), the bytes read as they are laid out."""
    values, scale = _indexer_key_bytes(cache)
    _powers_of_two("cache: key scales (each block's last block_kv x 4 bytes)", scale)
    return values, scale


def _indexer_key_bytes(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """indexer_key_parts without the scales' check (for a reader that checks only the tokens it reads)."""
    nb, bk, _, w = check_tensor("cache", cache, shape=(None, None, 1, None), dtype=torch.uint8).shape
    d = w - 4
    if d < 1 or bk < 1:
        raise ValueError(f"cache: expected block_kv >= 1 and a last dim of D + 4 > 4, got shape {list(cache.shape)}")
    flat = cache.contiguous().view(nb, bk * w)
    scale = flat[:, bk * d:].contiguous().view(torch.float32)  # (NB, BK)
    return flat[:, : bk * d].contiguous().view(torch.float8_e4m3fn).view(nb, bk, d), scale


def dequantize_indexer_keys(cache: torch.Tensor) -> torch.Tensor:
    """cache uint8 [num_blocks, block_kv, 1, D + 4] -> keys fp32 [num_blocks, block_kv, D]."""
    values, scale = indexer_key_parts(cache)
    return fp8_dequantize(values, scale[..., None], values.shape[-1], name="cache: keys")


def sparse_mla_fp8(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, sm_scale: float,
                   d_v: int = D_LAT) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse decode over the FP8 latent cache: q [n, H, 576], cache uint8 [NB, BS, 1, 656], slots
    int32 [n, k] (flat slots block x BS + offset; -1 or out of the cache: none) -> (out [n, H, d_v], lse [n, H]),
    in q's dtype promoted to fp32 (float64 for float64 q): the reference's sparse_mla on the dequantised rows.
    Only the rows some slot selects are read (and their scales checked): the rest of the cache may be unwritten."""
    check_tensor("q", q, shape=(None, None, D_LAT + D_ROPE), dtype=_FLOATS)
    nb, bs = check_tensor("cache", cache, shape=(None, None, 1, LATENT_ROW_BYTES), dtype=torch.uint8,
                          device=q.device).shape[:2]
    check_tensor("slots", slots, shape=(q.shape[0], None), dtype=torch.int32, device=q.device)
    dt = torch.promote_types(q.dtype, torch.float32)
    slots = slots.to(cache.device).long()
    valid = (slots >= 0) & (slots < nb * bs)
    read = torch.unique(slots[valid])  # the selected rows, sorted
    kv = dequantize_latent(cache.reshape(nb * bs, LATENT_ROW_BYTES)[read]).to(dt)  # (rows read, 576)
    if not len(read):  # nothing selected: one zero row that no index points at
        kv = torch.zeros(1, kv.shape[-1], dtype=dt, device=cache.device)
    at = torch.where(valid, torch.searchsorted(read, slots), -1).to(torch.int32)  # slot -> its row in kv
    return sparse_mla(q.to(dt), kv, at, sm_scale, d_v)


def indexer_scores_fp8(q_idx: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table_row: torch.Tensor,
                       seq_len: int, softmax_scale: float) -> torch.Tensor:
    """DeepGEMM's paged logits over the FP8 key cache for one sequence: sum_h w[h] relu(q_h . k s), q_idx
    [n, H_I, D] (fp8 or float), weights [n, H_I] fp32 (with any query scales folded in), the sequence's first
    seq_len keys read through block_table_row -> [n, seq_len] fp32 (float64 for float64 weights)."""
    values, scale = _indexer_key_bytes(cache)  # (NB, BK, D), (NB, BK): only the sequence's keys are read
    nb, bk, d = values.shape
    n, h = check_tensor("q_idx", q_idx, shape=(None, None, d), dtype=_FLOATS + (torch.float8_e4m3fn,),
                        device=cache.device).shape[:2]
    check_tensor("weights", weights, shape=(n, h), dtype=(torch.float32, torch.float64), device=cache.device)
    check_tensor("block_table_row", block_table_row, shape=(None,), dtype=(torch.int32, torch.int64))
    at = token_slots(block_table_row.to(values.device), seq_len, nb, bk)  # (seq_len,)
    s = scale.reshape(-1)[at]
    _powers_of_two("cache: key scales (each block's last block_kv x 4 bytes) of the sequence's tokens", s)
    k = fp8_dequantize(values.reshape(nb * bk, d)[at], s[:, None], d, name="cache: keys")  # (seq_len, D)
    return indexer_scores(q_idx.float() if q_idx.dtype == torch.float8_e4m3fn else q_idx, k, weights, softmax_scale)


# ---- token by token, as an engine's cache is written and read (the reference model over an FP8 cache) ----

def _block_shape(cache: torch.Tensor, width: int | None) -> tuple[int, int, int]:
    """(NB, BS, row width) of an engine's cache uint8 [NB, BS, width] or the formats' [NB, BS, 1, width]."""
    shape = (None, None, 1, width) if isinstance(cache, torch.Tensor) and cache.dim() == 4 else (None, None, width)
    check_tensor("cache", cache, shape=shape, dtype=torch.uint8, contiguous=True)  # written through a view
    if cache.shape[-1] <= 4:
        raise ValueError(f"cache: expected a last dim of D + 4 > 4, got {cache.shape[-1]}")
    return cache.shape[0], cache.shape[1], cache.shape[-1]


def _slots(name: str, slot_mapping: torch.Tensor, n_rows: int, nb: int, bs: int, device: torch.device) -> torch.Tensor:
    check_tensor(name, slot_mapping, shape=(n_rows,), dtype=(torch.int32, torch.int64), device=device)
    check_slots(name, slot_mapping, nb * bs)
    return slot_mapping.long()


def write_latent(cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
    """cache uint8 [NB, BS, 656] (or [NB, BS, 1, 656]) <- latent [T, 576] quantised (quantize_latent) at
    slot_mapping [T] (flat slots)."""
    nb, bs, _ = _block_shape(cache, LATENT_ROW_BYTES)
    check_tensor("latent", latent, shape=(None, D_LAT + D_ROPE), dtype=_FLOATS, device=cache.device)
    slots = _slots("slot_mapping", slot_mapping, latent.shape[0], nb, bs, cache.device)
    cache.view(nb * bs, LATENT_ROW_BYTES).index_copy_(0, slots, quantize_latent(latent))


def gather_latent(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len latent rows of one sequence, dequantised -> fp32 [seq_len, 576]."""
    nb, bs, _ = _block_shape(cache, LATENT_ROW_BYTES)
    check_tensor("block_table_row", block_table_row, shape=(None,), dtype=(torch.int32, torch.int64),
                 device=cache.device)
    rows = cache.view(nb * bs, LATENT_ROW_BYTES)[token_slots(block_table_row, seq_len, nb, bs)]
    return dequantize_latent(rows)


def write_indexer_keys(cache: torch.Tensor, slot_mapping: torch.Tensor, keys: torch.Tensor) -> None:
    """cache uint8 [NB, BS, D + 4] (or [NB, BS, 1, D + 4]) <- keys [T, D], each quantised with its own ue8m0
    scale, at slot_mapping [T]: the key's D bytes at its offset among the block's keys, its scale's 4 bytes at
    its offset among the block's scales."""
    nb, bs, w = _block_shape(cache, None)
    d = w - 4
    check_tensor("keys", keys, shape=(None, d), dtype=_FLOATS, device=cache.device)
    slots = _slots("slot_mapping", slot_mapping, keys.shape[0], nb, bs, cache.device)
    packed = quantize_indexer_keys(keys[:, None, :]).view(-1, d + 4)  # (T, D + 4): a block of one key
    flat = cache.view(nb, bs * (d + 4))
    block, off = slots // bs, slots % bs
    cols = off[:, None] * d + torch.arange(d, device=cache.device)  # (T, D)
    flat[block[:, None], cols] = packed[:, :d]
    cols = bs * d + off[:, None] * 4 + torch.arange(4, device=cache.device)  # (T, 4)
    flat[block[:, None], cols] = packed[:, d:]


def gather_indexer_keys(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len keys of one sequence, dequantised -> fp32 [seq_len, D] (only their bytes are read)."""
    nb, bs, w = _block_shape(cache, None)
    d = w - 4
    check_tensor("block_table_row", block_table_row, shape=(None,), dtype=(torch.int32, torch.int64))
    slots = token_slots(block_table_row.to(cache.device), seq_len, nb, bs)
    flat = cache.view(nb, bs * w)
    block, off = slots[:, None] // bs, slots[:, None] % bs
    values = flat[block, off * d + torch.arange(d, device=cache.device)]  # (S, D) fp8 bytes
    scale = flat[block, bs * d + off * 4 + torch.arange(4, device=cache.device)].contiguous().view(torch.float32)
    _powers_of_two("cache: key scales (each block's last block_kv x 4 bytes)", scale)  # (S, 1)
    return values.view(torch.float8_e4m3fn).float() * scale
