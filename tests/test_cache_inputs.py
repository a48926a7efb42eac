import pytest
import torch

from dsv32ref import AttentionMetadata, BlockAllocator, PagedKVCache
from dsv32ref.cache import gather_tokens, write_tokens
from dsv32ref.config import ModelConfig
from helpers import tiny_model


def test_metadata_slots_and_positions():
    meta = AttentionMetadata.build([5, 0], [2, 3], [[7, 2], [4]], block_size=4)
    assert meta.positions.tolist() == [5, 6, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 16, 17, 18]
    assert meta.query_start_loc.tolist() == [0, 2, 5] and meta.seq_lens.tolist() == [7, 3]
    assert meta.block_table.tolist() == [[7, 2], [4, -1]]
    assert meta.query_start_loc.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.context_lens() == [5, 0] and meta.query_lens() == [2, 3] and meta.num_tokens == 5


def test_metadata_errors():
    with pytest.raises(ValueError, match="block_tables\\[0\\] has 1 blocks of 4 for 6 tokens"):
        AttentionMetadata.build([3], [3], [[0]], 4)
    with pytest.raises(ValueError, match="request 1: context_len 0 must be >= 0 and query_len 0 >= 1"):
        AttentionMetadata.build([0, 0], [1, 0], [[0], [1]], 4)
    with pytest.raises(ValueError, match="must have one equal, non-zero length"):
        AttentionMetadata.build([0], [1, 2], [[0]], 4)


def test_allocator_grows_releases_and_runs_out():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    assert alloc.ensure(0, 5) == [0, 1]
    assert alloc.ensure(1, 4) == [2]
    assert alloc.ensure(0, 8) == [0, 1]  # no growth needed
    with pytest.raises(ValueError, match="BlockAllocator: num_tokens: sequence 1 needs 2 more blocks, 1 free"):
        alloc.ensure(1, 12)
    alloc.release(0)
    assert alloc.ensure(1, 12) == [2, 0, 1]


def test_a_second_release_frees_nothing():
    """Releasing a sequence twice (a finished request released again) returns its blocks once: they are not handed
    out twice."""
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.ensure(0, 8)
    alloc.release(0)
    alloc.release(0)
    assert len(alloc.free) == 4 and 0 not in alloc.tables and 0 not in alloc.held
    assert sorted(alloc.ensure(1, 16)) == [0, 1, 2, 3]


def test_write_then_gather_round_trip(seed):
    cache = torch.zeros(5, 4, 3)
    meta = AttentionMetadata.build([0], [10], [[4, 0, 3]], 4)
    rows = torch.randn(10, 3)
    write_tokens(cache, meta.slot_mapping, rows)
    assert torch.equal(gather_tokens(cache, meta.block_table[0], 10), rows)
    assert torch.equal(cache[4].reshape(-1, 3), rows[:4])
    with pytest.raises(ValueError, match=r"slot_mapping: slots must lie in \[0, 20\), got \[0, 25\]"):
        write_tokens(cache, torch.tensor([0, 25]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"rows: expected shape \[2, 3\], got \[2, 4\]"):
        write_tokens(cache, torch.tensor([0, 1]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="reads blocks outside \\[0, 5\\)"):
        gather_tokens(cache, torch.tensor([0, -1], dtype=torch.int32), 6)
    shared = torch.zeros(1, 1, 3).expand(2, 2, 3)  # four slots, one row of memory: slot 0 would read slot 3's row
    with pytest.raises(ValueError, match=r"write_tokens: cache has elements that share memory \(shape \[2, 2, 3\]"):
        write_tokens(shared, torch.tensor([0, 3]), torch.randn(2, 3))


def test_cache_layout_and_size():
    c = ModelConfig.preset("tiny-glm-5.2")
    cache = PagedKVCache(c, num_blocks=3, block_size=16, dtype=torch.bfloat16)
    assert cache.latent[0].shape == (3, 16, c.kv_lora_rank + c.qk_rope_head_dim)
    assert cache.indexer_k[0].shape == (3, 16, c.index_head_dim) and cache.indexer_k[2] is None
    assert cache.nbytes() == 2 * 3 * 16 * (8 * 40 + 5 * 16)
    with pytest.raises(ValueError, match="PagedKVCache: num_blocks: expected >= 1, got 0"):
        PagedKVCache(c, 0, 16)


def test_model_rejects_bad_input_ids():
    model = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"input_ids: expected shape \[\*\], got \[1, 4\]"):
        model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids: expected dtype torch.int64 or torch.int32, got torch.float32"):
        model(torch.zeros(4))
    with pytest.raises(ValueError, match=r"input_ids: token ids must lie in \[0, 256\), got \[0, 256\]"):
        model(torch.tensor([0, 256]))
    with pytest.raises(ValueError, match="input_ids: expected device cpu, got meta"):
        model(torch.zeros(3, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="expected at least one token"):
        model(torch.zeros(0, dtype=torch.long))
    meta = AttentionMetadata.build([0], [3], [[0]], 4)
    with pytest.raises(ValueError, match="attn_metadata describes 3 tokens, got 2"):
        model(torch.zeros(2, dtype=torch.long), model.new_cache(1, 4), meta)
    with pytest.raises(ValueError, match="pass both or neither"):
        model(torch.zeros(3, dtype=torch.long), attn_metadata=meta)
    with pytest.raises(ValueError, match="form: expected"):
        model.set_form("flash")
