"""The PyTorch specification of DeepSeek-V3.2 / GLM-5.x sparse MLA: readable, exact, slow."""

from dsv32ref.reference.fp8_cache import (dequantize_indexer_keys, dequantize_latent, indexer_scores_fp8,
                                          quantize_indexer_keys, quantize_latent, sparse_mla_fp8)
from dsv32ref.reference.indexer import Indexer, indexer_scores, topk_indices
from dsv32ref.reference.mla import DeepseekV32Attention, LayerCache
from dsv32ref.reference.model import DeepseekV32DecoderLayer, DeepseekV32ForCausalLM, DeepseekV32Model
from dsv32ref.reference.moe import MLP, MoE, Router
from dsv32ref.reference.norms import LayerNorm, RMSNorm, layer_norm, rms_norm
from dsv32ref.reference.numerics import fp8_quantize, fp8_round_trip, hadamard_transform
from dsv32ref.reference.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from dsv32ref.reference.sparse_attention import dense_mla, sparse_mla

__all__ = [
    "DeepseekV32Attention", "DeepseekV32DecoderLayer", "DeepseekV32ForCausalLM", "DeepseekV32Model",
    "Indexer", "LayerCache", "LayerNorm", "MLP", "MoE", "RMSNorm", "Router", "RotaryEmbedding",
    "apply_rope", "dense_mla", "dequantize_indexer_keys", "dequantize_latent", "fp8_quantize", "fp8_round_trip",
    "hadamard_transform", "indexer_scores", "indexer_scores_fp8", "layer_norm", "quantize_indexer_keys",
    "quantize_latent", "rms_norm", "rope_inv_freq", "sparse_mla", "sparse_mla_fp8", "topk_indices",
]
