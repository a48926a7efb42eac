import contextlib
import random

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


def hadamard_butterflies_fp32(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> x H_n in fp32, summed pair by pair, (i, i + h) for h = 1, 2, 4, ..., then times n^-1/2 as fp32
    holds it: the fp32 operations of the kernels' Hadamard rotation in the same order, so the same bits."""
    n, lead = x.shape[-1], x.shape[:-1]
    y, h = x.float(), 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)  # (..., blocks, 2, h): a = the first half of each block
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2).reshape(*lead, n)
        h *= 2
    return y * torch.tensor(n ** -0.5)


@contextlib.contextmanager
def programs_in_random_order(seed: int):
    """Under the interpreter, each launch inside runs its programs in a random order (seeded), not the interpreter's
    nested loops over the grid: a kernel whose programs hand work to each other (a last-arrival reduction) is then
    tested with programs of other tiles, batches and splits between its own."""
    from triton.runtime import interpreter

    builder, rng, order = interpreter.interpreter_builder, random.Random(seed), []
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx

    def grid_dim(nx, ny, nz):
        order[:] = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        rng.shuffle(order)
        set_dim(nx, ny, nz)

    builder.set_grid_dim, builder.set_grid_idx = grid_dim, lambda x, y, z: set_idx(*order.pop())
    try:
        yield
    finally:
        builder.set_grid_dim, builder.set_grid_idx = set_dim, set_idx


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
