"""The MoE layer in six launches: the router (two), the alignment of (token, expert) pairs, then grouped GEMMs over the
tokens each expert received (gate/up, then down) and the combine; five in a step of at most SELECT_BLOCK_T tokens,
where the one program of the router's selection aligns the pairs too. Graph-safe: nothing on the host depends on the
routing, every size is the step's.

Motivation. Written as PyTorch ops, a DeepSeek-V3 MoE layer is a router of about a dozen small kernels, a
scatter, and per-expert GEMMs or a dense einsum; at a few tokens the layer is a weight read (3 H I bf16 values
per expert that any token selected) cut into many launches, each with its gap inside a CUDA graph. Here:

    router    the logits x W_g^T in fp32 over programs of (tokens, experts, splits of hidden), then one
              program per BLOCK_T tokens: s = sigmoid, the group-limited top-k of s + e_score_correction_bias, the
              weights normalised and scaled (dsv32ref.reference.moe.route)
    align     one program: the step's pairs (token, routed expert on this rank), plus (token, shared expert)
              for every token, sorted by expert, each expert's run padded to whole blocks of slots: which pair sits in
              which slot (`sorted_pair`, -1 padding) and which expert owns each block
              (`block_expert`, -1 past the last); vLLM's moe_align_block_size does this job
    gate/up   one program per (block, BLOCK_N columns of I): h = silu(x W_gate^T) * (x W_up^T) for the block's
              pairs, the expert's weights read once per block
    down      one program per (block, BLOCK_N columns of hidden): y = h W_down^T times the pair's routing weight
    combine   one program per (token, BLOCK_N columns): the routed pairs' sum, then the shared expert's output

Numerics follow the reference module (dsv32ref.reference.moe.MoE) in the activation dtype: the projections'
outputs, silu and the product are rounded to it where torch rounds them, the routed outputs are weighted and summed
in fp32, rounded once, and the shared expert's output is added to them. Row by row the GEMMs equal the reference's up
to fp32 summation order (where a pair lands among its expert's slots changes no result); sigmoid and silu divide
as IEEE does but take the GPU's fast exp, so compiled, a value can land a unit of the dtype away from torch's.
Exact ties in the router's choices go to the lower expert (or group) index; torch.topk, which the reference calls,
breaks them its own way.

Expert parallelism: the router sees every expert; the pairs whose expert is not among this rank's n_local (from
expert0) are dropped by the alignment and contribute nothing here (their rank adds them in its all-reduce).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from dsv32ref.checks import check_disjoint, check_int, check_same_device, check_tensor, is_int
from dsv32ref.config import ModelConfig
from dsv32ref.kernels.fp8 import cast
from dsv32ref.kernels.grid import dot_precision, mma
from dsv32ref.kernels.grid import num_sms as _num_sms
from dsv32ref.kernels.launch import launch

__all__ = ["MAX_EXPERTS", "MAX_PAIRS", "Tiles", "align_pairs", "block_m", "default_tiles", "fused_moe", "route_kernel"]

MAX_PAIRS = 1 << 14  # (token, expert) pairs one step may hold: the alignment sorts them in one program
MAX_EXPERTS = 1 << 12  # local experts (and the shared one) the alignment's int32 sort keys hold beside the pairs
ROUTER_BLOCK_K = 32  # hidden's columns a router-logits step multiplies
ROUTER_MIN_STEPS = 2  # the fewest steps a router-logits program takes (router_steps)
SELECT_BLOCK_T = 16  # tokens a selection program takes: a step of at most this many selects and aligns in one launch
# that one program's warps: at the full routers' sizes (256 experts, 24-32 splits of hidden) sm_90a holds it in
# 136-254 registers and spills at most 24 bytes, where 4 warps spilled 60
SELECT_ALIGN_WARPS = 8


def block_m(n_pairs: int, n_experts: int) -> int:
    """Pairs per block of the grouped GEMMs: 16 while an expert gets few pairs on average (decode: less padding),
    up to 64 for prefill steps (each block reads its expert's weights once: fewer blocks, fewer reads)."""
    per_expert = n_pairs / max(n_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One grouped GEMM's launch: BLOCK_N output columns a program, BLOCK_K of the reduction a step (powers of two
    >= 16), its warps and software-pipeline stages."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not is_int(v) or not 16 <= v <= 256 or v & (v - 1):
                raise ValueError(f"Tiles.{name}: expected a power of two in [16, 256], got {v!r}")
        if not is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tiles.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not is_int(self.num_stages) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"Tiles.num_stages: expected an int in [1, 8], got {self.num_stages!r}")

    def meta(self) -> dict:
        return dict(BLOCK_N=self.block_n, BLOCK_K=self.block_k, num_warps=self.num_warps, num_stages=self.num_stages)


