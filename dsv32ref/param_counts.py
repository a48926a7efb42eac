"""Parameter counts per layer, from modules built on the meta device (no memory, exact shapes)."""

from __future__ import annotations

import torch

from dsv32ref.config import ModelConfig
from dsv32ref.reference.model import DeepseekV32DecoderLayer


def _numel(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def layer_parameter_counts(config: ModelConfig) -> list[dict[str, int]]:
    """For each layer: {"mla", "indexer", "mlp", "norms", "total"} parameter counts.

    "mla" is the attention without its indexer; "mlp" the dense MLP or the MoE (router, routed and
    shared experts). One module per distinct (dense/MoE, indexer/shared) kind is built and reused.
    """
    kinds: dict[tuple[bool, bool], dict[str, int]] = {}
    counts = []
    for i in range(config.num_hidden_layers):
        kind = (config.is_moe_layer(i), config.runs_indexer(i))
        if kind not in kinds:
            with torch.device("meta"):
                layer = DeepseekV32DecoderLayer(config, i, "absorbed", False)
            indexer = _numel(layer.self_attn.indexer)
            c = {
                "mla": _numel(layer.self_attn) - indexer,
                "indexer": indexer,
                "mlp": _numel(layer.mlp),
                "norms": _numel(layer.input_layernorm) + _numel(layer.post_attention_layernorm),
            }
            c["total"] = sum(c.values())
            kinds[kind] = c
        counts.append(dict(kinds[kind]))
    return counts


def model_parameter_count(config: ModelConfig) -> int:
    """All parameters of the causal LM (embedding, layers, final norm, lm_head); MTP layers excluded."""
    embed = config.vocab_size * config.hidden_size
    return 2 * embed + config.hidden_size + sum(c["total"] for c in layer_parameter_counts(config))
