"""The PyTorch specification of DeepSeek-V3.2 / GLM-5.x sparse MLA: readable, exact, slow."""

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
    "apply_rope", "dense_mla", "fp8_quantize", "fp8_round_trip", "hadamard_transform", "indexer_scores",
    "layer_norm", "rms_norm", "rope_inv_freq", "sparse_mla", "topk_indices",
]
