"""The classes of the launch ledger: each kernel launch is attributed to the innermost named region.

The regions themselves (`region`, `current_region`) live in dsv32ref.instrument, where they cost nothing
unless a measurement is being taken.
"""

from __future__ import annotations

from dsv32ref.instrument import current_region, region

__all__ = ["CATEGORIES", "current_region", "region"]

# The classes of the seeds' launch trace, plus the rest of the model.
CATEGORIES = {
    "a_proj": "A-projection GEMMs", "norm_rope": "norm/RoPE", "q_gemm": "q/indexer GEMMs", "wuk_bmm": "W_UK BMM",
    "fused_q": "fused-Q", "indexer": "indexer", "attention": "attention", "uv_bmm": "UV BMM", "copy": "output copy",
    "o_proj": "o_proj GEMM", "layer_norm": "layer RMSNorm", "moe": "MoE", "mlp": "dense MLP", "embed": "embedding",
    "cast": "dtype casts", "all_reduce": "all-reduce",
}
