"""Decoder layer, model and causal LM, with HF parameter names (`model.layers.N.self_attn.q_a_proj`, ...)."""

from __future__ import annotations

import torch
from torch import nn

from dsv32ref.cache import AttentionMetadata, PagedKVCache, check_cache_fits
from dsv32ref.checks import check_fits, check_tensor, module_bytes
from dsv32ref.config import ModelConfig
from dsv32ref.reference.mla import DeepseekV32Attention, LayerCache
from dsv32ref.reference.moe import MLP, MoE
from dsv32ref.reference.norms import RMSNorm
from dsv32ref.reference.rope import RotaryEmbedding


class DeepseekV32DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, form: str, deployed_numerics: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV32Attention(config, layer_idx, form, deployed_numerics)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(layer_idx) else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h, cos, sin, cache: LayerCache, meta: AttentionMetadata, prev_topk):
        attn_out, topk = self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, prev_topk)
        h = h + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), topk


class DeepseekV32Model(nn.Module):
    def __init__(self, config: ModelConfig, form: str = "absorbed", deployed_numerics: bool = False):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV32DecoderLayer(config, i, form, deployed_numerics) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids, kv_cache: PagedKVCache, meta: AttentionMetadata, topk_out: list | None = None):
        h = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb(meta.positions, h.dtype)  # (T, rope/2) each
        topk = None
        for i, layer in enumerate(self.layers):
            cache = LayerCache(kv_cache.latent[i], kv_cache.indexer_k[i])
            h, topk = layer(h, cos, sin, cache, meta, topk)
            if topk_out is not None:
                topk_out.append(topk)
        return self.norm(h)


class DeepseekV32ForCausalLM(nn.Module):
    """The causal LM. `model(input_ids)` runs one sequence (positions 0..T-1) with a fresh cache.

    With `kv_cache` and `attn_metadata`, it runs one step of a batch of requests on the paged cache
    (prefill, chunked prefill or decode: only the metadata differs) and returns logits for every token.
    """

    def __init__(self, config: ModelConfig, form: str = "absorbed", deployed_numerics: bool = False):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"DeepseekV32ForCausalLM: config: expected a ModelConfig, got {type(config).__name__}")
        device = torch.get_default_device()
        if device.type != "meta":  # a model larger than its device is refused first (its size read off a meta copy)
            with torch.device("meta"):
                size = module_bytes(DeepseekV32ForCausalLM(config, form, deployed_numerics))
            check_fits(f"DeepseekV32ForCausalLM: {config.name} in {torch.get_default_dtype()}", size, device)
        self.config = config
        self.model = DeepseekV32Model(config, form, deployed_numerics)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def set_form(self, form: str) -> None:
        """Switch every attention layer between the "absorbed" and "naive" forms (same weights)."""
        if form not in ("absorbed", "naive"):
            raise ValueError(f"form: expected 'absorbed' or 'naive', got {form!r}")
        for layer in self.model.layers:
            layer.self_attn.form = form

    def new_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> PagedKVCache:
        p = self.lm_head.weight
        return PagedKVCache(self.config, num_blocks, block_size, dtype or p.dtype, p.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: PagedKVCache | None = None,
        attn_metadata: AttentionMetadata | None = None,
        topk_out: list | None = None,
    ) -> torch.Tensor:
        """input_ids int64 [T] -> logits [T, vocab_size] (in the model's dtype).

        `topk_out`, if given, receives each layer's int32 [T, index_topk] top-k indices (for inspection).
        """
        device = self.lm_head.weight.device
        check_tensor("input_ids", input_ids, shape=(None,), dtype=(torch.int64, torch.int32), device=device)
        if input_ids.numel() == 0:
            raise ValueError("input_ids: expected at least one token, got shape [0]")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"input_ids: token ids must lie in [0, {self.config.vocab_size}), got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if (kv_cache is None) != (attn_metadata is None):
            raise ValueError("kv_cache and attn_metadata: pass both or neither")
        if kv_cache is None:
            T, block_size = input_ids.shape[0], 16
            blocks = -(-T // block_size)
            kv_cache = self.new_cache(blocks, block_size)
            attn_metadata = AttentionMetadata.build([0], [T], [list(range(blocks))], block_size, device)
        else:
            self._check_step(kv_cache, attn_metadata, input_ids.shape[0], device)
        h = self.model(input_ids.long(), kv_cache, attn_metadata, topk_out)
        return self.lm_head(h)

    def _check_step(self, kv_cache, attn_metadata, T: int, device: torch.device) -> None:
        """A cache for this model on its device, and metadata for T tokens over that cache's blocks."""
        check_cache_fits(kv_cache, self.config, device)
        if not isinstance(attn_metadata, AttentionMetadata):
            raise ValueError(f"attn_metadata: expected an AttentionMetadata, got {type(attn_metadata).__name__}")
        if attn_metadata.num_tokens != T:
            raise ValueError(f"input_ids: attn_metadata describes {attn_metadata.num_tokens} tokens, got {T}")
        if kv_cache.block_size != attn_metadata.block_size:
            raise ValueError(f"kv_cache: block_size {kv_cache.block_size}, but attn_metadata was built for blocks "
                             f"of {attn_metadata.block_size}")
        if int(attn_metadata.block_table.max()) >= kv_cache.num_blocks:
            raise ValueError(f"attn_metadata.block_table: block ids must lie in [0, {kv_cache.num_blocks}) "
                             f"(kv_cache.num_blocks), got {int(attn_metadata.block_table.max())}")
        attn_metadata.check()  # positions and slots as its lengths and block tables make them
