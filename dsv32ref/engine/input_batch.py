"""A step's inputs: what the caller asks for (StepInput), the static device buffers the graphs read
(InputBatch, vLLM's input batch), and the pinned host staging that fills them with two copies per step.

Rows past a step's tokens are padding: they write no cache row (slot -1) and attend to the empty padding
request (row max_num_seqs of seq_lens and block_table, of length 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv32ref.cache import PagedKVCache, StepPlan
from dsv32ref.checks import check_fits, check_int, is_int
from dsv32ref.config import ModelConfig
from dsv32ref.engine.config import EngineConfig
from dsv32ref.engine.context import ForwardContext
from dsv32ref.kernels.skinny_gemm import skinny_gemm_counters
from dsv32ref.reference.rope import RotaryEmbedding

__all__ = ["InputBatch", "PreparedStep", "StepInput"]


@dataclass(frozen=True)
class StepInput:
    """Host-side description of one step: per request (seq id, new token ids, tokens already cached), checked and
    kept as tuples; frozen, so that what was checked is what runs."""

    requests: list[tuple[int, list[int], int]]
    uniform_decode: bool = field(init=False)

    def __post_init__(self):
        if not isinstance(self.requests, (list, tuple)) or not self.requests:
            raise ValueError(f"StepInput.requests: expected a non-empty list of (seq_id, token_ids, context_len), "
                             f"got {self.requests!r}")
        seen = set()
        for b, req in enumerate(self.requests):
            if not isinstance(req, (list, tuple)) or len(req) != 3:
                raise ValueError(f"StepInput.requests[{b}]: expected (seq_id, token_ids, context_len), got {req!r}")
            seq_id, toks, ctx_len = req
            check_int(f"StepInput.requests[{b}].seq_id", seq_id, low=0)
            check_int(f"StepInput.requests[{b}].context_len", ctx_len, low=0)
            if seq_id in seen:
                raise ValueError(f"StepInput.requests[{b}].seq_id: sequence {seq_id} appears twice in one step")
            seen.add(seq_id)
            if not isinstance(toks, (list, tuple)) or not toks:
                raise ValueError(f"StepInput.requests[{b}].token_ids: expected a non-empty list of ints, got {toks!r}")
            for t in toks:
                if not is_int(t):
                    raise ValueError(f"StepInput.requests[{b}].token_ids: token ids must be ints, got "
                                     f"{type(t).__name__} {t!r}")
        # held as checked, in tuples: a caller's list changed afterwards changes nothing here
        object.__setattr__(self, "requests", tuple((s, tuple(toks), c) for s, toks, c in self.requests))
        object.__setattr__(self, "uniform_decode", all(len(toks) == 1 for _, toks, _ in self.requests))

    @property
    def num_tokens(self) -> int:
        return sum(len(toks) for _, toks, _ in self.requests)


@dataclass
class PreparedStep:
    """One step once placed: its metadata as host lists (StepPlan: what AttentionMetadata holds), already
    written into the pinned staging buffers."""

    plan: StepPlan

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def last(self) -> list[int]:
        """The row of each request's last token (what sampling reads)."""
        return [q - 1 for q in self.plan.query_start_loc[1:]]

    @property
    def uniform_decode(self) -> bool:
        return all(n == 1 for n in self.plan.query_lens())


