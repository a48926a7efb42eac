"""The engine model's weight plumbing: copying a reference model's weights into the fused engine layout,
sharding them for tensor parallelism, and drawing reproducible dummy weights. The forward lives in
dsv32ref.engine.model; nothing here runs during a step."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from dsv32ref.engine.model import EngineModel, EngineMLP, EngineMoE, TensorParallel

__all__ = ["from_reference", "init_dummy", "shard"]


def from_reference(ref, boundary: str = "narrow") -> EngineModel:
    """An EngineModel with the same weights as a dsv32ref reference model (for equivalence tests)."""
    c = ref.config
    m = EngineModel(c, boundary)
    dev, dt = ref.lm_head.weight.device, ref.lm_head.weight.dtype
    m.to(device=dev, dtype=dt)
    with torch.no_grad():
        m.embed_tokens.copy_(ref.model.embed_tokens.weight)
        m.norm.copy_(ref.model.norm.weight)
        m.lm_head.copy_(ref.lm_head.weight)
        for L, R in zip(m.layers, ref.model.layers):
            L.input_layernorm.copy_(R.input_layernorm.weight)
            L.post_attention_layernorm.copy_(R.post_attention_layernorm.weight)
            a, r = L.self_attn, R.self_attn
            a.fused_qkv_a_proj.copy_(torch.cat((r.q_a_proj.weight, r.kv_a_proj_with_mqa.weight)))
            a.q_a_layernorm.copy_(r.q_a_layernorm.weight)
            a.kv_a_layernorm.copy_(r.kv_a_layernorm.weight)
            a.q_b_proj.copy_(r.q_b_proj.weight)
            a.W_UK.copy_(r.W_UK)
            a.W_UV.copy_(r.W_UV.transpose(1, 2))
            a.o_proj.copy_(r.o_proj.weight)
            if a.has_indexer:
                a.wq_b.copy_(r.indexer.wq_b.weight)
                a.wk_weights_proj.copy_(torch.cat((r.indexer.wk.weight, r.indexer.weights_proj.weight)))
                a.k_norm_weight.copy_(r.indexer.k_norm.weight)
                a.k_norm_bias.copy_(r.indexer.k_norm.bias)
            if isinstance(L.mlp, EngineMoE):
                L.mlp.gate.load_state_dict(R.mlp.gate.state_dict())
                L.mlp.w13.copy_(torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in R.mlp.experts]))
                L.mlp.w2.copy_(torch.stack([e.down_proj.weight for e in R.mlp.experts]))
                if L.mlp.shared is not None:
                    s = R.mlp.shared_experts
                    L.mlp.shared.gate_up_proj.copy_(torch.cat((s.gate_proj.weight, s.up_proj.weight)))
                    L.mlp.shared.down_proj.copy_(s.down_proj.weight)
            else:
                L.mlp.gate_up_proj.copy_(torch.cat((R.mlp.gate_proj.weight, R.mlp.up_proj.weight)))
                L.mlp.down_proj.copy_(R.mlp.down_proj.weight)
    return m

@torch.no_grad()
def shard(model: EngineModel, tp: TensorParallel) -> EngineModel:
    """This rank's part of the model, in place: attention heads, dense-MLP and shared-expert columns split
    tp.size ways, routed experts split tp.size ways (expert parallel). The A-projections, norms, the
    indexer, the router, the embedding and lm_head stay replicated, as the serving engine keeps them;
    so does the latent cache (one [c_kv | k_pe] row per token, shared by all heads)."""
    c, n = model.config, tp.size
    for name, v in (("num_attention_heads", c.num_attention_heads), ("n_routed_experts", c.n_routed_experts),
                    ("intermediate_size", c.intermediate_size), ("moe_intermediate_size", c.moe_intermediate_size)):
        if v % n:
            raise ValueError(f"shard: {name}={v} is not divisible by the tensor-parallel size {n}")
    H = c.num_attention_heads
    heads = slice(tp.rank * H // n, (tp.rank + 1) * H // n)

    def cols(w, total):  # [.., total] -> this rank's share of the last dim
        k = total // n
        return w[..., tp.rank * k:(tp.rank + 1) * k].contiguous()

    def gate_up(w, inter):  # rows [gate (inter) ; up (inter)] -> this rank's rows of each half
        k = inter // n
        g, u = w[:inter], w[inter:]
        return torch.cat((g[tp.rank * k:(tp.rank + 1) * k], u[tp.rank * k:(tp.rank + 1) * k]))

    def set_(module, name, value):
        setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=False))

    for layer in model.layers:
        a = layer.self_attn
        set_(a, "q_b_proj", a.q_b_proj.view(H, c.qk_head_dim, c.q_lora_rank)[heads].reshape(-1, c.q_lora_rank))
        set_(a, "W_UK", a.W_UK[heads])
        set_(a, "W_UV", a.W_UV[heads])
        set_(a, "o_proj", a.o_proj.view(c.hidden_size, H, c.v_head_dim)[:, heads].reshape(c.hidden_size, -1))
        a.H, a.tp = H // n, tp
        mlps = [layer.mlp] if isinstance(layer.mlp, EngineMLP) else [m for m in [layer.mlp.shared] if m is not None]
        for m in mlps:
            inter = m.down_proj.shape[1]
            set_(m, "gate_up_proj", gate_up(m.gate_up_proj, inter))
            set_(m, "down_proj", cols(m.down_proj, inter))
        if isinstance(layer.mlp, EngineMoE):
            moe, k = layer.mlp, c.n_routed_experts // n
            moe.expert0, moe.n_local = tp.rank * k, k
            set_(moe, "w13", moe.w13[moe.expert0: moe.expert0 + k])
            set_(moe, "w2", moe.w2[moe.expert0: moe.expert0 + k])
    return model

@torch.no_grad()
def init_dummy(model: EngineModel, seed: int = 0) -> EngineModel:
    """Reproducible weights drawn on the model's device (fast at full size), scaled like
    dsv32ref.init_dummy_weights: linear ~ N(0, 1/fan_in), norms ~ 1, embeddings ~ N(0, 1)."""
    for name, p in model.named_parameters():
        g = torch.Generator(device=p.device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        x = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            x *= 0.01
        elif name.endswith("bias"):
            x *= 0.05
        elif "norm" in name:
            x = 1.0 + 0.05 * x
        elif not name.endswith("embed_tokens"):
            x /= p.shape[-1] ** 0.5 if name.split(".")[-1] not in ("W_UV",) else p.shape[-2] ** 0.5
        p.copy_(x.to(p.dtype))
    return model
