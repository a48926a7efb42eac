"""dsv32ref: a readable reference of DeepSeek-V3.2 / GLM-5.x sparse MLA (DSA) for inference engineers.

Rooms, with one-way imports (experiments -> engine -> graphs / kernels / reference -> config):
    config, hf_config   ModelConfig, presets (and the experiments' reduced-MoE one), config.json parsing
    cache               paged latent / indexer-key caches and AttentionMetadata
    reference/          the PyTorch specification (norms, RoPE, indexer, sparse MLA, MoE, model)
    checkpoint          HF safetensors loading (fp8 blocks), saving, dummy weights
    testing             the comparator and paged inputs for kernel authors
    kernels/            Triton (and sm_90 Gluon) kernels of the sparse path, each behind a checking launcher
    graphs/             breakable CUDA graphs, the graph runner, a CPU stand-in that records and replays
    engine/             the serving engine, one file per job (see dsv32ref.engine)
    experiments/        the PR's protocol and what it measures (TTFT, ledgers, capture memory, regimes)
    bench/              the kernel benchmark
"""

from dsv32ref.cache import AttentionMetadata, BlockAllocator, PagedKVCache
from dsv32ref.checkpoint import init_dummy_weights, load_pretrained, save_pretrained
from dsv32ref.config import PRESETS, ModelConfig
from dsv32ref.reference.model import DeepseekV32ForCausalLM

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata", "BlockAllocator", "DeepseekV32ForCausalLM", "ModelConfig", "PRESETS",
    "PagedKVCache", "init_dummy_weights", "load_pretrained", "save_pretrained",
]
