"""The per-step forward context: what eager regions read at replay time, set by the engine before each step.

Graph segments see only the static buffers their capture saw. Eager regions also need host-side
metadata (how many requests, their query slices and lengths) to choose their path and split their work,
which is exactly why they cannot be captured. The engine publishes that for the current step here, the
way vLLM's `set_forward_context` does; the model reads it with `get_forward_context()`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from dsv32ref.cache import PagedKVCache

_local = threading.local()


@dataclass
class ForwardContext:
    """One step of a padded batch of `num_tokens` rows (rows past the real tokens are padding).

    Device tensors are views of the engine's static buffers, so graph captures see fixed addresses:
        positions int64 [N], slot_mapping int64 [N] (-1 on padding rows), req_indices int32 [N],
        seq_lens int32 [B_max + 1] (the last entry is a zero-length request the padding rows point to),
        block_table int32 [B_max + 1, max_blocks], topk int32 [N, index_topk] (shared by IndexShare layers),
        scores fp32 [N', max_model_len] (the graph-safe indexer's workspace: N' = N for boundary "none", the
        padded decode rows otherwise).
    Host metadata (eager regions only): query_start_loc_cpu, seq_lens_cpu of the real requests.
    """

    kv_cache: PagedKVCache
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    req_indices: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    topk: torch.Tensor
    scores: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    uniform_decode: bool
    num_sms: int | None = None  # SMs the launches that split their work fill (EngineConfig.num_sms)
    skip_topk: bool = False  # every request has <= index_topk keys: the indexer may skip scoring and selection
    gemm: str = "torch"  # EngineConfig.gemm: which kernel the projections of a step of few tokens take
    gemm_counters: torch.Tensor | None = None  # int32 zeros: skinny_gemm's split-K counters (gemm "skinny")

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def current_forward_context() -> ForwardContext | None:
    """The step's context, or None outside a step (a module called on its own, as tests do)."""
    return getattr(_local, "ctx", None)


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(...)")
    return ctx


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    old = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = old
