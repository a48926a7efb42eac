"""Paged caches and the per-step metadata that addresses them (vLLM's names).

Layout, per layer:
    latent cache     [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]   rows [c_kv | k_pe]
    indexer-key cache [num_blocks, block_size, index_head_dim]                   only "full" indexer layers
or, with kv_cache_dtype "fp8", bytes in the layouts deployed engines keep (dsv32ref.reference.fp8_cache):
    latent cache     uint8 [num_blocks, block_size, 656]   FlashMLA's rows: fp8 c_kv, 4 fp32 scales, bf16 k_pe
    indexer-key cache uint8 [num_blocks, block_size, index_head_dim + 4]   DeepGEMM's blocks: a block's fp8 keys
                                                            token by token, then its fp32 scales

A sequence owns a list of blocks (its row of `block_table`); its token at position p lives in slot
block_table[b, p // block_size] * block_size + p % block_size. A step writes its new tokens through
`slot_mapping` [T] and reads a sequence's first seq_lens[b] tokens back through its block-table row.

Top-k indices are *logical token positions* within the query's own sequence (0..seq_len-1, -1 = none):
the kernel, not the indexer, translates them through the block table.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, fields

import torch

from dsv32ref.checks import check_device, check_disjoint, check_fits, check_int, check_slots, check_tensor, is_int
from dsv32ref.config import ModelConfig

__all__ = ["AttentionMetadata", "BlockAllocator", "KV_CACHE_DTYPES", "LATENT_ROW_BYTES", "PagedKVCache", "StepPlan",
           "check_cache_fits", "check_kv_cache_dtype", "gather_tokens", "indexer_key_bytes", "token_bytes"]


@dataclass
class AttentionMetadata:
    """Everything one forward step needs to find its tokens in the paged caches.

    Requests are packed back to back: request b's query tokens are rows
    query_start_loc[b] : query_start_loc[b+1] of the flattened [T, ...] activations.

    Device tensors (what kernels read):
        positions       int64 [T]           position of each query token in its sequence
        slot_mapping    int64 [T]           cache slot each new token is written to
        query_start_loc int32 [B + 1]
        seq_lens        int32 [B]           tokens in the cache after this step (context + new)
        block_table     int32 [B, max_blocks_per_seq]  (unused entries -1)
        req_indices     int32 [T]           request of each query token (lets kernels stay graph-safe)
    Host copies (what host-side code branches on): query_start_loc_cpu, seq_lens_cpu (lists).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    req_indices: torch.Tensor
    block_size: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def query_lens(self) -> list[int]:
        q = self.query_start_loc_cpu
        return [q[i + 1] - q[i] for i in range(self.num_reqs)]

    def context_lens(self) -> list[int]:
        return [s - n for s, n in zip(self.seq_lens_cpu, self.query_lens())]

    @classmethod
    def build(
        cls,
        context_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        num_blocks: int | None = None,
    ) -> "AttentionMetadata":
        """Metadata for B requests, request b adding query_lens[b] tokens after context_lens[b] cached ones
        (StepPlan.build checks and computes it; this puts it in tensors)."""
        device = check_device("AttentionMetadata: device", device)
        return cls._on(StepPlan.build(context_lens, query_lens, block_tables, block_size, num_blocks), device)

    @classmethod
    def from_plan(cls, plan: "StepPlan", device: torch.device | str = "cpu") -> "AttentionMetadata":
        """The plan in tensors on `device`: a plan StepPlan.build made, or one equal to what it makes of the
        plan's own lengths and block tables (a hand-made plan whose slots or positions disagree is refused)."""
        device = check_device("AttentionMetadata: device", device)
        _check_plan(plan)
        return cls._on(plan, device)

    def check(self, name: str = "attn_metadata") -> None:
        """ValueError unless these tensors hold what StepPlan.build makes of their lengths and block tables (a
        metadata edited after it was built, e.g. positions reversed or slots outside the request's blocks), naming
        the field. Reads the tensors back to the host: for references and tests, not the engine's hot path."""
        rows = self.block_table.tolist()
        for row in rows:
            while row and row[-1] == -1:  # the padding of shorter rows
                row.pop()
        host = {"query_start_loc": self.query_start_loc_cpu, "seq_lens": self.seq_lens_cpu}
        for field, values in host.items():
            if getattr(self, field).tolist() != list(values):
                raise ValueError(f"{name}: {field} and {field}_cpu differ")
        _check_plan(StepPlan(self.positions.tolist(), self.slot_mapping.tolist(), self.query_start_loc.tolist(),
                             self.seq_lens.tolist(), rows, self.req_indices.tolist(), self.block_size), name)

    @classmethod
    def _on(cls, plan: "StepPlan", device: torch.device) -> "AttentionMetadata":
        width = max(len(bt) for bt in plan.block_tables)
        table = torch.tensor([bt + [-1] * (width - len(bt)) for bt in plan.block_tables], dtype=torch.int32)
        return cls(
            positions=torch.tensor(plan.positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(plan.slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(plan.query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(plan.seq_lens, dtype=torch.int32, device=device),
            block_table=table.to(device),
            req_indices=torch.tensor(plan.req_indices, dtype=torch.int32, device=device),
            block_size=plan.block_size,
            query_start_loc_cpu=plan.query_start_loc,
            seq_lens_cpu=plan.seq_lens,
        )


@dataclass
class StepPlan:
    """AttentionMetadata's content as host lists, checked: what an engine writes straight into its pinned
    staging buffers (no tensor is made on the host). Same names, without the _cpu suffix: all of it is host."""

    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    req_indices: list[int]
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(self.num_reqs)]

    @classmethod
    def build(cls, context_lens: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int,
              num_blocks: int | None = None) -> "StepPlan":
        """B requests, request b adding query_lens[b] tokens after context_lens[b] cached ones.

        Block ids are ints in [0, num_blocks) (when num_blocks is given), and no block appears twice in a step,
        in two requests or twice in one (their tokens would overwrite each other)."""
        if not is_int(block_size) or block_size < 1:
            raise ValueError(f"AttentionMetadata.build: block_size must be an int >= 1, got {block_size!r}")
        if num_blocks is not None and (not is_int(num_blocks) or num_blocks < 1):
            raise ValueError(f"AttentionMetadata.build: num_blocks must be None or an int >= 1, got {num_blocks!r}")
        for name, v in (("context_lens", context_lens), ("query_lens", query_lens), ("block_tables", block_tables)):
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"AttentionMetadata.build: {name} must be a list, got {type(v).__name__}")
        if any(not isinstance(bt, (list, tuple)) for bt in block_tables):
            raise ValueError("AttentionMetadata.build: block_tables must be a list of lists of block ids")
        if not (len(context_lens) == len(query_lens) == len(block_tables)) or not query_lens:
            raise ValueError(
                f"AttentionMetadata.build: context_lens ({len(context_lens)}), query_lens ({len(query_lens)}) "
                f"and block_tables ({len(block_tables)}) must have one equal, non-zero length"
            )
        positions, slots, qsl, reqs = [], [], [0], []
        owner: dict[int, int] = {}
        for b, (ctx, n, blocks) in enumerate(zip(context_lens, query_lens, block_tables)):
            for name, v in (("context_lens", ctx), ("query_lens", n)):
                if not is_int(v):
                    raise ValueError(f"AttentionMetadata.build: {name}[{b}] must be an int, got {type(v).__name__} {v!r}")
            if ctx < 0 or n < 1:
                raise ValueError(f"request {b}: context_len {ctx} must be >= 0 and query_len {n} >= 1")
            if ctx + n > MAX_BLOCKS:
                raise ValueError(f"request {b}: context_len + query_len must be at most {MAX_BLOCKS} (positions are "
                                 f"int32 in the kernels), got {ctx + n}")
            for blk in blocks:
                if not is_int(blk) or blk < 0 or blk >= (MAX_BLOCKS if num_blocks is None else num_blocks):
                    bound = f"[0, {num_blocks})" if num_blocks is not None else f"in [0, {MAX_BLOCKS})"
                    raise ValueError(f"block_tables[{b}]: block ids must be ints {bound}, got {blk!r}")
                if owner.setdefault(blk, b) != b:
                    raise ValueError(f"block_tables[{b}]: block {blk} also belongs to request {owner[blk]} of this step")
            if len(set(blocks)) != len(blocks):
                twice = sorted(blk for blk, k in Counter(blocks).items() if k > 1)
                raise ValueError(f"block_tables[{b}]: blocks {twice} appear more than once (their tokens would "
                                 f"overwrite each other)")
            if blocks and (max(blocks) + 1) * block_size > MAX_BLOCKS:
                raise ValueError(f"block_tables[{b}]: block {max(blocks)} of {block_size} tokens needs "
                                 f"{(max(blocks) + 1) * block_size} slots, a cache holds at most {MAX_BLOCKS} (slot "
                                 f"ids are int32 in the kernels)")
            if len(blocks) * block_size < ctx + n:
                raise ValueError(
                    f"request {b}: block_tables[{b}] has {len(blocks)} blocks of {block_size} for "
                    f"{ctx + n} tokens"
                )
            if qsl[-1] + n > UNCHECKED_HOST_INTS:  # (fewer: any host holds them; an engine's steps stay below)
                check_fits("AttentionMetadata.build: the step's host lists (positions, slots, requests)",
                           3 * HOST_INT_BYTES * (qsl[-1] + n), _CPU)
            for p in range(ctx, ctx + n):
                positions.append(p)
                reqs.append(b)
                slots.append(blocks[p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + n)
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        return cls(positions, slots, qsl, seq_lens, [list(bt) for bt in block_tables], reqs, block_size)


def _check_plan(plan: StepPlan, name: str = "plan") -> None:
    """ValueError unless `plan` holds what StepPlan.build makes of its own lengths and block tables (lists or
    tuples alike), naming the first field and element that differ (as fields of `name`)."""
    if not isinstance(plan, StepPlan):
        raise ValueError(f"{name}: expected a StepPlan, got {type(plan).__name__}")
    try:
        lens = plan.query_lens()
        again = StepPlan.build([s - n for s, n in zip(plan.seq_lens, lens)], lens, plan.block_tables, plan.block_size)
    except (TypeError, IndexError, ValueError) as e:
        raise ValueError(f"{name}: its seq_lens, query_start_loc and block tables describe no step ({e})") from None
    for f in fields(plan):
        have, want = getattr(plan, f.name), getattr(again, f.name)
        if f.name == "block_tables":
            have = [list(bt) for bt in have]
        if f.name != "block_size":
            have = list(have)
        if have != want:
            i = next((i for i, (h, w) in enumerate(zip(have, want)) if h != w), min(len(have), len(want)))
            got, made = (v[i] if i < len(v) else "nothing" for v in (have, want))
            raise ValueError(f"{name}: {f.name}[{i}] is {got}, StepPlan.build makes {made} of its seq_lens, "
                             f"query_start_loc and block tables")


MAX_BLOCKS = 2 ** 31 - 1  # block ids are int32 in the block tables the kernels read
HOST_INT_BYTES = 40  # an int in a Python list: its 8-byte slot and (past 256) a 32-byte int object
UNCHECKED_HOST_INTS = 2 ** 20  # host lists up to this many ints are built unchecked (40 MiB at most)
_CPU = torch.device("cpu")


def _check_block_ids(name: str, num_blocks: int) -> None:
    if num_blocks > MAX_BLOCKS:
        raise ValueError(f"{name}: at most {MAX_BLOCKS} (block ids are int32), got {num_blocks}")


class _FreeBlocks:
    """The free block ids: those handed back (a stack), then the ones never handed out, counted rather than listed
    (a list of every id of a 2^31-block cache would not fit in memory). pop() hands out low ids first."""

    def __init__(self, num_blocks: int):
        self.returned: list[int] = []
        self.next, self.end = 0, num_blocks

    def __len__(self) -> int:
        return len(self.returned) + self.end - self.next

    def pop(self) -> int:
        if self.returned:
            return self.returned.pop()
        if self.next == self.end:
            raise IndexError("pop from an empty free list")
        self.next += 1
        return self.next - 1

    def extend(self, ids) -> None:
        self.returned.extend(ids)


class BlockAllocator:
    """A free list of cache blocks; each sequence id owns a growing list of block ids and a count of the tokens its
    cache rows hold (`held`: what the steps wrote, or what `assume` declared), which a step's context must equal."""

    def __init__(self, num_blocks: int, block_size: int):
        check_int("BlockAllocator: num_blocks", num_blocks)
        check_int("BlockAllocator: block_size", block_size)
        _check_block_ids("BlockAllocator: num_blocks", num_blocks)
        self.block_size = block_size
        self.free = _FreeBlocks(num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.held: dict[int, int] = {}

    def assume(self, seq_id: int, num_tokens: int) -> list[int]:
        """Blocks for sequence `seq_id`'s first num_tokens tokens, declared as held without a step writing them:
        the caller vouches for those rows (it wrote them itself, or times decode over the cache's values as they
        are). Returns its block list."""
        table = self.ensure(seq_id, num_tokens)
        self.held[seq_id] = max(self.held.get(seq_id, 0), num_tokens)
        return table

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """How many more blocks sequence `seq_id` needs to hold num_tokens tokens (0 if it has them)."""
        check_int("BlockAllocator: seq_id", seq_id, low=0)
        check_int("BlockAllocator: num_tokens", num_tokens, low=0)
        need = -(-num_tokens // self.block_size) - len(self.tables.get(seq_id, []))
        if need > MAX_BLOCKS:
            raise ValueError(f"BlockAllocator: num_tokens: {num_tokens} tokens need more blocks of "
                             f"{self.block_size} than a cache can have ({MAX_BLOCKS})")
        return max(need, 0)

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow sequence `seq_id` to hold num_tokens tokens; returns its block list."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self.free):  # (nothing changes: a sequence not yet known stays unknown)
            raise ValueError(f"BlockAllocator: num_tokens: sequence {seq_id} needs {need} more blocks, "
                             f"{len(self.free)} free")
        if need > UNCHECKED_HOST_INTS:
            check_fits(f"BlockAllocator: sequence {seq_id}'s list of {need} more blocks", HOST_INT_BYTES * need, _CPU)
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.free.pop() for _ in range(need))
        return table

    def state(self, seq_id: int) -> tuple[int | None, int]:
        """(tokens held, or None for a sequence not known; blocks owned): what `restore` brings it back to."""
        return self.held.get(seq_id), len(self.tables.get(seq_id, []))

    def restore(self, seq_id: int, state: tuple[int | None, int]) -> None:
        """Sequence `seq_id` back to an earlier `state(seq_id)`: the blocks it took since go back to the free list
        (undoing an assume whose step did not run). A sequence released since stays released."""
        held, num_blocks = state
        if seq_id not in self.tables:
            return
        table = self.tables[seq_id]
        self.free.extend(reversed(table[num_blocks:]))
        del table[num_blocks:]
        if held is None:
            self.tables.pop(seq_id, None)
            self.held.pop(seq_id, None)
        else:
            self.held[seq_id] = held

    def release(self, seq_id: int) -> None:
        """Return the sequence's blocks to the free list (a sequence that holds none: nothing to do)."""
        check_int("BlockAllocator.release: seq_id", seq_id, low=0)
        self.free.extend(reversed(self.tables.pop(seq_id, [])))
        self.held.pop(seq_id, None)


CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_LATENT_DIMS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) FlashMLA's FP8 rows hold
LATENT_ROW_BYTES = 512 + 4 * (512 // 128) + 2 * 64  # 656: fp8 c_kv, an fp32 scale per 128 values, bf16 k_pe
FP8_PARTS = ("latent", "indexer")  # what an "fp8" cache stores in FP8 (both, as deployed; one alone for studies)


def indexer_key_bytes(head_dim: int) -> int:
    """Bytes one token's key takes in the FP8 indexer cache: head_dim fp8 values and one fp32 scale (132 at 128)."""
    return check_int("indexer_key_bytes: head_dim", head_dim) + 4


def token_bytes(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """(latent row, indexer key) bytes of one token in one layer: "auto" stores both in `dtype`; "fp8" stores
    FlashMLA's latent rows (656 bytes) and DeepGEMM's keys (index_head_dim + 4: fp8 values and an fp32 scale)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"token_bytes: config: expected a ModelConfig, got {type(config).__name__}")
    check_kv_cache_dtype("token_bytes: kv_cache_dtype", kv_cache_dtype, config)
    if kv_cache_dtype == "fp8":
        return LATENT_ROW_BYTES, indexer_key_bytes(config.index_head_dim)
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"token_bytes: dtype: expected one of {CACHE_DTYPES}, got {dtype!r}")
    size = torch.finfo(dtype).bits // 8
    return config.latent_dim * size, config.index_head_dim * size


class PagedKVCache:
    """Per-layer latent and indexer-key caches. Shared (IndexShare) layers have no indexer cache.

    kv_cache_dtype "auto": both in `dtype`, [num_blocks, block_size, width]; "fp8": the layouts deployed engines
    keep (dsv32ref.reference.fp8_cache), uint8 [num_blocks, block_size, 656] latent rows (kv_lora_rank 512 and
    qk_rope_head_dim 64) and uint8 [num_blocks, block_size, index_head_dim + 4] key blocks; the kernels and the
    reference model read and write both. fp8_parts: which of the two "fp8" stores in FP8 (the other stays in
    `dtype`), to tell their errors apart; deployed engines store both."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", kv_cache_dtype: str = "auto",
                 fp8_parts: tuple[str, ...] = FP8_PARTS):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"PagedKVCache: config: expected a ModelConfig, got {type(config).__name__}")
        check_int("PagedKVCache: num_blocks", num_blocks)
        check_int("PagedKVCache: block_size", block_size)
        _check_block_ids("PagedKVCache: num_blocks", num_blocks)
        if num_blocks * block_size > MAX_BLOCKS:  # slot ids are int32 in the kernels, as block ids are
            raise ValueError(f"PagedKVCache: num_blocks x block_size: at most 2^31 - 1 slots (int32 slot ids), got "
                             f"{num_blocks} x {block_size}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"PagedKVCache: dtype: expected one of {CACHE_DTYPES}, got {dtype}")
        device = check_device("PagedKVCache: device", device)
        check_kv_cache_dtype("PagedKVCache: kv_cache_dtype", kv_cache_dtype, config)
        if (not isinstance(fp8_parts, tuple) or not fp8_parts or not all(isinstance(p, str) for p in fp8_parts)
                or not set(fp8_parts) <= set(FP8_PARTS)):
            raise ValueError(f"PagedKVCache: fp8_parts: expected a non-empty tuple of {FP8_PARTS}, got {fp8_parts!r}")
        if kv_cache_dtype != "fp8" and fp8_parts != FP8_PARTS:
            raise ValueError(f"PagedKVCache: fp8_parts {fp8_parts!r} needs kv_cache_dtype 'fp8', got {kv_cache_dtype!r}")
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        self.allocators: weakref.WeakSet = weakref.WeakSet()  # of the engines that run on this cache
        self.fp8_parts = tuple(p for p in FP8_PARTS if p in fp8_parts) if kv_cache_dtype == "fp8" else ()
        fp8_lat, fp8_idx = (kv_cache_dtype == "fp8" and part in fp8_parts for part in FP8_PARTS)
        d_i = config.index_head_dim
        if fp8_idx and (d_i > 128 or d_i & (d_i - 1)):
            raise ValueError(f"PagedKVCache: FP8 indexer keys take one scale per key and are rotated by a Hadamard "
                             f"transform: index_head_dim must be a power of two <= 128, got {d_i}")
        lat = (torch.uint8, LATENT_ROW_BYTES) if fp8_lat else (dtype, config.latent_dim)  # (store, width)
        idx = (torch.uint8, indexer_key_bytes(config.index_head_dim)) if fp8_idx else (dtype, config.index_head_dim)
        row_bytes = [lat[1] * lat[0].itemsize + (idx[1] * idx[0].itemsize if config.runs_indexer(i) else 0)
                     for i in range(config.num_hidden_layers)]
        check_fits("PagedKVCache", num_blocks * block_size * sum(row_bytes), device)
        self.latent = [torch.zeros(num_blocks, block_size, lat[1], dtype=lat[0], device=device)
                       for _ in range(config.num_hidden_layers)]
        self.indexer_k = [torch.zeros(num_blocks, block_size, idx[1], dtype=idx[0], device=device)
                          if config.runs_indexer(i) else None for i in range(config.num_hidden_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latent + self.indexer_k if t is not None)


def check_kv_cache_dtype(name: str, kv_cache_dtype, config: ModelConfig) -> None:
    """One of KV_CACHE_DTYPES; "fp8" only for the latent widths FlashMLA's rows hold (512 + 64)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"{name}: config: expected a ModelConfig, got {type(config).__name__}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{name}: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8" and (config.kv_lora_rank, config.qk_rope_head_dim) != FP8_LATENT_DIMS:
        raise ValueError(f"{name}: 'fp8' stores FlashMLA's rows of kv_lora_rank 512 and qk_rope_head_dim 64, the "
                         f"model has {config.kv_lora_rank} and {config.qk_rope_head_dim}")


def check_cache_fits(kv_cache, config: ModelConfig, device: torch.device) -> PagedKVCache:
    """kv_cache is a PagedKVCache on `device` whose layers, rows and indexer layers are those of `config`."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"check_cache_fits: config: expected a ModelConfig, got {type(config).__name__}")
    device = check_device("check_cache_fits: device", device)
    if not isinstance(kv_cache, PagedKVCache):
        raise ValueError(f"kv_cache: expected a PagedKVCache, got {type(kv_cache).__name__}")
    on = kv_cache.latent[0].device  # (a PagedKVCache holds a layer at least: ModelConfig's check)
    if on.type != device.type or (device.index is not None and on.index != device.index):
        raise ValueError(f"kv_cache: expected it on {device}, got {on}")
    cache, model = kv_cache.config, config
    fields = ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim")
    if [getattr(cache, f) for f in fields] != [getattr(model, f) for f in fields] or \
            [cache.runs_indexer(i) for i in range(cache.num_hidden_layers)] != \
            [model.runs_indexer(i) for i in range(model.num_hidden_layers)]:
        raise ValueError(f"kv_cache: built for a model whose layers, rows or indexer layers differ from this one's "
                         f"(cache vs model: {', '.join(f'{f} {getattr(cache, f)} vs {getattr(model, f)}' for f in fields)}"
                         f"; indexer layers as given by indexer_types)")
    return kv_cache


def _check_float_cache(cache: torch.Tensor) -> None:
    if check_tensor("cache", cache).dtype not in CACHE_DTYPES:  # (fp8 dtypes are floating-point too)
        raise ValueError(f"cache: the reference reads and writes float caches, got {cache.dtype} (an fp8 cache: "
                         f"dsv32ref.reference.fp8_cache dequantises it)")


def write_tokens(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [NB, BS, D] (any strides whose elements are distinct) <- rows [T, D] (a float dtype, finite values in
    the cache's range or NaN / inf as they are) at slot_mapping [T] (flattened slot ids)."""
    _check_float_cache(cache)
    nb, bs, d = check_tensor("cache", cache, shape=(None, None, None)).shape
    check_tensor("slot_mapping", slot_mapping, shape=(None,), dtype=(torch.int32, torch.int64), device=cache.device)
    check_tensor("rows", rows, shape=(slot_mapping.shape[0], d), dtype=CACHE_DTYPES, device=cache.device)
    check_slots("slot_mapping", slot_mapping, nb * bs)
    # an expanded view (two slots, one row of memory), or rows read from the cache it writes: refused
    check_disjoint("write_tokens", {"cache": cache}, {"rows": rows})
    cast = rows.to(cache.dtype)
    overflow = torch.isfinite(rows) & ~torch.isfinite(cast)
    if overflow.any():
        raise ValueError(f"rows: {int(overflow.sum())} finite values past {cache.dtype}'s range (the cache's), e.g. "
                         f"{rows[overflow][:2].tolist()}")
    slots = slot_mapping.long()
    cache[slots // bs, slots % bs] = cast


def token_slots(block_table_row: torch.Tensor, seq_len: int, num_blocks: int, block_size: int) -> torch.Tensor:
    """Flat slots int64 [seq_len] of a sequence's first seq_len tokens, through its block-table row."""
    check_tensor("block_table_row", block_table_row, shape=(None,), dtype=(torch.int32, torch.int64))
    check_int("seq_len", seq_len, 0)
    check_int("num_blocks", num_blocks)
    check_int("block_size", block_size)
    if num_blocks * block_size > MAX_BLOCKS:  # (an expanded cache view can claim any size)
        raise ValueError(f"cache: at most 2^31 - 1 slots (int32 slot ids), got {num_blocks} x {block_size}")
    if seq_len > block_table_row.shape[0] * block_size:
        raise ValueError(f"block_table_row: a sequence of {seq_len} tokens needs {-(-seq_len // block_size)} blocks of "
                         f"{block_size}, the row has {block_table_row.shape[0]}")
    pos = torch.arange(seq_len, device=block_table_row.device)
    blocks = block_table_row.long()[pos // block_size]
    if seq_len and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"block_table_row: a sequence of {seq_len} tokens reads blocks outside [0, {num_blocks})")
    return blocks * block_size + pos % block_size


def gather_tokens(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len token rows [seq_len, D] of one sequence, read through its block-table row (cache
    [NB, BS, D], any strides)."""
    _check_float_cache(cache)
    nb, bs, d = check_tensor("cache", cache, shape=(None, None, None)).shape
    check_tensor("block_table_row", block_table_row, shape=(None,), dtype=(torch.int32, torch.int64))
    slots = token_slots(block_table_row.to(cache.device), seq_len, nb, bs)
    return cache[slots // bs, slots % bs]
