"""The eager boundaries, described once: what stays eager, who owns the attention output, which static buffers
exist. The attention's forward reads these fields; nothing else branches on a boundary's name.

Under PIECEWISE capture an eager region ends a graph segment, runs eagerly and a new segment starts after it.
vLLM's DeepSeek-V3.2 attention names the regions `_fused_attention` (the whole attention body after the
A-projections: the engine before the PR) and `_sparse_indexer_and_attn` (the indexer and the sparse attention:
after it); the model here keeps those names.

    wide                eager: _fused_attention (norm/RoPE, q_b GEMM, W_UK BMM, indexer wq_b GEMM, fused-Q,
                        indexer, attention, UV BMM); the latent output lives and dies inside the region
    narrow              eager: _sparse_indexer_and_attn; the latent output is allocated inside the region and
                        consumed there by the UV BMM, no copy (the PR)
    narrow_copy         the region copies the latent output into a static buffer, so the UV BMM is captured (the
                        variant the PR rejected); "static" read as the layer keeping one buffer per token count
                        it has run, created on first use, so each captured size replays at a stable address
    narrow_copy_shared  the same copy into ONE static buffer that every layer shares, sized for the largest
                        step (layers run one after another; the UV BMM reads it before the next layer writes it)
    narrow_out          the region writes the latent output straight into a graph-owned activation, UV BMM
                        captured, no copy (the follow-up the PR's authors asked for: forward_mqa with `out`)
    none                no eager region: prefill and mixed steps take the graph-safe path uniform decode takes
                        (indexer scores into the engine's static workspace, one top-k and one sparse-attention
                        launch per layer, lengths and block tables read on the device), so FULL graphs capture
                        every step of a captured size, prefill included

All six compute the same function. Under FULL capture every region is captured like any op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BOUNDARIES", "Boundary", "StaticOutputs", "get_boundary"]

FUSED_ATTENTION, SPARSE_INDEXER_AND_ATTN = "_fused_attention", "_sparse_indexer_and_attn"


@dataclass(frozen=True)
class Boundary:
    """One eager boundary.

    eager         the eager region under PIECEWISE capture: FUSED_ATTENTION, SPARSE_INDEXER_AND_ATTN, or None
    output        who owns the latent attention output o_lat [T, H, kv_lora]: "region" (allocated and consumed
                  inside the eager region), "per_size" (a static buffer per layer and token count), "shared" (one
                  static buffer for every layer), "graph" (a graph-owned activation the sparse path writes)
    uv_in_region  whether the W_UV BMM runs inside the eager region (else it is captured after it)
    """

    name: str
    eager: str | None
    output: str
    uv_in_region: bool

    @property
    def graph_safe_prefill(self) -> bool:
        """No eager region: every step takes the graph-safe path, so FULL graphs serve prefill too."""
        return self.eager is None

    @property
    def copies_output(self) -> bool:
        return self.output in ("per_size", "shared")


_ALL = (
    Boundary("wide", FUSED_ATTENTION, "region", True),
    Boundary("narrow", SPARSE_INDEXER_AND_ATTN, "region", True),
    Boundary("narrow_copy", SPARSE_INDEXER_AND_ATTN, "per_size", False),
    Boundary("narrow_copy_shared", SPARSE_INDEXER_AND_ATTN, "shared", False),
    Boundary("narrow_out", SPARSE_INDEXER_AND_ATTN, "graph", False),
    Boundary("none", None, "graph", False),
)
_BY_NAME = {b.name: b for b in _ALL}
BOUNDARIES = tuple(_BY_NAME)


def get_boundary(name) -> Boundary:
    """The description of boundary `name` (a Boundary passes through); ValueError naming the choices."""
    if isinstance(name, Boundary):
        return name
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ValueError(f"boundary: expected one of {BOUNDARIES}, got {name!r}")
    return _BY_NAME[name]


class StaticOutputs:
    """The static attention-output buffers of the copy boundaries, owned by one model.

    per_size  every layer keeps one [T, H, kv_lora] buffer per token count T it has run: the profile run, the
              graph-memory estimate's captures and every captured size each leave one per layer, for the
              process's lifetime (what the start-up memory experiment measures)
    shared    one [max_tokens, H, kv_lora] buffer for every layer, reserved before memory profiling so that the
              KV-cache budget sees it
    Other boundaries hold none."""

    def __init__(self, boundary: Boundary, heads: int, kv_lora: int):
        self.boundary, self.heads, self.kv_lora = boundary, heads, kv_lora
        self.per_size: dict[tuple[int, int], torch.Tensor] = {}  # (layer, T) -> [T, H, kv_lora]
        self.shared: torch.Tensor | None = None

    def reserve(self, max_tokens: int, like: torch.Tensor) -> None:
        """The shared buffer for steps of up to max_tokens rows (shared boundary only)."""
        if self.boundary.output == "shared" and (self.shared is None or self.shared.shape[0] < max_tokens):
            self.shared = like.new_empty(max_tokens, self.heads, self.kv_lora)

    def target(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s buffer for a step of like.shape[0] rows: [T, H, kv_lora]."""
        T = like.shape[0]
        if self.boundary.output == "shared":
            if self.shared is None or self.shared.shape[0] < T:
                have = None if self.shared is None else list(self.shared.shape)
                raise ValueError(f"narrow_copy_shared: the shared copy buffer holds {have} but a step of {T} tokens "
                                 f"needs [{T}, {self.heads}, {self.kv_lora}]; reserve it for the largest step first")
            return self.shared[:T]
        buf = self.per_size.get((layer, T))
        if buf is None:  # kept from now on: one per layer and token count
            buf = self.per_size[layer, T] = like.new_empty(T, self.heads, self.kv_lora)
        return buf

    def nbytes(self) -> int:
        bufs = list(self.per_size.values()) + ([self.shared] if self.shared is not None else [])
        return sum(t.numel() * t.element_size() for t in bufs)

    def release(self) -> int:
        """Drop the per-size buffers (after a failed capture); returns the bytes released. The shared buffer
        stays: it was budgeted before the KV cache."""
        before = self.nbytes()
        self.per_size.clear()
        return before - self.nbytes()
