"""Rotary position embedding with YaRN, in the two layouts the models use.

MLA's k_pe / q_pe use the *interleaved* layout: pairs (x0, x1), (x2, x3), ... each rotated by one
frequency (DeepSeek's `view_as_complex`). The indexer uses the half-split (NeoX) layout, pairs
(x_i, x_{i+d/2}), on DeepSeek-V3.2, and the interleaved one on GLM-5.x (`indexer_rope_interleave`).
We keep the interleaved output in interleaved order; HF writes it de-interleaved, which permutes q and
k alike, so every dot product is the same.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv32ref.checks import check_bool, check_tensor
from dsv32ref.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies f_i, i < qk_rope_head_dim/2, float64, YaRN-corrected when configured.

    YaRN: low = floor(d ln(L0 / (beta_fast 2 pi)) / (2 ln theta)), high = ceil(same with beta_slow),
    clamped to [0, d-1]; ramp r_i = clamp((i - low) / (high - low), 0, 1); smooth = 1 - r;
    f_i <- f_i / factor * (1 - smooth) + f_i * smooth.
    """
    if not isinstance(config, ModelConfig):
        raise ValueError(f"rope_inv_freq: config: expected a ModelConfig, got {type(config).__name__}")
    d, theta = config.qk_rope_head_dim, float(config.rope_theta)
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    ys = config.rope_scaling
    if ys is None or float(ys["factor"]) <= 1.0:
        return freqs
    factor, l0 = float(ys["factor"]), float(ys["original_max_position_embeddings"])

    def correction_dim(num_rotations: float) -> float:
        return d * math.log(l0 / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(float(ys["beta_fast"]))), 0)
    high = min(math.ceil(correction_dim(float(ys["beta_slow"]))), d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as DeepSeek's reference does
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth


class RotaryEmbedding(nn.Module):
    """cos/sin of position * f_i, looked up per token. Buffers are not persistent (not in checkpoints)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"RotaryEmbedding: config: expected a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _apply(self, fn, recurse=True):
        # Frequencies stay float64 and are recomputed after any move or cast (`model.to(bf16)` would round
        # them; `to_empty` would leave them uninitialised): they are a function of the config alone.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        """positions [T] int -> (cos, sin), each [T, rope_dim/2] in `dtype` (fp32 unless float64)."""
        check_tensor("positions", positions, shape=(None,), dtype=(torch.int64, torch.int32))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"RotaryEmbedding: dtype: expected a float torch.dtype, got {dtype!r}")
        if dtype.itemsize < 2:
            raise ValueError(f"RotaryEmbedding: dtype: expected a float dtype of 16 bits or more, got {dtype}")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions: expected positions >= 0, got {int(positions.min())}")
        if positions.numel() and int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"positions: expected positions < max_position_embeddings "
                             f"({self.config.max_position_embeddings}), got {int(positions.max())}")
        dt = torch.promote_types(dtype, torch.float32)
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return angles.cos().to(dt), angles.sin().to(dt)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x [T, ..., d] by per-token angles cos/sin [T, d/2]; same layout out.

    The rotation runs in the dtype of cos (fp32, or float64 in exact tests) and is cast back to x.dtype.
    """
    floats = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    if check_tensor("x", x, dtype=floats).dim() < 2:
        raise ValueError(f"apply_rope: x: expected [T, ..., d], got shape {list(x.shape)}")
    d = x.shape[-1]
    if d % 2:  # the rotation pairs dims
        raise ValueError(f"apply_rope: x: the rope dims (its last) must be even, got {d}")
    check_tensor("cos", cos, dtype=(torch.float32, torch.float64), device=x.device)
    check_bool("apply_rope: interleaved", interleaved)
    if cos.dim() != 2:
        raise ValueError(f"cos: expected shape [{x.shape[0]}, {d // 2}], got {list(cos.shape)}")
    if cos.shape[-1] * 2 != d:
        raise ValueError(f"apply_rope: x has {d} rope dims but cos has {cos.shape[-1]} (expected {d // 2})")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, shape=(x.shape[0], d // 2), dtype=cos.dtype, device=x.device)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    c, s = cos.reshape(shape), sin.reshape(shape)  # (T, 1.., d/2): broadcast over heads
    xf = x.to(cos.dtype)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)  # (.., d/2, 2) -> (.., d)
    else:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)