class StepBuffers:
    """A step's metadata as two flat device buffers (int64, int32) with pinned host twins: the host fills the
    twins in place, `upload()` copies each in one asynchronous host-to-device copy. Before the host writes the
    twins again, `host()` waits for the previous copy to finish (the copy reads them asynchronously)."""

    def __init__(self, device: torch.device, n64: int, n32: int):
        pin = device.type == "cuda"
        self.device64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self.device32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self._pending = False

    def host(self):
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        return self.host64.numpy(), self.host32.numpy()

    def upload(self) -> None:
        self.device64.copy_(self.host64, non_blocking=True)
        self.device32.copy_(self.host32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._pending = True


class InputBatch:
    """The static device buffers every step (and every captured graph) reads, at fixed addresses:

        input_ids, positions, slot_mapping  int64 [n_max]          logits_indices  int64 [max_num_seqs]
        req_indices  int32 [n_max]          seq_lens  int32 [seqs + 1]     block_table  int32 [seqs + 1, blocks]
        topk  int32 [n_max, index_topk]     scores  fp32 [scores_rows, max_model_len] (the graph-safe indexer)
        cos, sin  [max_model_len, rope / 2]       gemm_counters  int32 zeros (skinny_gemm's split-K; gemm "skinny")
    n_max = EngineConfig.max_step_tokens; the int64 and int32 buffers are views of StepBuffers' two."""

    def __init__(self, config: ModelConfig, ec: EngineConfig, device: torch.device):
        self.config, self.ec, self.device = config, ec, device
        n_max, seqs, nb = ec.max_step_tokens, ec.max_num_seqs, ec.max_blocks_per_seq
        n64, n32 = 3 * n_max + seqs, n_max + (seqs + 1) * (1 + nb)
        check_fits("InputBatch: the step's buffers (EngineConfig's max_num_batched_tokens, max_num_seqs and "
                   "max_model_len size them)", (1 + (device.type == "cpu")) * (8 * n64 + 4 * n32) +  # + host twins
                   4 * n_max * config.index_topk +
                   4 * ec.scores_rows * ec.max_model_len + 4 * ec.max_model_len * config.qk_rope_head_dim, device)
        cos, sin = RotaryEmbedding(config).to(device)(torch.arange(ec.max_model_len, device=device))
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.buffers = StepBuffers(device, n64=n64, n32=n32)  # a pinned host copy of each beside it
        d64, d32 = self.buffers.device64, self.buffers.device32
        self.input_ids, self.positions, self.slot_mapping = (d64[i * n_max:(i + 1) * n_max] for i in range(3))
        self.logits_indices = d64[3 * n_max:]
        self.req_indices = d32[:n_max]
        self.seq_lens = d32[n_max:n_max + seqs + 1]
        self.block_table = d32[n_max + seqs + 1:].view(seqs + 1, nb)
        self.slot_mapping.fill_(-1)
        self.req_indices.fill_(seqs)
        self.topk = torch.full((n_max, config.index_topk), -1, dtype=torch.int32, device=device)
        self.scores = torch.zeros(ec.scores_rows, ec.max_model_len, dtype=torch.float32, device=device)
        self.gemm_counters = skinny_gemm_counters(device) if ec.gemm == "skinny" else None
        self._views: dict[int, tuple] = {}

    @property
    def max_tokens(self) -> int:
        return self.input_ids.shape[0]

    def stage(self, step: StepInput, tables: list[list[int]], num_blocks: int) -> PreparedStep:
        """Build the step's metadata (StepPlan.build) and write it into the pinned host buffers: host work
        only. `tables`: each request's block table, already grown to hold its new tokens."""
        ec, n_max, seqs = self.ec, self.max_tokens, self.ec.max_num_seqs
        plan = StepPlan.build([c for _, _, c in step.requests], [len(t) for _, t, _ in step.requests], tables,
                              ec.block_size, num_blocks=num_blocks)
        prep, n, B = PreparedStep(plan), plan.num_tokens, plan.num_reqs
        h64, h32 = self.buffers.host()  # numpy views of the pinned buffers (waits for the previous copy)
        ids, pos, slots = h64[:n_max], h64[n_max:2 * n_max], h64[2 * n_max:3 * n_max]
        ids[:n] = [t for _, toks, _ in step.requests for t in toks]
        pos[:n], slots[:n] = plan.positions, plan.slot_mapping
        ids[n:], pos[n:], slots[n:] = 0, 0, -1  # padding rows: no cache write, attend to the padding request
        last = h64[3 * n_max:]
        last[:B], last[B:] = prep.last, 0
        h32[:n], h32[n:n_max] = plan.req_indices, seqs
        lens, table = h32[n_max:n_max + seqs + 1], h32[n_max + seqs + 1:].reshape(seqs + 1, -1)  # (seqs + 1, blocks)
        lens[:B], lens[B:] = plan.seq_lens, 0
        table[:] = 0
        for b, bt in enumerate(plan.block_tables):
            table[b, : len(bt)] = bt
        return prep

    def upload(self) -> None:
        """The staged metadata to the device: one asynchronous copy per buffer (pinned memory)."""
        self.buffers.upload()

    def context(self, kv_cache: PagedKVCache, size: int, qsl: list[int], seq_lens: list[int], uniform: bool,
                skip_topk: bool = False) -> ForwardContext:
        """The forward context of a step padded to `size` rows (views made once per size)."""
        views = self._views.get(size)
        if views is None:
            views = self._views[size] = (self.positions[:size], self.slot_mapping[:size], self.req_indices[:size],
                                         self.topk[:size], self.scores[: min(size, self.scores.shape[0])])
        positions, slot_mapping, req_indices, topk, scores = views
        return ForwardContext(
            kv_cache=kv_cache, cos=self.cos, sin=self.sin, positions=positions, slot_mapping=slot_mapping,
            req_indices=req_indices, seq_lens=self.seq_lens, block_table=self.block_table, topk=topk, scores=scores,
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, uniform_decode=uniform, num_sms=self.ec.num_sms,
            skip_topk=skip_topk, gemm=self.ec.gemm, gemm_counters=self.gemm_counters)

    def dummy(self, kv_cache: PagedKVCache, size: int, uniform: bool) -> ForwardContext:
        """Capture-time metadata, written on the device: padding everywhere (no cache writes); for prefill
        `size` tokens in requests of at most max_model_len tokens, for uniform decode `size` one-token requests.
        Graph code never branches on it. No request is longer than max_model_len: the kernels read cos/sin at
        each position and the block table at position // block_size, both sized for max_model_len."""
        self.input_ids[:size].zero_()
        self.slot_mapping[:size].fill_(-1)
        self.block_table.zero_()
        if uniform:
            self.positions[:size].zero_()
            self.req_indices[:size] = torch.arange(size, dtype=torch.int32, device=self.device)
            self.seq_lens[:size].fill_(1)
            return self.context(kv_cache, size, list(range(size + 1)), [1] * size, True)
        L = self.ec.max_model_len
        starts = list(range(0, size, L))
        lens = [min(L, size - s) for s in starts]
        tok = torch.arange(size, device=self.device)
        self.positions[:size] = tok % L  # each request starts at a multiple of L
        self.req_indices[:size] = (tok // L).to(torch.int32)
        self.seq_lens.zero_()
        self.seq_lens[: len(lens)] = torch.tensor(lens, dtype=torch.int32, device=self.device)
        return self.context(kv_cache, size, starts + [size], lens, False)
