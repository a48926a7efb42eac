"""Between sublayers: the residual add and the next RMSNorm in one launch (vLLM's fused_add_rms_norm).

    residual_out = x + residual              rounded to the activations' dtype, as torch's add rounds it
    out          = RMSNorm(residual_out)     in fp32, cast back before the weight (dsv32ref.reference.norms)

Motivation. A decoder layer adds each sublayer's output to the residual stream and normalises the sum for the next
sublayer. As PyTorch ops that is two launches a sublayer, and torch's RMSNorm runs one thread block a row, so at a
few tokens a handful of SMs read each row twice: at an 8-token prefill these small launches add up to a visible
share of the engine's kernel time (the `layer_norm` region of the TTFT ledger, data/ttft_*.json). Here a program
holds its rows in registers: one read of x and of the residual, one write of each output. Memory-bound: 4 T hidden
values of the activations' dtype move; the FLOPs are negligible.

The first layer has no residual yet: `residual=None` normalises x and copies it to residual_out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv32ref.checks import check_disjoint, check_eps, check_same_device, check_tensor
from dsv32ref.kernels.fp8 import cast
from dsv32ref.kernels.fused_norm_rope import times_weight
from dsv32ref.kernels.grid import num_sms
from dsv32ref.kernels.launch import launch

__all__ = ["add_rms_norm"]

MAX_TILE = 16384  # values of one program's rows held at once (fp32 registers): rows a program <= MAX_TILE / hidden


@triton.jit
def _add_rms_norm_kernel(x_ptr, stride_x, res_ptr, stride_r, w_ptr, out_ptr, stride_o, res_out_ptr, stride_ro, T,
                         hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    ok = (rows < T)[:, None] & (cols < hidden)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    h = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_H)
    if HAS_RESIDUAL:
        h = cast(h + tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=ok, other=0.0).to(tl.float32),
                 res_out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(res_out_ptr + r64 * stride_ro + cols[None, :], h.to(res_out_ptr.dtype.element_ty), mask=ok)
    xn = h * tl.rsqrt(tl.sum(h * h, axis=1) / hidden + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0)
    tl.store(out_ptr + r64 * stride_o + cols[None, :], cast(times_weight(w[None, :], xn), out_ptr.dtype.element_ty),
             mask=ok)


def _warps(block_h: int, T: int, sms: int) -> int:
    """Warps a program of block_h-wide rows. At most a token an SM, each program holds one row and is a latency
    chain: a wide row's reduction over 16 warps took 3.76-4.03 us a launch where 8 took 4.23-4.48 (hidden 6144 and
    7168, 1 and 8 tokens, one H100 run, CUDA-graph replay, medians); at 1024 and 8192 tokens 16 warps were 1-4 %
    slower."""
    if block_h >= 8192 and T <= sms:
        return 16
    return 8 if block_h >= 4096 else 4


def _rows_per_program(T: int, block_h: int, sms: int) -> int:
    """Enough programs to fill the SMs, each as many rows as that leaves (a power of two), within MAX_TILE."""
    per = triton.cdiv(T, sms)
    return min(1 << (per.bit_length() - 1), max(1, MAX_TILE // block_h), 16)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, residual_out: torch.Tensor) -> None:
    """residual_out = x + residual (x itself when residual is None); out = RMSNorm(residual_out) with `weight`.

    x, residual, out, residual_out [T, hidden] and weight [hidden], all of one float dtype (bf16, fp16 or fp32:
    the reference multiplies by the weight in its dtype), rows dense. The outputs overlap neither the inputs nor
    each other."""
    floats = (torch.bfloat16, torch.float16, torch.float32)
    T, hidden = check_tensor("x", x, shape=(None, None), dtype=floats, dense_dims=1).shape
    if not 1 <= hidden <= MAX_TILE:
        raise ValueError(f"x: expected a hidden size (dim 1) in [1, {MAX_TILE}] (a row in registers), got shape "
                         f"{list(x.shape)}")
    if residual is not None:
        check_tensor("residual", residual, shape=(T, hidden), dtype=x.dtype, dense_dims=1)
    check_tensor("weight", weight, shape=(hidden,), dtype=x.dtype, dense_dims=1)
    check_tensor("out", out, shape=(T, hidden), dtype=x.dtype, dense_dims=1)
    check_tensor("residual_out", residual_out, shape=(T, hidden), dtype=x.dtype, dense_dims=1)
    check_eps("add_rms_norm: eps", eps)
    check_same_device(x=x, residual=residual, weight=weight, out=out, residual_out=residual_out)
    check_disjoint("add_rms_norm", {"out": out, "residual_out": residual_out},
                   {"x": x, "residual": residual, "weight": weight})
    if T == 0:
        return
    block_h = triton.next_power_of_2(hidden)
    sms = num_sms(x.device, None, "add_rms_norm")
    bt = _rows_per_program(T, block_h, sms)
    res = residual if residual is not None else x  # never read without HAS_RESIDUAL
    launch(_add_rms_norm_kernel, (triton.cdiv(T, bt),), x, x.stride(0), res, res.stride(0), weight, out,
           out.stride(0), residual_out, residual_out.stride(0), T, hidden, eps, HAS_RESIDUAL=residual is not None,
           BLOCK_T=bt, BLOCK_H=block_h, num_warps=_warps(block_h, T, sms))
