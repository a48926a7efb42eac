"""The "deployed numerics" of DeepSeek-V3.2's inference code, as round trips on ordinary tensors.

- The indexer rotates q and k by a Hadamard transform (scale n^-1/2, orthogonal: dot products unchanged)
  before fp8 quantisation (notebook 07 measures what that does to fp8's rounding).
- fp8 e4m3 with ue8m0 scales: one power-of-two scale per 128 values, s = 2^ceil(log2(max(amax, 1e-4)/448)).
- The latent cache stores c_kv in that fp8 format (k_pe stays bf16).

The reference stores dequantised values, which is numerically what a kernel reading fp8 + scale sees.
"""

from __future__ import annotations

import functools

import torch

from dsv32ref.checks import check_int, check_tensor

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

FP8_E4M3_MAX = 448.0
QUANT_BLOCK = 128


MAX_HADAMARD = 4096  # the dense H_n holds n^2 float64 values (128 MiB at 4096; the indexer's is 128)


@functools.lru_cache(maxsize=8)
def _hadamard(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1) or n > MAX_HADAMARD:
        raise ValueError(f"hadamard_transform: size must be a power of two <= {MAX_HADAMARD} (the dense H_n), got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * n ** -0.5


@functools.lru_cache(maxsize=16)
def _hadamard_on(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _hadamard(n).to(device=device, dtype=dtype)  # one copy per device: no host copy per call


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ H_n (orthonormal Sylvester Hadamard) over the last dim (a power of two <= MAX_HADAMARD), computed in
    >= fp32 and returned in x's dtype; a row of finite values whose transform leaves that dtype's range is refused."""
    check_tensor("x", x, shape=(..., None), dtype=_FLOATS)
    dt = torch.promote_types(x.dtype, torch.float32)
    y = (x.to(dt) @ _hadamard_on(x.shape[-1], x.device, dt)).to(x.dtype)
    past = torch.isfinite(x).all(-1) & ~torch.isfinite(y).all(-1)  # (...,) rows whose sums left x's dtype's range
    if past.any():
        raise ValueError(f"hadamard_transform: x: {int(past.sum())} rows of finite values transform past "
                         f"{x.dtype}'s range (a row's values sum up to sqrt(n) times its largest)")
    return y


def pow2_scale(amax: torch.Tensor, min_exp: int) -> torch.Tensor:
    """The smallest power of two s = 2^k, k >= min_exp, with amax / s <= 448: 2^max(ceil(log2(amax / 448)), min_exp)
    in exact arithmetic, read off amax's exponent and mantissa (448 = 0.875 x 2^9). fp32 log2 would round a
    quotient just above a power of two down to it, and that value would then saturate. amax: finite, >= 0."""
    check_tensor("amax", amax, dtype=_FLOATS)
    check_int("pow2_scale: min_exp", min_exp, -126, 127)  # fp32's normal exponents: 2^min_exp a normal scale
    a32 = amax.float()  # where it computes: a float64 past fp32's range is inf there, one below it 0
    bad = ~(torch.isfinite(a32) & (amax >= 0))
    if bad.any():  # a NaN, inf or negative amax would get the smallest scale, silently
        raise ValueError(f"amax: expected finite values >= 0 (in float32), got {amax[bad][:4].tolist()}")
    mant, exp = torch.frexp(a32)  # amax = mant x 2^exp, mant in [0.5, 1)
    k = torch.where(a32 > 0, exp - 9 + (mant > 0.875).to(exp.dtype), min_exp).clamp(min=min_exp)
    return torch.exp2(k.float())


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale so that amax / s <= 448: s = 2^ceil(log2(max(amax, 1e-4) / 448)) (at least 2^-22,
    as 1e-4 / 448 is just above 2^-23)."""
    return pow2_scale(amax, -22)


def fp8_quantize(x: torch.Tensor, block: int = QUANT_BLOCK,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (fp8 e4m3 values [..., n], fp32 scales [..., n/block]) with ue8m0 scales, or with the
    given scales [..., n/block] (e.g. a kernel's, to compare its values at its own scales)."""
    check_tensor("x", x, shape=(..., None), dtype=_FLOATS)
    bad = ~torch.isfinite(x.float())  # (in fp32, where it computes: a float64 past fp32's range is inf there)
    if bad.any():  # an inf would be rounded to a number, a NaN would set its block's scale
        raise ValueError(f"fp8_quantize: x: expected finite values, got {int(bad.sum())} NaN or inf (in float32)")
    check_int("fp8_quantize: block", block)
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"fp8_quantize: last dim {n} is not a multiple of the block {block}")
    xb = x.float().reshape(*x.shape[:-1], n // block, block)  # (..., blocks, block)
    if scale is None:
        scale = ue8m0_scale(xb.abs().amax(-1))
    elif not isinstance(scale, torch.Tensor) or scale.shape != xb.shape[:-1]:
        raise ValueError(f"fp8_quantize: scale: expected shape {list(xb.shape[:-1])}, got "
                         f"{list(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    elif scale.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"fp8_quantize: scale: expected dtype torch.float32 or torch.float64, got {scale.dtype}")
    elif scale.device != x.device:
        raise ValueError(f"fp8_quantize: scale: expected device {x.device}, got {scale.device}")
    elif not (torch.isfinite(scale) & (scale > 0)).all():
        bad = scale[~(torch.isfinite(scale) & (scale > 0))]
        raise ValueError(f"fp8_quantize: scale: expected finite values > 0, got {bad[:4].tolist()}")
    q = (xb / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = QUANT_BLOCK,
                   name: str = "fp8_dequantize") -> torch.Tensor:
    """fp8 values [..., n] and their scales [..., n/block] -> fp32 [..., n]. A NaN value stays NaN (what a kernel
    reading it computes); a product past fp32's range is refused. Every message names `name` (what q was read from)
    first."""
    check_tensor(f"{name}: q", q, shape=(..., None), dtype=torch.float8_e4m3fn)
    check_int(f"{name}: block", block)
    n = q.shape[-1]
    if n % block:
        raise ValueError(f"{name}: last dim {n} is not a multiple of the block {block}")
    check_tensor(f"{name}: scale", scale, shape=tuple(q.shape[:-1]) + (n // block,), dtype=_FLOATS, device=q.device)
    if not (torch.isfinite(scale) & (scale > 0)).all():
        raise ValueError(f"{name}: scale: expected finite values > 0, got "
                         f"{scale[~(torch.isfinite(scale) & (scale > 0))][:4].tolist()}")
    # fp32 (a float64 scale: in float64, then rounded once to the fp32 the result is)
    wide = scale.dtype == torch.float64
    qb = (q.double() if wide else q.float()).reshape(*q.shape[:-1], n // block, block)
    out = (qb * scale[..., None].to(qb.dtype)).reshape(q.shape)  # (..., n)
    past = out.abs() > torch.finfo(torch.float32).max  # (fp8 e4m3 has no inf: a finite scale took it past fp32)
    if past.any():
        raise ValueError(f"{name}: {int(past.sum())} values times their scales are past float32's range "
                         f"(first at {tuple(int(i) for i in past.nonzero()[0])})")
    return out.float()


def fp8_round_trip(x: torch.Tensor, block: int = QUANT_BLOCK) -> torch.Tensor:
    """What a kernel reading the fp8 copy of x sees, in x's dtype."""
    return fp8_dequantize(*fp8_quantize(x, block), block=block).to(x.dtype)
