"""Triton kernels for the DeepSeek-V3.2 hot path. Each launcher checks its inputs and writes into
caller-owned outputs, so that a serving engine can capture it in a CUDA graph.

On a machine without a GPU, set TRITON_INTERPRET=1 before importing triton and pass CPU tensors.
"""

from dsv32ref.kernels.fused_norm_rope import fused_norm_rope
from dsv32ref.kernels.fused_q import fused_q
from dsv32ref.kernels.indexer_topk import indexer_scores_paged, indexer_topk_paged, topk_from_scores
from dsv32ref.kernels.residual_norm import add_rms_norm
from dsv32ref.kernels.skinny_gemm import skinny_gemm
from dsv32ref.kernels.sparse_mla import sparse_mla_paged

__all__ = ["add_rms_norm", "fused_norm_rope", "fused_q", "indexer_scores_paged", "indexer_topk_paged",
           "skinny_gemm", "sparse_mla_paged", "topk_from_scores"]