def default_tiles(bm: int) -> tuple[Tiles, Tiles]:
    """(gate/up, down) tiles for blocks of bm pairs. On the H200 (`python -m dsv32ref.bench.kernels --moe-probe`, at
    decode-sized steps, where bm is 16) BLOCK_K = 128 brought the gate/up GEMM's layer closer to the copy rate than
    64, with 4 experts and with 256, and no down tiling was faster in every case; rerun the probe on another GPU.
    Larger blocks keep the tiles they were measured with."""
    return (Tiles(block_k=128) if bm == 16 else Tiles()), Tiles()


@triton.jit
def _top1(v, cols):
    """The largest entry of each row of v (ties: the lowest column) -> (its column, its value)."""
    best = tl.max(v, axis=1)
    col = tl.min(tl.where(v == best[:, None], cols[None, :], v.shape[1]), axis=1)
    return col, best


@triton.jit
def _router_logits_kernel(x_ptr, stride_xt, w_ptr, partial_ptr, T, E, hidden, E_PAD: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr):
    """partial[split, t, e] = x_t . W_g[e] over the split's STEPS BLOCK_K columns of hidden, in fp32 (as the
    reference computes the logits): programs over (tokens, experts, splits of hidden), so that a few decode tokens
    still spread the router's weight read over many SMs. Fused multiply-adds, no MMA: each thread keeps its own
    sums along K (the (BLOCK_T, BLOCK_E, BLOCK_K) accumulator), reduced once at the end; the steps are unrolled,
    so that a program's loads are all issued before the first is used."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    k0 = tl.program_id(2) * (STEPS * BLOCK_K)
    t_ok, e_ok = offs_t < T, cols < E
    acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], tl.float32)
    for j in tl.static_range(STEPS):
        offs_k = k0 + j * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_K)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * hidden + offs_k[None, :],
                    mask=e_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_E, BLOCK_K)
        acc += x[:, None, :] * w[None, :, :]
    tl.store(partial_ptr + (tl.program_id(2) * T + offs_t[:, None]).to(tl.int64) * E_PAD + cols[None, :],
             tl.sum(acc, axis=2), mask=t_ok[:, None])


@triton.jit
def _select(partial_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, splits, routed_scaling_factor, block,
            N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
            NORM: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
            SPLITS_PAD: tl.constexpr):
    """The router's selection for the BLOCK_T tokens from block x BLOCK_T: the logits (the splits' partial sums,
    loaded at once and summed), then s = sigmoid, the group-limited top-k of s + bias and the weights, per token."""
    offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    t_ok, e_ok = offs_t < T, cols < E
    sp = tl.arange(0, SPLITS_PAD)[None, :, None]
    rows = (sp * T + offs_t[:, None, None]).to(tl.int64) * E_PAD  # (BLOCK_T, SPLITS_PAD, 1)
    ok = t_ok[:, None, None] & (sp < splits) & e_ok[None, None, :]
    logits = tl.sum(tl.load(partial_ptr + rows + cols[None, None, :], mask=ok, other=0.0), axis=1)  # (BLOCK_T, E_PAD)
    s = tl.math.div_rn(tl.full(logits.shape, 1.0, tl.float32), 1.0 + tl.exp(-logits))  # IEEE division, as torch's
    choice = tl.where(e_ok[None, :], s + tl.load(bias_ptr + cols, mask=e_ok, other=0.0)[None, :], float("-inf"))
    if N_GROUP > 1:  # keep the TOPK_GROUP groups whose two best choices sum highest
        per: tl.constexpr = PER_GROUP
        NG_PAD: tl.constexpr = E_PAD // PER_GROUP  # padding columns form whole groups of -inf: never kept
        groups = tl.reshape(choice, (BLOCK_T, NG_PAD, per))  # (BLOCK_T, G, E/G)
        in_group = tl.arange(0, per)[None, None, :]
        first = tl.max(groups, axis=2)
        at = tl.min(tl.where(groups == first[:, :, None], in_group, per), axis=2)
        second = tl.max(tl.where(in_group == at[:, :, None], float("-inf"), groups), axis=2)
        score = first + second  # (BLOCK_T, G)
        g_cols = tl.arange(0, NG_PAD)
        keep = tl.zeros([BLOCK_T, NG_PAD], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g, _best = _top1(score, g_cols)
            keep = keep | (g_cols[None, :] == g[:, None])
            score = tl.where(g_cols[None, :] == g[:, None], float("-inf"), score)
        kept = tl.reshape(tl.broadcast_to(keep[:, :, None], (BLOCK_T, NG_PAD, per)), (BLOCK_T, E_PAD))
        choice = tl.where(kept, choice, float("-inf"))
    k_cols = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    w = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    for j in tl.static_range(TOP_K):  # the experts, best first (exact ties: the lower index), and s at each
        e, _best = _top1(choice, cols)
        e = tl.minimum(e, E - 1)  # a row of NaN finds no maximum: any expert (its outputs are NaN anyway)
        ids = tl.where(k_cols[None, :] == j, e[:, None], ids)
        w = tl.where(k_cols[None, :] == j, tl.sum(tl.where(cols[None, :] == e[:, None], s, 0.0), axis=1)[:, None], w)
        choice = tl.where(cols[None, :] == e[:, None], float("-inf"), choice)
    if NORM:
        w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None] + 1e-20)
    out = offs_t[:, None].to(tl.int64) * TOP_K + k_cols[None, :]
    ok = t_ok[:, None] & (k_cols < TOP_K)[None, :]
    tl.store(ids_ptr + out, ids, mask=ok)
    tl.store(weights_ptr + out, w * routed_scaling_factor, mask=ok)


@triton.jit
def _align(ids_ptr, sorted_pair_ptr, block_expert_ptr, offsets_ptr, n_pairs, expert0, n_local, max_slots,
           max_blocks, TOP_K: tl.constexpr, SHARED: tl.constexpr, NE_PAD: tl.constexpr, P_PAD: tl.constexpr,
           BLOCK_M: tl.constexpr):
    """Pair p = t * (TOP_K + SHARED) + j: token t's j-th routed expert (j < TOP_K) or its shared expert (virtual
    expert n_local). Experts of other ranks go to bucket NE = n_local + SHARED, which gets no slot."""
    KS: tl.constexpr = TOP_K + SHARED
    ne = n_local + SHARED
    for s0 in range(0, max_slots, 1024):  # every slot empty, every block unowned, until the pairs are placed
        offs = s0 + tl.arange(0, 1024)
        tl.store(sorted_pair_ptr + offs, -1, mask=offs < max_slots)
        tl.store(block_expert_ptr + offs, -1, mask=offs < max_blocks)
    p = tl.arange(0, P_PAD)
    j = p % KS
    routed = tl.load(ids_ptr + (p // KS) * TOP_K + j, mask=(p < n_pairs) & (j < TOP_K), other=-1) - expert0
    e = tl.where(j < TOP_K, tl.where((routed >= 0) & (routed < n_local), routed, ne), n_local)
    e = tl.where(p < n_pairs, e, ne)
    counts = tl.histogram(e, NE_PAD)  # (NE_PAD,); bucket ne holds the dropped pairs and the padding
    e_cols = tl.arange(0, NE_PAD)
    counts = tl.where(e_cols < ne, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(offsets_ptr + e_cols, tl.cumsum(padded, axis=0) - padded)  # each expert's first slot
    tl.store(offsets_ptr + NE_PAD + e_cols, tl.cumsum(counts, axis=0) - counts)  # its first pair in sorted order
    tl.debug_barrier()
    key = tl.sort(e * P_PAD + p)  # by expert, then by pair
    e_s, p_s = key // P_PAD, key % P_PAD
    i = tl.arange(0, P_PAD)
    ok = e_s < ne
    e_safe = tl.where(ok, e_s, 0)
    slot = tl.load(offsets_ptr + e_safe) + i - tl.load(offsets_ptr + NE_PAD + e_safe)
    tl.store(sorted_pair_ptr + slot, p_s, mask=ok)
    tl.store(block_expert_ptr + slot // BLOCK_M, e_s, mask=ok)  # every block of an expert holds >= 1 of its pairs


@triton.jit
def _router_kernel(partial_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, splits, routed_scaling_factor,
                   N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                   NORM: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                   SPLITS_PAD: tl.constexpr):
    """The selection, one program per BLOCK_T tokens."""
    _select(partial_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, splits, routed_scaling_factor, tl.program_id(0),
            N_GROUP, PER_GROUP, TOPK_GROUP, TOP_K, NORM, E_PAD, K_PAD, BLOCK_T, SPLITS_PAD)


@triton.jit
def _align_kernel(ids_ptr, sorted_pair_ptr, block_expert_ptr, offsets_ptr, n_pairs, expert0, n_local, max_slots,
                  max_blocks, TOP_K: tl.constexpr, SHARED: tl.constexpr, NE_PAD: tl.constexpr, P_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """The alignment, one program."""
    _align(ids_ptr, sorted_pair_ptr, block_expert_ptr, offsets_ptr, n_pairs, expert0, n_local, max_slots, max_blocks,
           TOP_K, SHARED, NE_PAD, P_PAD, BLOCK_M)


@triton.jit
def _select_align_kernel(partial_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, splits, routed_scaling_factor,
                         sorted_pair_ptr, block_expert_ptr, offsets_ptr, n_pairs, expert0, n_local, max_slots,
                         max_blocks, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         TOP_K: tl.constexpr, NORM: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, SPLITS_PAD: tl.constexpr, SHARED: tl.constexpr, NE_PAD: tl.constexpr,
                         P_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """The selection of every token (T <= BLOCK_T), then the alignment of their pairs, in one program: the
    alignment reads the ids this program has just stored (visible to its threads after the barrier)."""
    _select(partial_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, splits, routed_scaling_factor, 0,
            N_GROUP, PER_GROUP, TOPK_GROUP, TOP_K, NORM, E_PAD, K_PAD, BLOCK_T, SPLITS_PAD)
    tl.debug_barrier()
    _align(ids_ptr, sorted_pair_ptr, block_expert_ptr, offsets_ptr, n_pairs, expert0, n_local, max_slots, max_blocks,
           TOP_K, SHARED, NE_PAD, P_PAD, BLOCK_M)


@triton.jit
def _block_rows(sorted_pair_ptr, block_expert_ptr, b, n_local, w_ptr, stride_we, shared_ptr,
                BLOCK_M: tl.constexpr):
    """Block b of the aligned slots -> (its expert, whether it is the shared one, that expert's weight pointer, its
    BLOCK_M slots, their pair ids (-1: padding))."""
    e = tl.load(block_expert_ptr + b)
    is_shared = e == n_local
    w = tl.where(is_shared, shared_ptr, w_ptr + tl.minimum(tl.maximum(e, 0), n_local - 1).to(tl.int64) * stride_we)
    slots = b * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, is_shared, w, slots, tl.load(sorted_pair_ptr + slots)


@triton.jit
def _gate_up_kernel(x_ptr, stride_xt, w13_ptr, stride_we, shared_ptr, sorted_pair_ptr, block_expert_ptr, h_ptr,
                    stride_hs, hidden, inter, inter_shared, n_local, KS: tl.constexpr, DTYPE: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[slot, n] = silu(x_t . W_gate[n]) * (x_t . W_up[n]) for the block's pairs (token t = pair // KS); W13's
    rows are [gate (inter) ; up (inter)], the shared expert's [gate (inter_shared) ; up (inter_shared)]."""
    b, n0 = tl.program_id(0), tl.program_id(1) * BLOCK_N
    e, is_shared, w, slots, pair = _block_rows(sorted_pair_ptr, block_expert_ptr, b, n_local, w13_ptr, stride_we,
                                               shared_ptr, BLOCK_M)
    i_e = tl.where(is_shared, inter_shared, inter)
    if (e >= 0) & (n0 < i_e):
        tok = tl.where(pair >= 0, pair // KS, 0)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < i_e
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            x = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                        mask=(pair >= 0)[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            wg = tl.load(w + offs_n[None, :].to(tl.int64) * hidden + offs_k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # (BLOCK_K, BLOCK_N)
            wu = tl.load(w + (i_e + offs_n[None, :]).to(tl.int64) * hidden + offs_k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g = mma(x, wg, PRECISION) + acc_g
            acc_u = mma(x, wu, PRECISION) + acc_u
        # rounded as the reference's F.linear outputs, F.silu and the product are
        g = cast(acc_g, DTYPE).to(tl.float32)
        silu = cast(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DTYPE).to(tl.float32)
        h = cast(silu * cast(acc_u, DTYPE).to(tl.float32), DTYPE)
        tl.store(h_ptr + slots[:, None].to(tl.int64) * stride_hs + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=(pair >= 0)[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, stride_hs, w2_ptr, stride_we, shared_ptr, sorted_pair_ptr, block_expert_ptr, weights_ptr,
                 y_ptr, hidden, inter, inter_shared, n_local, TOP_K: tl.constexpr, KS: tl.constexpr,
                 DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """y[pair, n] = (h[slot] . W_down[n]) rounded to DTYPE, times the pair's routing weight (the shared expert's: 1),
    in fp32; W_down [hidden, inter] (the shared expert's [hidden, inter_shared])."""
    b, n0 = tl.program_id(0), tl.program_id(1) * BLOCK_N
    e, is_shared, w, slots, pair = _block_rows(sorted_pair_ptr, block_expert_ptr, b, n_local, w2_ptr, stride_we,
                                               shared_ptr, BLOCK_M)
    if e >= 0:
        i_e = tl.where(is_shared, inter_shared, inter)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, i_e, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < i_e
            h = tl.load(h_ptr + slots[:, None].to(tl.int64) * stride_hs + offs_k[None, :],
                        mask=(pair >= 0)[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            wd = tl.load(w + offs_n[None, :].to(tl.int64) * i_e + offs_k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # (BLOCK_K, BLOCK_N)
            acc = mma(h, wd, PRECISION) + acc
        j = pair % KS
        route_w = tl.load(weights_ptr + (pair // KS) * TOP_K + j, mask=(pair >= 0) & (j < TOP_K), other=1.0)
        y = cast(acc, DTYPE).to(tl.float32) * route_w[:, None]
        tl.store(y_ptr + pair[:, None].to(tl.int64) * hidden + offs_n[None, :], y,
                 mask=(pair >= 0)[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, stride_ot, hidden, expert0, n_local, TOP_K: tl.constexpr,
                    SHARED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = (sum of t's routed pairs on this rank, fp32, rounded to DTYPE) + its shared expert's output."""
    KS: tl.constexpr = TOP_K + SHARED
    t, offs_n = tl.program_id(0), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j) - expert0
        here = (e >= 0) & (e < n_local)  # another rank's expert: its pair was never computed here
        acc += tl.load(y_ptr + (t * KS + j).to(tl.int64) * hidden + offs_n, mask=n_ok & here, other=0.0)
    out = cast(acc, DTYPE)
    if SHARED:
        out = cast(out.to(tl.float32) + tl.load(y_ptr + (t * KS + TOP_K).to(tl.int64) * hidden + offs_n,
                                                mask=n_ok, other=0.0), DTYPE)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def _check_config(launcher: str, config) -> ModelConfig:
    if not isinstance(config, ModelConfig):
        raise ValueError(f"{launcher}: config: expected a ModelConfig, got {type(config).__name__}")
    return config


def _dtype_code(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _check_router(c: ModelConfig, launcher: str, x, weight, e_score_correction_bias, ids, weights,
                  outputs: bool = True, weight_name: str = "weight") -> None:
    """route_kernel's arguments (its docstring), refused by name; without `outputs`, fused_moe's router weights
    alone (it makes ids and weights; its weight is gate_weight)."""
    T, hidden = x.shape
    E, k = c.n_routed_experts, c.num_experts_per_tok
    check_tensor(weight_name, weight, shape=(E, hidden), dtype=torch.float32, dense_dims=2)
    check_tensor("e_score_correction_bias", e_score_correction_bias, shape=(E,), dtype=torch.float32, dense_dims=1)
    if outputs:
        check_tensor("ids", ids, shape=(T, k), dtype=torch.int32, dense_dims=2)
        check_tensor("weights", weights, shape=(T, k), dtype=torch.float32, dense_dims=2)
    inputs = {"x": x, weight_name: weight, "e_score_correction_bias": e_score_correction_bias}
    check_same_device(ids=ids, weights=weights, **inputs)
    check_disjoint(launcher, {"ids": ids, "weights": weights}, inputs)
    per = E // c.n_group
    if c.n_group > 1 and (E % c.n_group or per < 2 or per & (per - 1)):
        raise ValueError(f"{launcher}: n_routed_experts {E} must split into n_group {c.n_group} groups of a power "
                         f"of two >= 2 experts")


def _router_blocks(T: int, E: int) -> tuple[int, int]:
    """(tokens a router-logits program takes, experts padded to whole blocks of 16): up to 8 tokens a program."""
    return min(8, triton.next_power_of_2(T)), max(16, triton.next_power_of_2(E))


def router_steps(T: int, E: int, hidden: int, sms: int) -> int:
    """K steps of ROUTER_BLOCK_K columns a router-logits program takes. Eight (its eight loads in flight together;
    more where hidden would need more than 32 splits), halved, never below ROUTER_MIN_STEPS, while the programs
    (token blocks x expert blocks x splits of hidden) number fewer than half the SMs: a few tokens over a few experts
    (the reduced MoE) then spread the weights' read over more SMs. Fewer steps mean more partial sums for the
    selection to add (it loads them all at once), which is why the halving stops there."""
    block_t, e_pad = _router_blocks(T, E)
    programs = triton.cdiv(T, block_t) * (e_pad // 16)
    steps = max(8, triton.cdiv(hidden, 32 * ROUTER_BLOCK_K))
    while steps // 2 >= ROUTER_MIN_STEPS and 2 * programs * triton.cdiv(hidden, steps * ROUTER_BLOCK_K) < sms:
        steps //= 2
    return steps


def _router_logits(c: ModelConfig, x: torch.Tensor, weight: torch.Tensor, sms: int) -> tuple[torch.Tensor, int, dict]:
    """The logits launch (T >= 1) -> (the splits' partial sums [splits, T, E_PAD], splits, the selection's
    constexprs)."""
    T, hidden = x.shape
    E = c.n_routed_experts
    block_t, e_pad = _router_blocks(T, E)
    # splits of hidden of `router_steps` x 32 columns: 16 experts x 256 columns of fp32 weights (16 KiB) a program
    # at DeepSeek-V3.2's and GLM-5.2's full routers; up to 8 tokens a program: sm_90a holds 8 x 16 x 32 sums in 71
    # registers (7 programs an SM), 16 tokens' in 141 (3 an SM, and DeepSeek-V3.2's 448 programs of 16 tokens then
    # take two waves)
    steps = router_steps(T, E, hidden, sms)
    splits = triton.cdiv(hidden, steps * ROUTER_BLOCK_K)
    partial = torch.empty(splits, T, e_pad, dtype=torch.float32, device=x.device)
    launch(_router_logits_kernel, (triton.cdiv(T, block_t), e_pad // 16, splits), x, x.stride(0), weight, partial, T,
           E, hidden, E_PAD=e_pad, BLOCK_T=block_t, BLOCK_E=16, BLOCK_K=ROUTER_BLOCK_K, STEPS=steps)
    k = c.num_experts_per_tok
    return partial, splits, dict(N_GROUP=c.n_group, PER_GROUP=E // c.n_group, TOPK_GROUP=c.topk_group, TOP_K=k,
                                 NORM=bool(c.norm_topk_prob), E_PAD=e_pad, K_PAD=triton.next_power_of_2(k),
                                 BLOCK_T=SELECT_BLOCK_T, SPLITS_PAD=triton.next_power_of_2(splits))


def route_kernel(config: ModelConfig, x: torch.Tensor, weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
                 ids: torch.Tensor, weights: torch.Tensor, num_sms: int | None = None) -> None:
    """The router in two launches (the logits over many programs, then the selection per token), into ids int32
    [T, k] and weights fp32 [T, k] (dsv32ref.reference.moe.route's results). x [T, hidden]; weight fp32 [E, hidden];
    bias fp32 [E]; num_sms: the SMs the logits' programs spread over (`router_steps`; default the device's)."""
    c = _check_config("route_kernel", config)
    T = check_tensor("x", x, shape=(None, c.hidden_size), dtype=(torch.bfloat16, torch.float16, torch.float32),
                     dense_dims=1).shape[0]
    _check_router(c, "route_kernel", x, weight, e_score_correction_bias, ids, weights)
    if T == 0:
        return
    partial, splits, meta = _router_logits(c, x, weight, _num_sms(x.device, num_sms, "route_kernel"))
    launch(_router_kernel, (triton.cdiv(T, SELECT_BLOCK_T),),
           *_selection(c, partial, splits, e_score_correction_bias, ids, weights), **meta)


def _selection(c: ModelConfig, partial, splits: int, bias, ids, weights) -> tuple:
    """The selection's arguments (the router kernel's, and the one-program kernel's before the alignment's)."""
    return partial, bias, ids, weights, ids.shape[0], c.n_routed_experts, splits, float(c.routed_scaling_factor)


def _check_experts(x, w13, w2, shared, n_local: int, inter: int):
    """The expert weights' shapes and dtypes -> the shared expert's inter (0 without one)."""
    hidden = x.shape[1]
    check_tensor("w13", w13, shape=(n_local, 2 * inter, hidden), dtype=x.dtype, dense_dims=3)
    check_tensor("w2", w2, shape=(n_local, hidden, inter), dtype=x.dtype, dense_dims=3)
    if shared is None:
        return 0
    if not isinstance(shared, tuple) or len(shared) != 2:
        raise ValueError(f"shared: expected None or (gate_up_proj [2 I_s, hidden], down_proj [hidden, I_s]), got "
                         f"{type(shared).__name__}")
    rows = check_tensor("shared gate_up_proj", shared[0], shape=(None, hidden), dtype=x.dtype, dense_dims=2).shape[0]
    i_s = rows // 2
    check_tensor("shared gate_up_proj", shared[0], shape=(2 * i_s, hidden), dtype=x.dtype, dense_dims=2)
    check_tensor("shared down_proj", shared[1], shape=(hidden, i_s), dtype=x.dtype, dense_dims=2)
    if i_s < 1:
        raise ValueError(f"shared gate_up_proj: expected at least 2 rows, got shape {list(shared[0].shape)}")
    return i_s


def fused_moe(config: ModelConfig, x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
              expert0: int = 0, tiles: tuple[Tiles, Tiles] | None = None, num_sms: int | None = None) -> None:
    """The MoE layer (module docstring) into out [T, hidden]: x [T, hidden] in bf16, fp16 or fp32; the router's
    gate_weight fp32 [E, hidden] and bias fp32 [E]; this rank's routed experts w13 [n_local, 2 I, hidden] (gate rows
    then up rows) and w2 [n_local, hidden, I], the first of them expert expert0; shared = (gate_up_proj [2 I_s,
    hidden], down_proj [hidden, I_s]) or None; all weights in x's dtype. tiles: the (gate/up, down) GEMMs' launch
    shapes (default: `default_tiles`), for tuning; every choice computes the same result up to fp32 summation order.
    num_sms: the SMs the router's logits spread over (`router_steps`; default the device's)."""
    c = _check_config("fused_moe", config)
    T, hidden = check_tensor("x", x, shape=(None, c.hidden_size), dtype=(torch.bfloat16, torch.float16, torch.float32),
                             dense_dims=1).shape
    check_tensor("w13", w13)
    n_local, inter, k = w13.shape[0] if w13.dim() == 3 else -1, c.moe_intermediate_size, c.num_experts_per_tok
    check_int("fused_moe: expert0", expert0, low=0)
    if n_local < 1 or expert0 + n_local > c.n_routed_experts:
        raise ValueError(f"w13: expected [n_local >= 1, 2 x {inter}, {hidden}] with expert0 {expert0} + n_local <= "
                         f"n_routed_experts {c.n_routed_experts}, got shape {list(w13.shape)}")
    i_s = _check_experts(x, w13, w2, shared, n_local, inter)
    check_tensor("out", out, shape=(T, hidden), dtype=x.dtype, dense_dims=1)
    if tiles is not None and not (isinstance(tiles, tuple) and len(tiles) == 2
                                  and all(isinstance(t, Tiles) for t in tiles)):
        raise ValueError(f"fused_moe: tiles expected None or (Tiles, Tiles) for (gate/up, down), got {tiles!r}")
    _check_router(c, "fused_moe", x, gate_weight, e_score_correction_bias, None, None, outputs=False,
                  weight_name="gate_weight")
    weights_in = dict(x=x, gate_weight=gate_weight, e_score_correction_bias=e_score_correction_bias, w13=w13, w2=w2,
                      **({} if shared is None else {"shared gate_up_proj": shared[0], "shared down_proj": shared[1]}))
    check_same_device(out=out, **weights_in)
    check_disjoint("fused_moe", {"out": out}, weights_in)
    ks = k + (shared is not None)
    if T * ks > MAX_PAIRS:
        raise ValueError(f"fused_moe: at most {MAX_PAIRS} (token, expert) pairs a step, got {T} tokens x {ks}")
    if T == 0:
        return
    ids = torch.empty(T, k, dtype=torch.int32, device=x.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    bm = block_m(T * ks, n_local + (shared is not None))
    sorted_pair, block_expert, align = _alignment("fused_moe", ids, n_local, expert0, shared is not None, bm)
    partial, splits, meta = _router_logits(c, x, gate_weight, _num_sms(x.device, num_sms, "fused_moe"))
    select = _selection(c, partial, splits, e_score_correction_bias, ids, weights)
    if T <= SELECT_BLOCK_T:  # one selection program: it aligns the pairs too
        launch(_select_align_kernel, (1,), *select, *align["args"], **(meta | align["meta"]),
               num_warps=SELECT_ALIGN_WARPS)
    else:
        launch(_router_kernel, (triton.cdiv(T, SELECT_BLOCK_T),), *select, **meta)
        launch(_align_kernel, (1,), ids, *align["args"], **align["meta"])
    tiles = tiles or default_tiles(bm)
    _expert_gemms(x, w13, w2, shared, ids, weights, sorted_pair, block_expert, out, expert0, inter, i_s, ks, bm, tiles)


def align_pairs(ids: torch.Tensor, n_local: int, expert0: int = 0, shared: bool = False, bm: int = 16
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The alignment launch: the router's ids int32 [T, k] -> (sorted_pair int32 [max_blocks x bm],
    block_expert int32 [max_blocks]), in blocks of bm (a power of two >= 16) pairs. Pair t (k + shared) + j is
    token t's j-th expert, or (j = k) its shared expert, numbered n_local; local expert e's pairs fill its run of
    slots in pair order, padded with -1 to whole blocks of bm, the runs in expert order; block_expert names each
    block's expert, -1 past the last. max_blocks = cdiv(T (k + shared), bm) + n_local + shared, the most the runs
    can take."""
    sorted_pair, block_expert, align = _alignment("align_pairs", ids, n_local, expert0, shared, bm)
    launch(_align_kernel, (1,), ids, *align["args"], **align["meta"])
    return sorted_pair, block_expert


def _alignment(launcher: str, ids: torch.Tensor, n_local: int, expert0: int, shared: bool, bm: int) -> tuple:
    """align_pairs' arguments checked -> (sorted_pair, block_expert, the alignment's arguments after ids: "args"
    and its constexprs "meta")."""
    T, k = check_tensor("ids", ids, shape=(None, None), dtype=torch.int32, dense_dims=2).shape
    if not isinstance(shared, bool):
        raise ValueError(f"{launcher}: shared: expected a bool, got {shared!r}")
    check_int(f"{launcher}: n_local", n_local)
    check_int(f"{launcher}: expert0", expert0, low=0)
    if not is_int(bm) or bm not in (16, 32, 64, 128):
        raise ValueError(f"{launcher}: bm expected 16, 32, 64 or 128, got {bm!r}")
    n_pairs, ne = T * (k + shared), n_local + shared
    if ne > MAX_EXPERTS:
        raise ValueError(f"{launcher}: n_local expected <= {MAX_EXPERTS - shared}, got {n_local}")
    if n_pairs > MAX_PAIRS:
        raise ValueError(f"{launcher}: at most {MAX_PAIRS} (token, expert) pairs a step, got {T} tokens x "
                         f"{k + shared}")
    max_blocks = triton.cdiv(n_pairs, bm) + ne  # each expert's run is padded to a whole block
    sorted_pair = torch.empty(max_blocks * bm, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    ne_pad = triton.next_power_of_2(ne + 1)
    offsets = torch.empty(2 * ne_pad, dtype=torch.int32, device=ids.device)
    return sorted_pair, block_expert, {
        "args": (sorted_pair, block_expert, offsets, n_pairs, expert0, n_local, max_blocks * bm, max_blocks),
        "meta": dict(TOP_K=k, SHARED=shared, NE_PAD=ne_pad, P_PAD=triton.next_power_of_2(max(n_pairs, 1)),
                     BLOCK_M=bm)}


def _expert_gemms(x, w13, w2, shared, ids, weights, sorted_pair, block_expert, out, expert0, inter, i_s, ks, bm,
                  tiles):
    """gate/up, down and combine over the aligned pairs (fused_moe's last three launches)."""
    T, hidden = x.shape
    n_local, k, max_blocks = w13.shape[0], ids.shape[1], block_expert.shape[0]
    dt, prec = _dtype_code(x.dtype), dot_precision(x.dtype, x.device)
    s13, s2 = (shared if shared is not None else (w13, w2))
    h = torch.empty(sorted_pair.shape[0], max(inter, i_s), dtype=x.dtype, device=x.device)
    y = torch.empty(T * ks, hidden, dtype=torch.float32, device=x.device)
    up, down = tiles
    launch(_gate_up_kernel, (max_blocks, triton.cdiv(max(inter, i_s), up.block_n)), x, x.stride(0), w13, w13.stride(0),
           s13, sorted_pair, block_expert, h, h.stride(0), hidden, inter, i_s, n_local, KS=ks, DTYPE=dt, PRECISION=prec,
           BLOCK_M=bm, **up.meta())
    launch(_down_kernel, (max_blocks, triton.cdiv(hidden, down.block_n)), h, h.stride(0), w2, w2.stride(0), s2,
           sorted_pair, block_expert, weights, y, hidden, inter, i_s, n_local, TOP_K=k, KS=ks, DTYPE=dt, PRECISION=prec,
           BLOCK_M=bm, **down.meta())
    launch(_combine_kernel, (T, triton.cdiv(hidden, 128)), y, ids, out, out.stride(0), hidden, expert0, n_local,
           TOP_K=k, SHARED=shared is not None, DTYPE=dt, BLOCK_N=128)
