"""Bookkeeping of the copy variants' static attention-output buffers (narrow_copy: one per layer and token
count; narrow_copy_shared: one for every layer): reserve, measure, release. The start-up memory experiment
reads them; the forward only indexes them."""

from __future__ import annotations

import torch

from dsv32ref.engine.model import EngineModel

__all__ = ["release_static_buffers", "reserve_copy_buffer", "static_buffer_bytes"]


def reserve_copy_buffer(model: EngineModel, max_tokens: int) -> torch.Tensor:
    """narrow_copy_shared: one [max_tokens, H, kv_lora] buffer, handed to every layer (allocated once, before
    the engine's memory profiling, so the KV-cache budget sees it)."""
    a = model.layers[0].self_attn
    buf = a.shared_out
    if buf is None or buf.shape[0] < max_tokens:
        buf = model.embed_tokens.new_empty(max_tokens, a.H, a.kv_lora)
    for layer in model.layers:
        layer.self_attn.shared_out = buf
    return buf

def release_static_buffers(model: EngineModel, include_shared: bool = False) -> int:
    """Drop narrow_copy's per-size static buffers (after a failed capture, or between experiments), and the
    shared buffer too if asked; returns the bytes released."""
    before = static_buffer_bytes(model)
    for layer in model.layers:
        layer.self_attn.static_out.clear()
        if include_shared:
            layer.self_attn.shared_out = None
    return before - static_buffer_bytes(model)

def static_buffer_bytes(model: EngineModel) -> int:
    """Bytes the copy variants' static buffers hold now (each shared buffer counted once)."""
    seen: dict[int, int] = {}
    for layer in model.layers:
        a = layer.self_attn
        for t in list(a.static_out.values()) + ([a.shared_out] if a.shared_out is not None else []):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
