"""dsv32ref: a readable reference of DeepSeek-V3.2 / GLM-5.x sparse MLA (DSA) for inference engineers.

Rooms, with one-way imports (experiments -> engine -> graphs/kernels/reference):
    config, hf_config   ModelConfig, presets, config.json parsing
    cache               paged latent / indexer-key caches and AttentionMetadata
    reference/          the PyTorch specification (norms, RoPE, indexer, sparse MLA, MoE, model)
    checkpoint          HF safetensors loading (fp8 blocks), saving, dummy weights
    kernels/            Triton kernels of the sparse path (graph-safe launchers); bench/ measures them
    graphs/             breakable CUDA graphs, the graph runner, a CPU stand-in that records and replays
    engine/             the engine-form model with its eager boundaries, a small engine, the launch ledger
    experiments/        TTFT and ledger experiments; parallel: N ranks through torch.distributed
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
