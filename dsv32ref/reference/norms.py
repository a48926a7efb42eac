"""RMSNorm and LayerNorm as the released models compute them: in float32 (or wider), cast back."""

from __future__ import annotations

import torch
from torch import nn

from dsv32ref.checks import check_eps, check_tensor


_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # bf16/fp16 inputs are normalised in fp32; float64 stays float64 (our exact-math tests).
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim; the cast back happens before the weight (HF)."""
    check_tensor("x", x, shape=(..., None), dtype=_FLOATS)
    check_tensor("weight", weight, shape=(x.shape[-1],), dtype=_FLOATS, device=x.device)
    eps = check_eps("eps", eps)
    xf = x.to(_compute_dtype(x))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, computed in >= fp32."""
    check_tensor("x", x, shape=(..., None), dtype=_FLOATS)
    check_tensor("weight", weight, shape=(x.shape[-1],), dtype=_FLOATS, device=x.device)
    eps = check_eps("eps", eps)
    check_tensor("bias", bias, shape=(x.shape[-1],), dtype=_FLOATS, device=x.device)
    dt = _compute_dtype(x)
    y = torch.nn.functional.layer_norm(x.to(dt), x.shape[-1:], weight.to(dt), bias.to(dt), eps)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = check_eps("RMSNorm.eps", eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """The indexer's key norm (`k_norm`, weight + bias, eps 1e-6)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = check_eps("LayerNorm.eps", eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
