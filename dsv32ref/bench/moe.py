"""The fused MoE layer (dsv32ref.kernels.fused_moe) on one GPU: its time against the bytes it must read, and its
grouped GEMMs' tiles. Called by the kernel benchmark (dsv32ref.bench.kernels), which holds the ceilings.

A layer at T tokens reads the weights of every expert its tokens selected (3 H I values each), the shared expert's
and the router's fp32 gate; at a few tokens that is all it does, so its floor is those bytes at the copy bandwidth.
Two expert counts: the model's own (256 experts, top 8: a decode step of a served model) and the TTFT protocol's
reduced MoE (4 experts, top 2: dsv32ref.config.reduced_moe), whose few programs a GPU of 132 SMs fills unevenly.

Each case is checked against a PyTorch formulation on the same routing (every selected expert's projections in
the activation dtype, weighted in fp32), then timed by CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from dsv32ref.checks import rel_err
from dsv32ref.config import ModelConfig, reduced_moe
from dsv32ref.kernels.fused_moe import Tiles, fused_moe, route_kernel

__all__ = ["MOE_CASES", "TILE_SWEEP", "MoELayer", "bench_moe", "moe_line"]

BF16 = torch.bfloat16
MOE_CASES = [("glm-5.2", "reduced", 8), ("glm-5.2", "reduced", 1), ("glm-5.2", "full", 1), ("glm-5.2", "full", 8),
             ("glm-5.2", "full", 64), ("deepseek-v3.2", "reduced", 8), ("deepseek-v3.2", "full", 8)]
# (gate/up or down, Tiles): each GEMM's tiles varied with the other's at its default
TILE_SWEEP = [(which, Tiles(bn, bk, w, s)) for which in ("gate_up", "down") for bn in (16, 32, 64, 128)
              for bk in (64, 128, 256) for w, s in ((4, 3), (4, 4), (4, 6), (8, 4))]


class MoELayer:
    """One MoE layer's weights on the GPU, random (std 0.02, the router's 0.05 in fp32), for `experts` "full" (the
    preset's count) or "reduced" (the TTFT protocol's)."""

    def __init__(self, model: str, experts: str, seed: int = 0, device: str = "cuda"):
        self.model, self.experts = model, experts
        c = ModelConfig.preset(model) if experts == "full" else reduced_moe(model)
        self.config = c
        g = torch.Generator(device=device).manual_seed(seed)
        E, H, inter = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size

        def rand(*shape, std=0.02, dtype=BF16):
            return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)
        self.gate = rand(E, H, std=0.05, dtype=torch.float32)
        self.bias = torch.rand(E, generator=g, device=device) * 0.1
        self.w13, self.w2 = rand(E, 2 * inter, H), rand(E, H, inter)
        i_s = inter * c.n_shared_experts
        self.shared = (rand(2 * i_s, H), rand(H, i_s))

    def __call__(self, x: torch.Tensor, out: torch.Tensor, tiles: tuple[Tiles, Tiles] | None = None) -> None:
        fused_moe(self.config, x, self.gate, self.bias, self.w13, self.w2, self.shared, out, tiles=tiles)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, k = x.shape[0], self.config.num_experts_per_tok
        ids = torch.empty(T, k, dtype=torch.int32, device=x.device)
        weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
        route_kernel(self.config, x, self.gate, self.bias, ids, weights)
        return ids, weights

    def torch_layer(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same layer on the same routing in PyTorch ops, token by token (the check, not timed)."""
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for t in range(x.shape[0]):
            for e, w in zip(ids[t].tolist(), weights[t]):
                gate, up = F.linear(x[t], self.w13[e]).chunk(2)
                routed[t] += F.linear(F.silu(gate) * up, self.w2[e]).float() * w
        gate, up = F.linear(x, self.shared[0]).chunk(2, dim=-1)
        return routed.to(x.dtype) + F.linear(F.silu(gate) * up, self.shared[1])

    def bytes_read(self, ids: torch.Tensor) -> int:
        """The distinct selected experts' weights, the shared expert's and the router's."""
        per_expert = (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()
        shared = sum(w.numel() * w.element_size() for w in self.shared)
        return len(set(ids.flatten().tolist())) * per_expert + shared + self.gate.numel() * 4


def bench_moe(layer: MoELayer, T: int, timed, tiles: tuple[Tiles, Tiles] | None = None) -> dict:
    """One case: checked (outputs poisoned) against `torch_layer`, then timed by `timed(fn)` (the kernel benchmark's
    graph-replay timer); bytes and FLOPs for the roofline."""
    c = layer.config
    g = torch.Generator(device=layer.gate.device).manual_seed(T)  # each tiling of a case routes the same tokens
    x = torch.randn(T, c.hidden_size, generator=g, device=layer.gate.device).to(BF16)
    out = torch.full_like(x, float("nan"))
    layer(x, out, tiles)
    ids, weights = layer.route(x)
    err = rel_err(out, layer.torch_layer(x, ids.long(), weights))
    t = timed(lambda: layer(x, out, tiles))
    pairs = T * (c.num_experts_per_tok + 1)
    flops = 2 * pairs * 3 * c.hidden_size * c.moe_intermediate_size
    return {"kernel": "fused_moe", "model": layer.model, "experts": layer.experts, "T": T,
            "n_routed_experts": c.n_routed_experts, "top_k": c.num_experts_per_tok,
            "distinct_experts": len(set(ids.flatten().tolist())),
            "tiles": None if tiles is None else [dataclasses.asdict(t_) for t_ in tiles], **t,
            "flops": flops, "bytes": layer.bytes_read(ids), "rel_err": err, "ok": err < 1e-2}


def moe_line(r: dict) -> str:
    tiles = "" if r["tiles"] is None else f" tiles {r['tiles']}"
    return (f"fused_moe {r['model']} {r['experts']} ({r['n_routed_experts']} experts, top {r['top_k']}) T={r['T']}: "
            f"{r['ms'] * 1e3:.1f} us, {r['bytes'] / r['ms'] / 1e6:.0f} GB/s, rel_err {r['rel_err']:.1e}{tiles}")
