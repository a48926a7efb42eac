import torch

from dsv32ref.checks import rel_err  # noqa: F401  (re-exported for the tests)

from dsv32ref import AttentionMetadata, BlockAllocator, DeepseekV32ForCausalLM, ModelConfig, init_dummy_weights


def tiny_model(preset: str, dtype=torch.float64, seed: int = 0, **changes) -> DeepseekV32ForCausalLM:
    config = ModelConfig.preset(preset)
    if changes:
        config = config.replace(**changes)
    model = DeepseekV32ForCausalLM(config).to(dtype)
    init_dummy_weights(model, seed)
    return model.eval()




class Runner:
    """Drives a model through steps of a paged batch: each step maps seq id -> tokens to append."""

    def __init__(self, model, num_blocks=64, block_size=4):
        self.model = model
        self.cache = model.new_cache(num_blocks, block_size)
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, torch.Tensor], topk_out=None) -> dict[int, torch.Tensor]:
        ids, ctx, qlens, tables = [], [], [], []
        for sid, toks in new_tokens.items():
            c = self.lens.get(sid, 0)
            tables.append(list(self.alloc.ensure(sid, c + len(toks))))
            ctx.append(c)
            qlens.append(len(toks))
            ids.append(toks)
            self.lens[sid] = c + len(toks)
        meta = AttentionMetadata.build(ctx, qlens, tables, self.alloc.block_size)
        with torch.no_grad():
            logits = self.model(torch.cat(ids), self.cache, meta, topk_out=topk_out)
        out, start = {}, 0
        for sid, n in zip(new_tokens, qlens):
            out[sid] = logits[start: start + n]
            start += n
        return out
