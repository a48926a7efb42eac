"""The PR's protocol as every experiment runs it: one request of a few tokens at a time on the reduced-MoE
model (dsv32ref.config.reduced_moe), each boundary on its own engine over one copy of the weights.

An arm is a boundary, or a boundary with an EngineConfig switch: "narrow+skip" is narrow with the short-prefill
top-k skip on, "narrow+fp8" narrow with the FP8 KV cache (FlashMLA's latent rows, DeepGEMM's indexer keys),
"none+fused" none with the fused MoE, "none+skinny" none with its projections in skinny_gemm; switches chain:
"none+fused+skinny" is none with both.
"""

from __future__ import annotations

import statistics

import torch

from dsv32ref.checks import shown
from dsv32ref.engine import BOUNDARIES, EngineConfig
from dsv32ref.graphs import CUDAGraphMode

__all__ = ["ARMS", "MAX_MODEL_LEN", "arm", "engine_config", "numerics", "prompts", "stats"]

MAX_MODEL_LEN = 512  # the protocol's sequences: a prompt and its first token fit

# `<boundary>+<arm>`: EngineConfig switches
ARMS = {"skip": {"skip_short_topk": True}, "fp8": {"kv_cache_dtype": "fp8"}, "fused": {"moe": "fused"},
        "skinny": {"gemm": "skinny"}}


def engine_config(boundary: str, capture_sizes=(1, 2, 4, 8, 16), mode: str = "full_and_piecewise", seed: int = 0,
                  **switches) -> EngineConfig:
    """The engine of the PR's protocol: sequences of up to 512 tokens, 16 at a time, steps of up to 16 tokens (or
    the largest capture size, past 16)."""
    return EngineConfig(boundary=boundary, mode=CUDAGraphMode(mode), max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                        max_num_batched_tokens=max(16, *capture_sizes), capture_sizes=list(capture_sizes), seed=seed,
                        **switches)


def arm(name: str) -> tuple[str, str, dict]:
    """"narrow" -> ("narrow", "narrow", {}); "narrow+skip" -> ("narrow+skip", "narrow", {"skip_short_topk": True});
    "none+fused+skinny" -> ("none+fused+skinny", "none", {"moe": "fused", "gemm": "skinny"}): each arm's switches."""
    if not isinstance(name, str):
        raise ValueError(f"arm: expected a name such as 'none+fused', got {type(name).__name__} {shown(name)}")
    boundary, *kinds = name.split("+")
    if boundary not in BOUNDARIES or any(k not in ARMS for k in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"arm {name!r}: expected <boundary> or <boundary>+<arm>[+<arm> ...], boundary one of "
                         f"{BOUNDARIES}, each arm once, one of {sorted(ARMS)}")
    return name, boundary, {key: v for k in kinds for key, v in ARMS[k].items()}


def numerics(name: str) -> str:
    """The arm's tail of switches that change how it rounds, in ARMS' order: "+fused+skinny" of "none+fused+skinny"
    and of "none+skinny+fused", "" of a boundary and of its +skip arm (and +ranges: the instrument on), which round
    as the boundary does."""
    base = name[:-len("+ranges")] if isinstance(name, str) and name.endswith("+ranges") else name  # instrument on
    try:
        arm(base)  # a ValueError unless it names a boundary and known switches
    except ValueError as e:
        raise ValueError(f"numerics({name!r:.60}): {e}") from None
    kinds = set(base.split("+")[1:])
    return "".join(f"+{k}" for k in ARMS if k in kinds and k != "skip")


def prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    """n random prompts of `length` tokens, the same for every arm of a run."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=g).tolist()


def stats(ms: list[float]) -> dict:
    """Mean, median, p99, min, max of a list of milliseconds."""
    s = sorted(ms)
    return {"mean_ms": statistics.fmean(s), "median_ms": statistics.median(s),
            "p99_ms": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))], "min_ms": s[0], "max_ms": s[-1]}
