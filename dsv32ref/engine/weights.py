"""The engine model's weight plumbing: copying a reference model's weights into the fused engine layout,
sharding them for tensor parallelism, drawing reproducible dummy weights, and building a model for another
boundary over the same weights. The forward lives in dsv32ref.engine.model; nothing here runs during a step."""

from __future__ import annotations

import torch

from dsv32ref.checkpoint import tensor_generator
from dsv32ref.checks import MAX_SEED, check_fits, check_int, module_bytes, shown
from dsv32ref.config import ModelConfig
from dsv32ref.engine.config import check_placement
from dsv32ref.engine.model import SINGLE, EngineModel, EngineMoE, TensorParallel
from dsv32ref.reference.model import DeepseekV32ForCausalLM

__all__ = ["build_model", "from_reference", "init_dummy", "share_weights", "shard"]


def from_reference(ref, boundary: str = "narrow", moe: str = "dense") -> EngineModel:
    """An EngineModel with the same weights as a dsv32ref reference model (for equivalence tests)."""
    if not isinstance(ref, DeepseekV32ForCausalLM):
        raise ValueError(f"from_reference: ref: expected a DeepseekV32ForCausalLM, got {type(ref).__name__}")
    c = ref.config
    m = EngineModel(c, boundary, moe=moe)
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
            rows = [r.q_a_proj.weight, r.kv_a_proj_with_mqa.weight]  # a_split's order
            if a.has_indexer:
                rows += [r.indexer.wk.weight, r.indexer.weights_proj.weight]
            a.fused_qkv_a_proj.copy_(torch.cat(rows))
            a.q_a_layernorm.copy_(r.q_a_layernorm.weight)
            a.kv_a_layernorm.copy_(r.kv_a_layernorm.weight)
            a.q_b_proj.copy_(r.q_b_proj.weight)
            a.W_UK.copy_(r.W_UK)
            a.W_UV.copy_(r.W_UV.transpose(1, 2))
            a.o_proj.copy_(r.o_proj.weight)
            if a.has_indexer:
                a.wq_b.copy_(r.indexer.wq_b.weight)
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

def _on_meta(config: ModelConfig, boundary, tp: TensorParallel, moe: str = "dense") -> EngineModel:
    with torch.device("meta"):
        return EngineModel(config, boundary, tp, moe)


def share_weights(model: EngineModel, boundary, moe: str = "dense") -> EngineModel:
    """A model built for `boundary` (and the MoE form `moe`) over the same parameter tensors as `model` (same
    rank): engines that compare boundaries hold one model each and one copy of the weights."""
    if not isinstance(model, EngineModel):
        raise ValueError(f"share_weights: model: expected an EngineModel, got {type(model).__name__}")
    out = _on_meta(model.config, boundary, model.tp, moe)
    out.load_state_dict(model.state_dict(), assign=True)
    return out.eval()


def _shard_tensor(name: str, w: torch.Tensor, c: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of one parameter of the full model (see `shard`)."""
    n, r, H = tp.size, tp.rank, c.num_attention_heads
    heads = slice(r * H // n, (r + 1) * H // n)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "q_b_proj":
        return w.view(H, c.qk_head_dim, c.q_lora_rank)[heads].reshape(-1, c.q_lora_rank)
    if leaf in ("W_UK", "W_UV"):
        return w[heads]
    if leaf == "o_proj":
        return w.view(c.hidden_size, H, c.v_head_dim)[:, heads].reshape(c.hidden_size, -1)
    if leaf == "gate_up_proj":  # rows [gate (inter) ; up (inter)] -> this rank's rows of each half
        k = w.shape[0] // 2 // n
        gate, up = w.chunk(2)
        return torch.cat((gate[r * k:(r + 1) * k], up[r * k:(r + 1) * k]))
    if leaf == "down_proj":  # [hidden, inter] -> this rank's columns
        k = w.shape[1] // n
        return w[:, r * k:(r + 1) * k]
    if leaf in ("w13", "w2"):  # routed experts: expert parallel
        k = w.shape[0] // n
        return w[r * k:(r + 1) * k]
    return w  # A-projections, norms, the indexer, the router, the embedding and lm_head stay replicated


@torch.no_grad()
def shard(model: EngineModel, tp: TensorParallel) -> EngineModel:
    """This rank's model: attention heads, dense-MLP and shared-expert columns split tp.size ways, routed experts
    split tp.size ways (expert parallel). The A-projections, norms, the indexer, the router, the embedding and
    lm_head stay replicated, as the serving engine keeps them; so does the latent cache (one [c_kv | k_pe] row
    per token, shared by all heads). `model` is the full model (one rank)."""
    if not isinstance(tp, TensorParallel):
        raise ValueError(f"shard: tp: expected a TensorParallel (rank, size), got {type(tp).__name__} {shown(tp)}")
    if model.tp.size != 1:
        raise ValueError(f"shard: expected the full model (tensor-parallel size 1), got size {model.tp.size}")
    out = _on_meta(model.config, model.boundary, tp, model.moe)
    out.load_state_dict({k: _shard_tensor(k, w, model.config, tp).contiguous() for k, w in model.state_dict().items()},
                        assign=True)
    return out.eval()


def build_model(config: ModelConfig, boundary, device, dtype, seed: int, moe: str = "dense") -> EngineModel:
    """Dummy weights created directly on the device in the target dtype (a full-size model never touches the
    host), fp32 where the model keeps fp32 (the router). A model larger than the device is refused first (its
    size read off a copy on the meta device)."""
    device = check_placement("build_model", device, dtype)
    check_int("build_model: seed", seed, 0, MAX_SEED)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        probe = _on_meta(config, boundary, SINGLE, moe)
        largest = max((p.numel() for p in probe.parameters()), default=0)  # init_dummy draws it in fp32, then casts
        check_fits(f"build_model: {config.name} in {dtype}", module_bytes(probe) + largest * (4 + dtype.itemsize),
                   device)
        with torch.device(device):
            model = EngineModel(config, boundary, moe=moe)
    finally:
        torch.set_default_dtype(old)
    return init_dummy(model, seed).eval()


@torch.no_grad()
def init_dummy(model: EngineModel, seed: int = 0) -> EngineModel:
    """Reproducible weights drawn on the model's device (fast at full size), scaled like
    dsv32ref.init_dummy_weights: linear ~ N(0, 1/fan_in), norms ~ 1, embeddings ~ N(0, 1)."""
    check_int("init_dummy: seed", seed, 0, MAX_SEED)
    for name, p in model.named_parameters():
        g = tensor_generator(seed, name, p.device)
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
