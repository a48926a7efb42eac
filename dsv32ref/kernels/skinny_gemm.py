"""y = x Wᵀ for a few rows of x (decode steps, short prompts): a weight read in one launch.

    y[b, t, n] = sum_k x[b, t, k] W[b, n, k]       fp32 accumulation, rounded once to the dtype (as F.linear)

Motivation. At T <= 16 tokens a projection does 2 T N K FLOPs on N K weights it reads once: it is bound by the
weight read, and the time over that read is the launch's ramp, its tail and how many loads each SM keeps in flight.
cuBLAS answers such shapes with split-K kernels and a separate reduce launch (o_proj at 8 tokens in the TTFT ledger,
data/ttft_*.json). Here each program streams BLOCK_N rows of W through its part of the K loop, BLOCK_K at a step,
and keeps x's T rows (padded to the MMA's 16) beside them. The batched form (a leading dim b on x, W and y, any
strides) takes the attention's per-head absorptions, W_UK and W_UV, stored [H, K, N]: pass W as its transposed view.

Split-K in the same launch. A projection whose N has few tiles (GLM-5.2's packed A-projections: 44 tiles of 64
columns) leaves most SMs idle or each with little in flight; with a `counters` buffer, K is split across SPLITS
programs per tile. Each writes its fp32 partial, then counts itself in on the tile's counter (an atomic add:
release of its partial, acquire of the others'); the program that arrives last sums the SPLITS partials in split
order, rounds once, writes y and sets the counter back to zero. No second launch, and the result does not depend
on which program arrived last.

Numerics: the sum of bf16 products in fp32, in K order within a program (and a split), the splits' partials added
in split order, rounded once: equal to F.linear up to the fp32 summation order.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from dsv32ref.checks import (check_device, check_disjoint, check_int, check_same_device, check_tensor,
                             device_value_checks_on, is_int)
from dsv32ref.kernels.fp8 import cast
from dsv32ref.kernels.grid import dot_precision, mma, num_sms
from dsv32ref.kernels.launch import launch

__all__ = ["MAX_ROWS", "MAX_SPLITS", "skinny_gemm", "skinny_gemm_counters", "skinny_plan"]

MAX_ROWS = 64  # rows of x a program holds beside its W tile (a skinny GEMM; more rows are a GEMM's job)
MAX_BATCH = 65535  # CUDA's limit on a grid's second axis
MAX_SPLITS = 16  # programs a tile's K is split across (the last one sums this many partials)
MIN_SPLIT_STEPS = 8  # K's BLOCK_K steps per split the plan asks for at least


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, T, N, K, k_split, sxb, sxt, sxk, swb, swn, swk,
                        syb, syt, syn, DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr):
    """Program (n tile, b, split): y[b, :T, n tile] over the split's k_split columns of K (a multiple of BLOCK_K;
    all of K without splits). With splits: fp32 partials part [B, tiles, SPLITS, BLOCK_M, BLOCK_N] and a zeroed
    int32 counter per (b, tile) in count_ptr, left zero."""
    tile, b, split = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    offs_m, offs_n = tl.arange(0, BLOCK_M), tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < T, offs_n < N
    x_rows = x_ptr + b * sxb + offs_m[:, None].to(tl.int64) * sxt  # (BLOCK_M, 1)
    w_rows = w_ptr + b * swb + offs_n[None, :].to(tl.int64) * swn  # (1, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * k_split
    for k0 in range(k_lo, tl.minimum(K, k_lo + k_split), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K  # a split's last step ends at the next split's first column (k_split: whole steps)
        x = tl.load(x_rows + offs_k[None, :].to(tl.int64) * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[:, None].to(tl.int64) * swk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = mma(x, w, PRECISION) + acc  # (BLOCK_M, BLOCK_K) x (BLOCK_K, BLOCK_N)
    y = y_ptr + b * syb + offs_m[:, None].to(tl.int64) * syt + offs_n[None, :].to(tl.int64) * syn
    if SPLITS > 1:
        counter = count_ptr + b * tl.num_programs(0) + tile
        parts = part_ptr + (b * tl.num_programs(0) + tile) * (SPLITS * BLOCK_M * BLOCK_N)
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (BLOCK_M, BLOCK_N)
        tl.store(parts + split * (BLOCK_M * BLOCK_N) + in_tile, acc)
        tl.debug_barrier()  # every thread's partial written before the release below
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # the last: every partial is written
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in tl.static_range(SPLITS):  # in split order, whichever program arrived last
                acc += tl.load(parts + j * (BLOCK_M * BLOCK_N) + in_tile, cache_modifier=".cg")
            tl.store(y, cast(acc, DTYPE), mask=m_ok[:, None] & n_ok[None, :])
            tl.atomic_xchg(counter, 0, sem="relaxed")  # zero again for the next launch (stream order)
    else:
        tl.store(y, cast(acc, DTYPE), mask=m_ok[:, None] & n_ok[None, :])


def skinny_plan(N: int, K: int, batch: int, device: torch.device, split: bool = True, block_n: int | None = None,
                block_k: int = 128, splits: int | None = None, sms: int | None = None) -> tuple[int, int, int]:
    """The launch skinny_gemm makes -> (columns a program, K columns a split: whole steps of block_k, splits as
    launched). Columns: block_n, else 64 (N's power of two if smaller, at least 16). Splits: `splits` if given, else
    with split, where the tiles are fewer than the SMs (`sms`, default the device's), as many as give every SM two
    programs, at most one per MIN_SPLIT_STEPS steps of K and at most MAX_SPLITS, else one. K is cut into whole steps
    of block_k, the same number a split but the last, so fewer splits than asked may launch (never an empty one).
    On one H100 at 8 tokens (graph replay, the projection probe of dsv32ref.bench.kernels) splitting K gained where
    the tiles left SMs idle (the A-projections over 6-7k columns of K, o_proj) and lost where they already covered
    them (q_b_proj's 256 tiles) or K was short (wq_b's 2048)."""
    bn, sms = block_n or min(64, max(16, triton.next_power_of_2(N))), num_sms(device, sms, "skinny_gemm")
    steps = max(1, triton.cdiv(K, block_k))
    if splits is None:
        programs, splits = triton.cdiv(N, bn) * batch, 1
        if split and 0 < programs < sms:
            splits = max(1, min(triton.cdiv(2 * sms, programs), steps // MIN_SPLIT_STEPS, MAX_SPLITS))
    per_split = triton.cdiv(steps, splits)
    return bn, per_split * block_k, triton.cdiv(steps, per_split)


# the counters buffers skinny_gemm_counters made, by their memory's address: split-K's last program of a tile is
# the one whose count reaches SPLITS - 1, so a buffer that does not start at zero leaves its tiles unwritten,
# silently; skinny_gemm takes only these and views of them (a buffer of torch.empty's is refused), which each call
# leaves zero
_COUNTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def skinny_gemm_counters(device: torch.device | str, n: int = 1 << 16) -> torch.Tensor:
    """A counters buffer for skinny_gemm's split-K: int32 zeros [n]; every call leaves it zero. Calls that share
    one must run one after another (one stream): a graph or an engine step owns one."""
    check_int("skinny_gemm_counters: n", n, low=1, high=1 << 24)
    counters = torch.zeros(n, dtype=torch.int32, device=check_device("skinny_gemm_counters: device", device))
    _COUNTERS[counters.untyped_storage().data_ptr()] = counters
    return counters


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


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, counters: torch.Tensor | None = None,
                splits: int | None = None, block_n: int | None = None, block_k: int = 128, num_warps: int = 4,
                num_stages: int = 3, num_sms: int | None = None) -> torch.Tensor:
    """out = x wᵀ (F.linear without a bias): x [T, K] and w [N, K] into out [T, N], or batched, x [B, T, K], w
    [B, N, K] into out [B, T, N]; any strides; T <= MAX_ROWS; x, w and out of one dtype (bf16, fp16 or fp32).
    counters: a buffer of `skinny_gemm_counters`' or a view of one (int32 zeros, at least B x cdiv(N, block_n) of
    them), which split-K needs and every call leaves zero; without them K is not split. splits (at most; default
    `skinny_plan`'s, 1 without counters), block_n (default `skinny_plan`'s), block_k, num_warps and num_stages: the
    launch, for tuning; every choice computes the same product up to fp32 summation order. num_sms: the SMs the
    plan fills (default: the device's). Returns out."""
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
    bn, k_split, splits = _split_plan(N, K, B, x.device, counters, splits, block_n, block_k, num_sms)
    check_same_device(x=x, w=w, out=out, counters=counters)
    if device_value_checks_on():  # debug mode (dsv32ref.checks.checking_device_values): host time on every call
        check_disjoint("skinny_gemm", {"out": out, "counters": counters}, {"x": x, "w": w})
        if counters is not None and bool(counters.any()):
            raise ValueError("skinny_gemm: counters: expected all zeros (each call leaves them so), got "
                             f"{int(counters.count_nonzero())} nonzero")
    if T == 0 or N == 0 or B == 0:
        return out
    if K == 0:
        return out.zero_()
    bm, tiles = max(16, triton.next_power_of_2(T)), triton.cdiv(N, bn)
    part = torch.empty(B * tiles * splits * bm * bn if splits > 1 else 0, dtype=torch.float32, device=x.device)
    launch(_skinny_gemm_kernel, (tiles, B, splits), xb, wb, ob, part, counters if splits > 1 else part, T, N, K,
           k_split, *xb.stride(), *wb.stride(), *ob.stride(), DTYPE=_DTYPES[x.dtype],
           PRECISION=dot_precision(x.dtype, x.device), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, SPLITS=splits,
           num_warps=num_warps, num_stages=num_stages)
    return out


def _split_plan(N: int, K: int, B: int, device, counters, splits, block_n, block_k, sms) -> tuple[int, int, int]:
    """skinny_plan's launch for these arguments, checked (counters: enough for every tile's)."""
    if splits is not None and (not is_int(splits) or not 1 <= splits <= MAX_SPLITS):
        raise ValueError(f"skinny_gemm: splits expected None or an int in [1, {MAX_SPLITS}], got {splits!r}")
    if counters is None and splits not in (None, 1):
        raise ValueError(f"skinny_gemm: splits {splits} needs counters (skinny_gemm_counters)")
    plan = skinny_plan(N, K, B, device, counters is not None, block_n, block_k, splits, sms)
    if counters is not None:
        need = B * triton.cdiv(N, plan[0])
        check_tensor("counters", counters, shape=(None,), dtype=torch.int32, dense_dims=1)
        if counters.numel() < need:
            raise ValueError(f"counters: expected at least {need} (batches x tiles of {plan[0]} columns), got "
                             f"{counters.numel()}")
        ptr = counters.untyped_storage().data_ptr()
        owner = _COUNTERS.get(ptr)
        if owner is None or owner.untyped_storage().data_ptr() != ptr:  # (a registered tensor given other memory)
            raise ValueError("counters: expected a buffer of skinny_gemm_counters' (zeros, which every call leaves "
                             "zero: split-K's last program is found by counting from 0), got one made elsewhere")
    return plan


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
