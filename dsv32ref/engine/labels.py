"""Named regions of the forward, for the launch ledger: each kernel launch is attributed to the innermost one.

`region(name)` opens a torch.profiler range `dsv32ref::<name>` (the GPU ledger assigns direct launches to the
range that contains them) and pushes the name on a thread-local stack (the CPU ledger reads it).
"""

from __future__ import annotations

import contextlib
import threading

import torch

_local = threading.local()

# The classes of the seeds' launch trace, plus the rest of the model.
CATEGORIES = {
    "a_proj": "A-projection GEMMs", "norm_rope": "norm/RoPE", "q_gemm": "q/indexer GEMMs", "wuk_bmm": "W_UK BMM",
    "fused_q": "fused-Q", "indexer": "indexer", "attention": "attention", "uv_bmm": "UV BMM", "copy": "output copy",
    "o_proj": "o_proj GEMM", "layer_norm": "layer RMSNorm", "moe": "MoE", "mlp": "dense MLP", "embed": "embedding",
    "cast": "dtype casts",
}


def current_region() -> str:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else "other"


@contextlib.contextmanager
def region(name: str):
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        with torch.profiler.record_function(f"dsv32ref::{name}"):
            yield
    finally:
        stack.pop()
