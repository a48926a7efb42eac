"""Capture memory of each eager boundary, in plain arithmetic (runs on a CPU).

What the start-up leaves allocated after FULL_AND_PIECEWISE capture, beyond the weights and the KV cache:

    static copy buffers  narrow_copy: every layer keeps one [T, H, kv_lora] buffer per token count T it has
                         run: the profile run (max_num_batched_tokens), the estimate's captures and every
                         captured size (FULL sizes are a subset of the PIECEWISE ones, so FULL adds none);
                         narrow_copy_shared: one [max size, H, kv_lora] buffer for all layers; others: none
    graph outputs        the runner keeps each captured graph's output [T, hidden]: one per size and phase
    retained             the two together: what stays allocated once capture is over

and, walking capture in order, where narrow_copy runs out (capture_outcome) and the threshold (threshold),
from what `narrow` costs at the same settings (measured) plus the static buffers of every new size.
The serving engine's graph-memory estimate is not modelled: it samples two captures per mode and what
they measure depends on the allocator's cached blocks (notebook 05 shows one sample of 0 bytes).

Every figure is bytes; the allocator rounds blocks to 512 B, which these shapes already are.
"""

from __future__ import annotations

from dsv32ref.checks import check_int
from dsv32ref.config import ModelConfig
from dsv32ref.engine import BOUNDARIES
from dsv32ref.engine.config import check_capture_sizes
from dsv32ref.graphs.runner import CUDAGraphMode, default_capture_sizes
from dsv32ref.graphs.runner import phase_sizes as _runner_phase_sizes


def _check(who: str, boundary: str, max_num_seqs: int, max_num_batched_tokens: int, dtype_bytes: int,
           capture_sizes=None) -> list[int]:
    """The settings the models take, refused by name where the engine would refuse them (a misspelt boundary
    modelled as one without copy buffers, negative sizes as negative bytes); returns the capture sizes."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"{who}: boundary: expected one of {', '.join(BOUNDARIES)}, got {boundary!r}")
    for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("dtype_bytes", dtype_bytes)):
        check_int(f"{who}: {name}", v)
    sizes = list(check_capture_sizes(capture_sizes, max_num_batched_tokens, who))
    if not sizes:
        raise ValueError(f"{who}.capture_sizes: expected at least one size (None: the defaults), got []")
    return sizes


def phase_sizes(capture_sizes: list[int], max_num_seqs: int) -> dict[str, list[int]]:
    """The engine's capture order under FULL_AND_PIECEWISE (the runner's own phase_sizes), as a dict."""
    return dict(_runner_phase_sizes(CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes, max_num_seqs))


def copy_buffer_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """One layer's attention output in the latent space, one token: H x kv_lora."""
    return config.num_attention_heads * config.kv_lora_rank * dtype_bytes


def predict(config: ModelConfig, boundary: str, capture_sizes: list[int] | None = None, max_num_seqs: int = 256,
            max_num_batched_tokens: int = 512, dtype_bytes: int = 2, estimate: bool = True) -> dict:
    """Retained bytes after start-up (static copy buffers + graph outputs), and the static buffers that exist
    before the KV cache is sized (profile run and estimate), for one boundary."""
    sizes = _check("predict", boundary, max_num_seqs, max_num_batched_tokens, dtype_bytes, capture_sizes)
    ph = phase_sizes(sizes, max_num_seqs)
    per_tok = copy_buffer_bytes_per_token(config, dtype_bytes)
    L = config.num_hidden_layers
    n_max = max(sizes + [max_num_batched_tokens])
    before_kv_sizes = {max_num_batched_tokens}
    if estimate:
        for s in ph.values():
            before_kv_sizes.update(s[:2])
    if boundary == "narrow_copy":
        all_sizes = set(ph["PIECEWISE"]) | set(ph["FULL"]) | before_kv_sizes
        static = L * per_tok * sum(all_sizes)
        static_before_kv = L * per_tok * sum(before_kv_sizes)
    elif boundary == "narrow_copy_shared":
        static = static_before_kv = per_tok * n_max
    else:
        static = static_before_kv = 0
    outputs = sum(sum(s) for s in ph.values()) * config.hidden_size * dtype_bytes
    return {"boundary": boundary, "static_buffers": static, "static_before_kv_sizing": static_before_kv,
            "graph_outputs": outputs, "retained": static + outputs,
            "retained_by_capture": static - static_before_kv + outputs,
            "sizes": {k: len(v) for k, v in ph.items()}, "copy_bytes_per_token_layer": per_tok}


def capture_outcome(config: ModelConfig, available: int, piecewise_overhead: int, full_overhead: int,
                    boundary: str = "narrow_copy", max_num_batched_tokens: int = 512, max_num_seqs: int = 256,
                    made_before: set[int] | None = None, dtype_bytes: int = 2) -> dict:
    """Walk start-up capture in order and say where it runs out.

    available: device memory capture can use (free + the allocator's cached free blocks) when it starts;
    piecewise_overhead / full_overhead: what each phase costs `narrow` at the same settings (pool growth,
    graph outputs, graph objects), measured; each new token count then adds narrow_copy's static buffers,
    L x T x H x kv_lora x 2 bytes, for every size not already made (`made_before`: sizes the profile run and
    the estimate created). Returns the failing (phase, size) or None, and the memory left or missing."""
    sizes = _check("capture_outcome", boundary, max_num_seqs, max_num_batched_tokens, dtype_bytes)
    made = set(made_before or {max_num_batched_tokens})
    per = config.num_hidden_layers * copy_buffer_bytes_per_token(config, dtype_bytes) if boundary == "narrow_copy" else 0
    used = 0
    for phase, phase_list in phase_sizes(sizes, max_num_seqs).items():
        used += piecewise_overhead if phase == "PIECEWISE" else full_overhead
        for size in phase_list:
            if size not in made:
                made.add(size)
                used += size * per
            if used > available:
                return {"fails_at": (phase, size), "short_by": used - available}
    return {"fails_at": None, "left": available - used}


def threshold(config: ModelConfig, available: int, piecewise_overhead: int, full_overhead: int, total: int,
              util: float, max_num_seqs: int = 256) -> dict:
    """Where narrow_copy (estimate off) stops starting, from capture_outcome: the largest max_num_batched_tokens
    (default size lists) that still fits `available`, and the gpu_memory_utilization at which sizes up to 512
    just fit (each 0.01 of utilisation moves 0.01 x total between the KV cache and capture)."""
    check_int("threshold: total", total)
    ok = [m for m in default_capture_sizes(512) if m >= 8 and capture_outcome(
        config, available, piecewise_overhead, full_overhead, max_num_batched_tokens=m,
        max_num_seqs=max_num_seqs)["fails_at"] is None]
    o = capture_outcome(config, available, piecewise_overhead, full_overhead, max_num_seqs=max_num_seqs)
    margin = o["left"] if o["fails_at"] is None else -o["short_by"]
    return {"max_tokens_ok": max(ok) if ok else None, "utilization_at_512": util + margin / total,
            "fails_at": o["fails_at"], "margin": margin}
