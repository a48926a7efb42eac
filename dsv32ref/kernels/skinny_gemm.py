"""y = x Wᵀ for a few rows of x (decode steps, short prompts): a weight read in one launch.

    y[b, t, n] = sum_k x[b, t, k] W[b, n, k]       fp32 accumulation, rounded once to the dtype (as F.linear)

Motivation. At T <= 16 tokens a projection does 2 T N K FLOPs on N K weights it reads once: it is bound by the
weight read, and the time over that read is the launch's ramp, its tail and how many loads each SM keeps in flight.
cuBLAS answers such shapes with split-K kernels and a separate reduce launch (o_proj at 8 tokens in the TTFT ledger,
data/ttft_*.json). Here each program streams BLOCK_N rows of W through the K loop, BLOCK_K at a step, and keeps x's
T rows (padded to the MMA's 16) beside them: no split, no second launch, the grid as many programs as N has tiles.
The batched form (a leading dim b on x, W and y, any strides) takes the attention's per-head absorptions, W_UK and
W_UV, stored [H, K, N]: pass W as its transposed view.

Numerics: the sum of bf16 products in fp32, in K order within a program, rounded once: equal to F.linear up to the
fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv32ref.checks import check_disjoint, check_same_device, check_tensor, device_value_checks_on, is_int
from dsv32ref.kernels.fp8 import cast
from dsv32ref.kernels.grid import dot_precision, mma, num_sms
from dsv32ref.kernels.launch import launch

__all__ = ["MAX_ROWS", "skinny_gemm", "skinny_block_n"]

MAX_ROWS = 64  # rows of x a program holds beside its W tile (a skinny GEMM; more rows are a GEMM's job)
MAX_BATCH = 65535  # CUDA's limit on a grid's second axis


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, T, N, K, sxb, sxt, sxk, swb, swn, swk, syb, syt, syn,
                        DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """Program (n tile, b): y[b, :T, n tile] over the whole K."""
    n0, b = tl.program_id(0) * BLOCK_N, tl.program_id(1).to(tl.int64)
    offs_m, offs_n = tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < T, offs_n < N
    x_rows = x_ptr + b * sxb + offs_m[:, None].to(tl.int64) * sxt  # (BLOCK_M, 1)
    w_rows = w_ptr + b * swb + offs_n[None, :].to(tl.int64) * swn  # (1, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :].to(tl.int64) * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[:, None].to(tl.int64) * swk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = mma(x, w, PRECISION) + acc  # (BLOCK_M, BLOCK_K) x (BLOCK_K, BLOCK_N)
    y = y_ptr + b * syb + offs_m[:, None].to(tl.int64) * syt + offs_n[None, :].to(tl.int64) * syn
    tl.store(y, cast(acc, DTYPE), mask=m_ok[:, None] & n_ok[None, :])


def skinny_block_n(N: int, batch: int, device: torch.device) -> int:
    """Columns a program: the widest of 64, 32, 16 that still gives every SM two programs (16 if none does)."""
    sms = num_sms(device, None, "skinny_gemm")
    return next((bn for bn in (64, 32) if triton.cdiv(N, bn) * batch >= 2 * sms), 16)


def _as_batched(name: str, t, rank: int) -> torch.Tensor:
    """A 2-D tensor as one batch of it; a 3-D one as is; anything else a ValueError naming it."""
    if not isinstance(t, torch.Tensor) or t.dim() != rank and t.dim() != rank + 1:
        got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a {rank}-D tensor or a batch of them ({rank + 1}-D), got {got}")
    return t if t.dim() == rank + 1 else t.unsqueeze(0)


def _check_tiles(block_n, block_k, num_warps, num_stages) -> None:
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if v is not None and (not is_int(v) or not 16 <= v <= 256 or v & (v - 1)):
            raise ValueError(f"skinny_gemm: {name} expected None or a power of two in [16, 256], got {v!r}")
    if not is_int(num_warps) or num_warps not in (1, 2, 4, 8):
        raise ValueError(f"skinny_gemm: num_warps expected 1, 2, 4 or 8, got {num_warps!r}")
    if not is_int(num_stages) or not 1 <= num_stages <= 8:
        raise ValueError(f"skinny_gemm: num_stages expected an int in [1, 8], got {num_stages!r}")


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, block_n: int | None = None,
                block_k: int = 128, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """out = x wᵀ (F.linear without a bias): x [T, K] and w [N, K] into out [T, N], or batched, x [B, T, K], w
    [B, N, K] into out [B, T, N]; any strides; T <= MAX_ROWS; x, w and out of one dtype (bf16, fp16 or fp32).
    block_n (default `skinny_block_n`), block_k, num_warps and num_stages: the launch's tiles, for tuning. Returns
    out."""
    xb, wb, ob = _as_batched("x", x, 2), _as_batched("w", w, 2), _as_batched("out", out, 2)
    if x.dim() != w.dim() or x.dim() != out.dim():
        raise ValueError(f"skinny_gemm: x, w and out must all be 2-D or all 3-D, got {x.dim()}, {w.dim()} and "
                         f"{out.dim()} dims")
    B, T, K = check_tensor("x", xb, dtype=(torch.bfloat16, torch.float16, torch.float32)).shape
    N = check_tensor("w", wb, shape=(B, None, K), dtype=x.dtype).shape[1]
    check_tensor("out", ob, shape=(B, T, N), dtype=x.dtype)
    if T > MAX_ROWS:
        raise ValueError(f"x: expected at most {MAX_ROWS} rows (a skinny GEMM), got {T}")
    if B > MAX_BATCH:
        raise ValueError(f"x: expected at most {MAX_BATCH} batches (the grid's second axis), got {B}")
    _check_tiles(block_n, block_k, num_warps, num_stages)
    check_same_device(x=x, w=w, out=out)
    if device_value_checks_on():  # debug mode (dsv32ref.checks.checking_device_values): host time on every call
        check_disjoint("skinny_gemm", {"out": out}, {"x": x, "w": w})
    if T == 0 or N == 0 or B == 0:
        return out
    if K == 0:
        return out.zero_()
    bn = block_n or skinny_block_n(N, B, x.device)
    launch(_skinny_gemm_kernel, (triton.cdiv(N, bn), B), xb, wb, ob, T, N, K, *xb.stride(), *wb.stride(),
           *ob.stride(), DTYPE=_DTYPES[x.dtype], PRECISION=dot_precision(x.dtype, x.device),
           BLOCK_M=max(16, triton.next_power_of_2(T)), BLOCK_N=bn, BLOCK_K=block_k, num_warps=num_warps,
           num_stages=num_stages)
    return out


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
