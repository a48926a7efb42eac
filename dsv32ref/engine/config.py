"""EngineConfig: the serving engine's settings, validated once, with the sizes derived from them."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from dsv32ref.cache import KV_CACHE_DTYPES
from dsv32ref.checks import MAX_SEED, check_device, check_int, is_int
from dsv32ref.engine.boundary import Boundary, get_boundary
from dsv32ref.graphs.runner import CUDAGraphMode, default_capture_sizes

__all__ = ["DTYPES", "EngineConfig", "GEMM_IMPLS", "MOE_IMPLS", "check_placement"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the activations and weights the engine runs in
MOE_IMPLS = ("dense", "fused")  # EngineConfig.moe
GEMM_IMPLS = ("torch", "skinny")  # EngineConfig.gemm
MAX_BLOCK_SIZE = 2 ** 16  # tokens a cache block (FlashMLA's are 64; a larger one is a whole cache in a block)


def check_placement(who: str, device, dtype) -> torch.device:
    """A cpu or cuda device (a torch.device or its name) and one of DTYPES, where the engine runs -> the device."""
    dev = check_device(f"{who}: device", device)
    if dtype not in DTYPES:
        raise ValueError(f"{who}: dtype: expected one of {', '.join(map(str, DTYPES))}, got {dtype!r}")
    return dev


@dataclass(frozen=True)
class EngineConfig:
    boundary: str = "narrow"  # one of dsv32ref.engine.boundary.BOUNDARIES
    mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 64
    gpu_memory_utilization: float = 0.9
    capture_sizes: tuple[int, ...] | None = None  # (a list is taken) default: the engine's up to max_num_batched_tokens
    num_blocks: int | None = None  # None: sized from the memory budget (capped at what max_num_seqs can use)
    estimate_graph_memory: bool = True  # subtract the serving engine's graph-memory estimate from the KV budget
    seed: int = 0
    num_sms: int | None = None  # SMs sparse_mla's split-K, the indexer's grid, skinny_gemm's split-K and the MoE
    # router's logits fill (None: the device's; set it to predict a GPU's launches on a CPU)
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": FlashMLA's latent rows and DeepGEMM's
    # indexer keys (dsv32ref.cache), quantised on write, read by the kernels
    moe: str = "dense"  # how MoE layers run: "dense" (every local expert on every token, PyTorch ops) or "fused"
    # (dsv32ref.kernels.fused_moe: grouped GEMMs over the tokens each expert received, six launches a layer, five
    # at steps of at most 16 tokens)
    gemm: str = "torch"  # the projections of steps of at most 16 tokens (dsv32ref.engine.model.SKINNY_ROWS):
    # "torch" (F.linear, torch.bmm: cuBLAS) or "skinny" (dsv32ref.kernels.skinny_gemm: one launch a projection)
    skip_short_topk: bool = False  # a step whose requests all have <= index_topk keys skips the indexer's
    # scoring and selection (their result is known: every key); eager regions and graph-less steps only

    def __post_init__(self):  # (frozen: what was checked here stays as checked; dataclasses.replace re-checks)
        object.__setattr__(self, "spec", get_boundary(self.boundary))
        if not isinstance(self.mode, CUDAGraphMode):
            raise ValueError(f"EngineConfig.mode: expected a CUDAGraphMode (e.g. CUDAGraphMode("
                             f"'full_and_piecewise')), got {type(self.mode).__name__} {self.mode!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            check_int(f"EngineConfig.{name}", getattr(self, name), 1, 2 ** 31 - 1)  # (positions and slots: int32)
        check_int("EngineConfig.block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("EngineConfig.seed", self.seed, 0, MAX_SEED)
        for name in ("num_blocks", "num_sms"):
            if getattr(self, name) is not None:
                check_int(f"EngineConfig.{name}", getattr(self, name))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.moe not in MOE_IMPLS:
            raise ValueError(f"EngineConfig.moe: expected one of {MOE_IMPLS}, got {self.moe!r}")
        if self.gemm not in GEMM_IMPLS:
            raise ValueError(f"EngineConfig.gemm: expected one of {GEMM_IMPLS}, got {self.gemm!r}")
        for name in ("skip_short_topk", "estimate_graph_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization: expected (0, 1], got {u!r}")
        object.__setattr__(self, "capture_sizes", check_capture_sizes(self.capture_sizes, self.max_num_batched_tokens))
        if self.num_blocks is not None and self.num_blocks < self.max_blocks_per_seq:
            raise ValueError(f"EngineConfig.num_blocks: {self.num_blocks} blocks of {self.block_size} tokens cannot hold "
                             f"one sequence of max_model_len {self.max_model_len} ({self.max_blocks_per_seq} blocks)")
        if self.max_step_tokens > self.max_num_seqs * self.max_model_len:
            raise ValueError(f"max_num_batched_tokens / capture sizes: at most max_num_seqs x max_model_len = "
                             f"{self.max_num_seqs * self.max_model_len} tokens fit in one step, got "
                             f"{self.max_step_tokens}")

    @property
    def max_step_tokens(self) -> int:
        """Rows of the static buffers: the largest step, or the largest captured size if that is larger."""
        return max((*self.capture_sizes, self.max_num_batched_tokens))

    @property
    def scores_rows(self) -> int:
        """Rows of the graph-safe indexer's workspace: every row of a step where the boundary has no eager
        region, else the padded decode rows. Its bytes: scores_rows x max_model_len x 4."""
        return self.max_step_tokens if self.spec.graph_safe_prefill else self.max_decode_rows

    @property
    def max_decode_rows(self) -> int:
        """Rows a uniform-decode step can have once padded: max_num_seqs tokens, padded to the next capture
        size (which may be a PIECEWISE-only size past max_num_seqs)."""
        i = bisect.bisect_left(self.capture_sizes, self.max_num_seqs)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else self.max_num_seqs

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def check_capture_sizes(sizes, max_num_batched_tokens: int, who: str = "EngineConfig") -> tuple[int, ...]:
    """Capture sizes as the engine takes them: None for the defaults up to max_num_batched_tokens, else a list of
    ints >= 1 (sorted, each once); else a ValueError naming `who`'s capture_sizes."""
    if sizes is None:
        return tuple(default_capture_sizes(max_num_batched_tokens))
    if not isinstance(sizes, (list, tuple)):
        raise ValueError(f"{who}.capture_sizes: expected a list of ints, got {sizes!r}")
    for s in sizes:
        if not is_int(s) or s < 1:
            raise ValueError(f"{who}.capture_sizes: every size must be an int >= 1, got {s!r} in {list(sizes)}")
    return tuple(sorted(set(sizes)))
