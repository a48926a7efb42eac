"""The attention's projections at a few tokens (dsv32ref.kernels.skinny_gemm beside F.linear / torch.bmm): time
against the weight read, at the engine's shapes. Called by the kernel benchmark (dsv32ref.bench.kernels).
skinny_gemm runs as the engine runs it, over a counters buffer (K split at `skinny_plan`'s splits), unless the
tiles say otherwise (splits=1: one pass).

At T <= 16 tokens a projection is its weight read: bytes = the weight's (x and y are a few rows). Each call reads
one of several copies of the weight (together at least twice the 50 MB L2), so that replays read them from HBM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dsv32ref.checks import rel_err
from dsv32ref.config import ModelConfig
from dsv32ref.engine.model import a_split
from dsv32ref.kernels.skinny_gemm import skinny_gemm, skinny_gemm_counters, skinny_plan

__all__ = ["LINEAR_TILES", "Projection", "bench_projection", "projection_line", "projections"]

BF16 = torch.bfloat16
L2_BYTES = 50e6  # the H200's L2: the copies a graph reads in turn hold at least twice this
LINEAR_TILES = [dict(block_n=bn, block_k=bk, splits=sp) for bn in (32, 64) for bk in (128, 256) for sp in (1, 2, 4, 8)]


class Projection:
    """One of the engine's projections: y = x Wᵀ (batch None) or per head (batch H: W stored [H, K, N], as W_UK and
    W_UV are, and passed to skinny_gemm as its [H, N, K] view)."""

    def __init__(self, name: str, N: int, K: int, batch: int | None = None, device: str = "cuda"):
        self.name, self.N, self.K, self.batch, self.device = name, N, K, batch, device

    @property
    def copies(self) -> int:
        """Weight copies a graph reads in turn, one a call: at least 10, together at least twice the L2."""
        return max(10, math.ceil(2 * L2_BYTES / self.nbytes))

    def weights(self, gen: torch.Generator) -> list[torch.Tensor]:
        shape = (self.N, self.K) if self.batch is None else (self.batch, self.K, self.N)
        return [(torch.randn(shape, generator=gen, device=self.device) * self.K ** -0.5).to(BF16)
                for _ in range(self.copies)]

    def inputs(self, T: int, gen: torch.Generator) -> torch.Tensor:
        shape = (T, self.K) if self.batch is None else (self.batch, T, self.K)
        return torch.randn(shape, generator=gen, device=self.device).to(BF16)

    def torch_path(self, x, w, out):
        return torch.mm(x, w.T, out=out) if self.batch is None else torch.bmm(x, w, out=out)

    def skinny(self, x, w, out, counters=None, **tiles):
        return skinny_gemm(x, w if self.batch is None else w.transpose(1, 2), out, counters=counters, **tiles)

    def plan(self, tiles: dict | None) -> dict:
        """The launch skinny_gemm makes over counters under these tiles: its columns a program, K splits."""
        t = tiles or {}
        bn, _, splits = skinny_plan(self.N, self.K, self.batch or 1, torch.device(self.device), True,
                                    t.get("block_n"), t.get("block_k", 128), t.get("splits"))
        return {**t, "block_n": bn, "splits": splits}

    @property
    def nbytes(self) -> int:
        return (self.batch or 1) * self.N * self.K * 2


def projections(model: str, device: str = "cuda") -> list[Projection]:
    """The attention's projections of one layer that runs its indexer, at full width (every head on one GPU), as
    the engine holds them (the indexer's wk and weights_proj in the A-projections' GEMM), and the lm_head."""
    c = ModelConfig.preset(model)
    H = c.num_attention_heads
    return [Projection(*args, device=device) for args in (
        ("fused_qkv_a_proj", sum(a_split(c, has_indexer=True)), c.hidden_size),
        ("q_b_proj", H * c.qk_head_dim, c.q_lora_rank),
        ("wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        ("W_UK", c.kv_lora_rank, c.qk_nope_head_dim, H),
        ("W_UV", c.v_head_dim, c.kv_lora_rank, H),
        ("o_proj", c.hidden_size, H * c.v_head_dim),
        ("lm_head", c.vocab_size, c.hidden_size))]


def bench_projection(model: str, p: Projection, T: int, timed, tiles: dict | None = None) -> dict:
    """F.linear (torch.bmm per head) and skinny_gemm on the same inputs, each checked against the other in float64
    terms and timed by `timed(fn)` over the rotating weight copies."""
    gen = torch.Generator(device=p.device).manual_seed(T)
    ws, x = p.weights(gen), p.inputs(T, gen)
    shape = (T, p.N) if p.batch is None else (p.batch, T, p.N)
    ref = torch.empty(shape, dtype=BF16, device=p.device)
    out = torch.full(shape, float("nan"), dtype=BF16, device=p.device)
    counters = skinny_gemm_counters(p.device)
    p.torch_path(x, ws[0], ref)
    p.skinny(x, ws[0], out, counters, **(tiles or {}))
    exact = torch.matmul(x.double(), (ws[0].double().T if p.batch is None else ws[0].double()))
    err, err_torch = rel_err(out, exact), rel_err(ref, exact)
    i, n = iter(range(10 ** 9)), len(ws)
    t_torch = timed(lambda: p.torch_path(x, ws[next(i) % n], ref), n_inner=n)
    t_skinny = timed(lambda: p.skinny(x, ws[next(i) % n], out, counters, **(tiles or {})), n_inner=n)
    return {"kernel": "skinny_gemm", "model": model, "projection": p.name, "T": T, "N": p.N, "K": p.K,
            "batch": p.batch, "tiles": tiles, "launch": p.plan(tiles), "ms": t_skinny["ms"],
            "ms_eager": t_skinny.get("ms_eager"),
            "torch_ms": t_torch["ms"],
            "timing": t_skinny.get("timing"), "bytes": p.nbytes, "flops": 2 * (p.batch or 1) * T * p.N * p.K,
            "rel_err": err, "torch_rel_err": err_torch, "ok": err <= 2 * err_torch + 1e-6 and not counters.any()}


def projection_line(r: dict) -> str:
    tiles = " " + ",".join(f"{k}={v}" for k, v in r["launch"].items())
    return (f"{r['model']} {r['projection']:<16} T={r['T']:<3} skinny {r['ms'] * 1e3:7.1f} us "
            f"({r['bytes'] / r['ms'] / 1e6:5.0f} GB/s), torch {r['torch_ms'] * 1e3:7.1f} us "
            f"({r['bytes'] / r['torch_ms'] / 1e6:5.0f} GB/s), rel_err {r['rel_err']:.1e} ok={r['ok']}{tiles}")
