"""A small serving engine: paged KV cache sized from a memory budget, graph capture, sequential requests.

One step = one batch of scheduled requests (prefill chunks and/or decode tokens). The engine copies the
step's metadata into static buffers, publishes the host metadata in the forward context, and either
replays a captured graph of the padded size (FULL for uniform decode, PIECEWISE otherwise) or runs
eagerly. Sampling is greedy, on each request's last token, after the graph.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from dsv32ref.cache import BlockAllocator, PagedKVCache, StepPlan
from dsv32ref.checks import check_int, is_int
from dsv32ref.config import ModelConfig
from dsv32ref.engine.context import ForwardContext, set_forward_context
from dsv32ref.engine.model import EngineModel
from dsv32ref.graphs.breakable import CaptureError, CudaGraphBackend
from dsv32ref.graphs.emulated import RecordingBackend
from dsv32ref.graphs.runner import CUDAGraphMode, GraphRunner, default_capture_sizes
from dsv32ref.reference.rope import RotaryEmbedding


@dataclass
class EngineConfig:
    boundary: str = "narrow"
    mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 64
    gpu_memory_utilization: float = 0.9
    capture_sizes: list[int] | None = None  # default: the engine's sizes up to max_num_batched_tokens
    num_blocks: int | None = None  # None: sized from the memory budget (capped at what max_num_seqs can use)
    estimate_graph_memory: bool = True  # subtract the serving engine's graph-memory estimate from the KV budget
    seed: int = 0
    num_sms: int | None = None  # SMs sparse_mla's split-K fills (None: the device's; set it to predict a GPU's
    # launches on a CPU)
    skip_short_topk: bool = False  # a step whose requests all have <= index_topk keys skips the indexer's
    # scoring and selection (their result is known: every key); eager regions and graph-less steps only
    split_graphs: bool = False  # captures start a new graph before layers 1, 4, 16, 64, ... (split_layers): an
    # experiment; on the H200 it gains nothing (the GPU does not wait for a graph's whole launch)

    def __post_init__(self):
        from dsv32ref.engine.model import BOUNDARIES

        if self.boundary not in BOUNDARIES:
            raise ValueError(f"EngineConfig.boundary: expected one of {BOUNDARIES}, got {self.boundary!r}")
        if not isinstance(self.mode, CUDAGraphMode):
            raise ValueError(f"EngineConfig.mode: expected a CUDAGraphMode (e.g. CUDAGraphMode("
                             f"'full_and_piecewise')), got {type(self.mode).__name__} {self.mode!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            check_int(f"EngineConfig.{name}", getattr(self, name))
        check_int("EngineConfig.seed", self.seed, low=0)
        for name in ("num_blocks", "num_sms"):
            if getattr(self, name) is not None:
                check_int(f"EngineConfig.{name}", getattr(self, name))
        for name in ("skip_short_topk", "split_graphs", "estimate_graph_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization: expected (0, 1], got {u!r}")
        if self.capture_sizes is None:
            self.capture_sizes = default_capture_sizes(self.max_num_batched_tokens)
        if not isinstance(self.capture_sizes, (list, tuple)):
            raise ValueError(f"EngineConfig.capture_sizes: expected a list of ints, got {self.capture_sizes!r}")
        for s in self.capture_sizes:
            if not is_int(s) or s < 1:
                raise ValueError(f"EngineConfig.capture_sizes: every size must be an int >= 1, got {s!r} in "
                                 f"{list(self.capture_sizes)}")
        self.capture_sizes = sorted(set(self.capture_sizes))
        if self.max_step_tokens > self.max_num_seqs * self.max_model_len:
            raise ValueError(f"max_num_batched_tokens / capture sizes: at most max_num_seqs x max_model_len = "
                             f"{self.max_num_seqs * self.max_model_len} tokens fit in one step, got "
                             f"{self.max_step_tokens}")

    @property
    def max_step_tokens(self) -> int:
        """Rows of the static buffers: the largest step, or the largest captured size if that is larger."""
        return max(self.capture_sizes + [self.max_num_batched_tokens])

    @property
    def graph_safe_prefill(self) -> bool:
        """Boundary "none": every step takes the graph-safe path, so FULL graphs serve prefill too."""
        return self.boundary == "none"

    @property
    def scores_rows(self) -> int:
        """Rows of the graph-safe indexer's workspace: every row of a step for "none", else the padded decode
        rows. Its bytes: scores_rows x max_model_len x 4."""
        return self.max_step_tokens if self.graph_safe_prefill else self.max_decode_rows

    @property
    def max_decode_rows(self) -> int:
        """Rows a uniform-decode step can have once padded: max_num_seqs tokens, padded to the next capture
        size (which may be a PIECEWISE-only size past max_num_seqs)."""
        i = bisect.bisect_left(self.capture_sizes, self.max_num_seqs)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else self.max_num_seqs


def split_layers(num_layers: int, ratio: int = 4) -> list[int]:
    """Layers a split capture starts a new graph before: 1, ratio, ratio^2, ... below num_layers.

    The idea: launching a graph costs host time per node and a step's forward is one graph of thousands of
    nodes; split, the host launches a one-layer graph first and launches the next segment (each about
    ratio - 1 times the layers before it) while the GPU runs it. Measured on an H200 (the TTFT experiment's
    `none+split` arm): no gain, the GPU already starts a graph's first kernels before its launch returns. Kept
    as the switch that answers the question on another GPU or driver."""
    out, k = [], 1
    while k < num_layers:
        out.append(k)
        k *= ratio
    return out


def build_model(config: ModelConfig, boundary: str, device, dtype, seed: int) -> EngineModel:
    """Parameters created directly on the device in the target dtype (a full-size model never touches the host)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = EngineModel(config, boundary)
    finally:
        torch.set_default_dtype(old)
    return model.init_dummy(seed).eval()


@dataclass
class StepInput:
    """Host-side description of one step: per request (seq id, new token ids, tokens already cached)."""

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
        self.uniform_decode = all(len(toks) == 1 for _, toks, _ in self.requests)


@dataclass
class PreparedStep:
    """One step once the engine has placed it: its metadata as host lists (StepPlan: what AttentionMetadata
    holds), written into the engine's pinned staging buffers."""

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


class LLMEngine:
    def __init__(self, config: ModelConfig, engine_config: EngineConfig | None = None, device="cuda",
                 dtype=torch.bfloat16, model: EngineModel | None = None, kv_cache: PagedKVCache | None = None):
        """`model`: share one model between engines (its boundary is set before each step). `kv_cache`: use this
        cache instead of sizing one from the memory budget (engines that run one after another can share it;
        each keeps its own block allocator, so no two of them may hold live sequences at once)."""
        self.config, self.ec = config, engine_config or EngineConfig()
        self.device, self.dtype = torch.device(device), dtype
        ec = self.ec
        self.model = model if model is not None else build_model(config, ec.boundary, device, dtype, ec.seed)
        self.model.set_boundary(ec.boundary)
        n_max = ec.max_step_tokens
        if ec.boundary == "narrow_copy_shared":  # allocated before memory profiling, so the budget sees it
            self.model.reserve_copy_buffer(n_max)
        cos, sin = RotaryEmbedding(config).to(self.device)(torch.arange(ec.max_model_len, device=self.device))
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        seqs = ec.max_num_seqs
        self.max_blocks_per_seq = -(-ec.max_model_len // ec.block_size)
        # The step's metadata lives in two device buffers (int64, int32), each filled from a pinned host twin by
        # one copy per step; the views below keep fixed addresses for the graphs.
        nb = self.max_blocks_per_seq
        self._meta = StepBuffers(self.device, n64=3 * n_max + seqs, n32=n_max + (seqs + 1) * (1 + nb))
        d64, d32 = self._meta.device64, self._meta.device32
        self.input_ids, self.positions, self.slot_mapping = (d64[i * n_max:(i + 1) * n_max] for i in range(3))
        self.logits_indices = d64[3 * n_max:]  # [max_num_seqs]: each request's last row
        self.req_indices = d32[:n_max]  # row `seqs` of seq_lens / block_table is the padding request
        self.seq_lens = d32[n_max:n_max + seqs + 1]
        self.block_table = d32[n_max + seqs + 1:].view(seqs + 1, nb)
        self.slot_mapping.fill_(-1)
        self.req_indices.fill_(seqs)
        self.topk = torch.full((n_max, config.index_topk), -1, dtype=torch.int32, device=self.device)
        # the graph-safe indexer's workspace: one row per token of a (padded) uniform-decode step, or of any
        # step for boundary "none"
        self.scores = torch.zeros(ec.scores_rows, ec.max_model_len, dtype=torch.float32, device=self.device)
        self.memory: dict[str, float] = {"scores_workspace": self.scores.numel() * 4}
        self._views: dict[int, tuple] = {}  # per size: the static buffers' first rows (ForwardContext)
        self._graph_splits = frozenset(split_layers(config.num_hidden_layers) if ec.split_graphs else ())
        if kv_cache is None:
            self._size_kv_cache()
        else:
            if not isinstance(kv_cache, PagedKVCache):
                raise ValueError(f"kv_cache: expected a PagedKVCache, got {type(kv_cache).__name__}")
            want = (config.num_hidden_layers, ec.block_size, str(self.device.type), self.dtype)
            got = (len(kv_cache.latent), kv_cache.block_size, kv_cache.latent[0].device.type, kv_cache.latent[0].dtype)
            if got != want:
                raise ValueError(f"kv_cache: expected (layers, block_size, device, dtype) = {want}, got {got}")
            self.kv_cache = kv_cache
            self.memory.update(kv_cache=kv_cache.nbytes(), num_blocks=kv_cache.num_blocks, shared_kv_cache=True)
        self.allocator = BlockAllocator(self.kv_cache.num_blocks, ec.block_size)
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        # On a GPU: CUDA graphs in one shared pool. On a CPU: the recording stand-in (dsv32ref.graphs.emulated).
        backend = (lambda: CudaGraphBackend(self._pool)) if self.device.type == "cuda" else RecordingBackend
        self.runner = self._graph_runner(backend, on_capture=self._record_capture)
        self.capture_log: list[dict] = []  # per captured (phase, size): what the allocator holds after it
        self.on_capture_failure = None  # called once a capture failed, before anything is released
        self._capture_ctx: ForwardContext | None = None
        self._next_seq = 0

    # ---- memory ---------------------------------------------------------------------------------------
    def _size_kv_cache(self) -> None:
        ec, c = self.ec, self.config
        per_block = ec.block_size * sum(
            c.latent_dim + (c.index_head_dim if c.runs_indexer(i) else 0) for i in range(c.num_hidden_layers)
        ) * torch.finfo(self.dtype).bits // 8
        usable = ec.max_num_seqs * self.max_blocks_per_seq + 1
        if ec.num_blocks is not None:
            num_blocks = ec.num_blocks
        elif self.device.type == "cuda":
            torch.cuda.synchronize()
            weights = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            estimate = self._profile_run()
            peak = self.memory["profile_peak"]
            free, total = torch.cuda.mem_get_info()
            budget = total * ec.gpu_memory_utilization - peak - estimate
            self.memory.update(total=total, weights=weights, peak_activations=peak - weights, graph_estimate=estimate,
                               budget=budget)
            num_blocks = min(int(budget // per_block), usable)
            if num_blocks < 1:
                raise RuntimeError(
                    f"KV cache: no memory left at gpu_memory_utilization={ec.gpu_memory_utilization} (total "
                    f"{total / 2**30:.1f} GiB; weights + peak activations {peak / 2**30:.1f} GiB; graph-memory "
                    f"estimate {estimate / 2**30:.1f} GiB; static copy buffers {self.model.static_buffer_bytes() / 2**30:.1f} GiB)")
        else:
            num_blocks = usable
        self.kv_cache = PagedKVCache(c, num_blocks, ec.block_size, self.dtype, self.device)
        self.memory.update(kv_cache=self.kv_cache.nbytes(), num_blocks=num_blocks)

    @torch.no_grad()
    def _profile_run(self) -> int:
        """The largest prefill step, eagerly, with a throwaway cache; then the graph-memory estimate with the
        same cache. Records the peak in self.memory["profile_peak"]; returns the estimate in bytes."""
        n = self.ec.max_num_batched_tokens
        self.kv_cache = PagedKVCache(self.config, -(-n // self.ec.block_size) + 1, self.ec.block_size, self.dtype,
                                     self.device)
        ctx = self._dummy_context(n, uniform=False)
        with set_forward_context(ctx):
            self.model(self.input_ids[:n])
        torch.cuda.synchronize()
        self.memory["profile_peak"] = torch.cuda.max_memory_allocated()
        estimate = self._estimate_graph_memory() if self.ec.estimate_graph_memory else 0
        del self.kv_cache
        return estimate

    def _estimate_graph_memory(self) -> int:
        """The serving engine's graph-memory estimate (vLLM's profile_cudagraph_memory), made before the KV
        cache exists: per mode, capture the two largest sizes into a temporary pool, each measured as the drop
        in free device memory; estimate = max over modes of the first capture + sum over modes of the second
        capture (at least 1 MiB) x (number of sizes - 1). The graphs are released afterwards; whatever the
        model keeps (narrow_copy's static buffers) stays allocated."""
        if self.ec.mode is CUDAGraphMode.NONE:
            return 0
        pool = torch.cuda.graph_pool_handle()
        runner = self._graph_runner(lambda: CudaGraphBackend(pool))
        first, per_graph, detail = {}, {}, {}
        try:
            for phase, sizes in runner.phase_sizes():
                if not sizes:  # e.g. FULL when every capture size exceeds max_num_seqs
                    continue
                samples = []
                for size in sizes[:2]:
                    torch.cuda.synchronize()
                    before = torch.cuda.mem_get_info()[0]
                    runner.capture(phase, size)
                    torch.cuda.synchronize()
                    samples.append(before - torch.cuda.mem_get_info()[0])
                first[phase] = samples[0]
                per_graph[phase] = max(samples[1] if len(samples) > 1 else 0, 2**20) * (len(sizes) - 1)
                detail[phase] = {"sizes": len(sizes), "samples": samples, "per_graph_total": per_graph[phase]}
        finally:
            runner.release()
            del runner
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.memory["graph_estimate_detail"] = detail
        return max(first.values()) + sum(per_graph.values()) if first else 0

    def _graph_runner(self, backend, on_capture=None) -> GraphRunner:
        """FULL graphs serve uniform decode (at most max_num_seqs tokens), or every step when the model has no
        eager break (boundary "none": then no PIECEWISE graphs are captured, they would be the same graphs)."""
        ec = self.ec
        return GraphRunner(self._forward_for_capture, ec.mode, ec.capture_sizes, backend,
                           max_full_size=ec.max_num_seqs, full_serves_all=ec.graph_safe_prefill, prepare=self._prepare_capture,
                           on_capture=on_capture)

    # ---- contexts ---------------------------------------------------------------------------------------
    def _context(self, size: int, qsl: list[int], seq_lens: list[int], uniform: bool,
                 skip_topk: bool = False) -> ForwardContext:
        views = self._views.get(size)  # the static buffers' first `size` rows, made once per size
        if views is None:
            views = self._views[size] = (self.positions[:size], self.slot_mapping[:size], self.req_indices[:size],
                                         self.topk[:size], self.scores[: min(size, self.scores.shape[0])])
        positions, slot_mapping, req_indices, topk, scores = views
        return ForwardContext(
            kv_cache=self.kv_cache, cos=self.cos, sin=self.sin, positions=positions, slot_mapping=slot_mapping,
            req_indices=req_indices, seq_lens=self.seq_lens, block_table=self.block_table, topk=topk, scores=scores,
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, uniform_decode=uniform, num_sms=self.ec.num_sms,
            skip_topk=skip_topk, graph_splits=self._graph_splits)

    def _dummy_context(self, size: int, uniform: bool) -> ForwardContext:
        """Capture-time metadata: padding everywhere (no cache writes); for prefill, `size` tokens in requests
        of at most max_model_len tokens (one request when size <= max_model_len), for uniform decode `size`
        one-token requests. Graph code never branches on it. No request may be longer than max_model_len:
        the kernels read cos/sin at each position and the block table at position // block_size, both sized
        for max_model_len, without bounds checks."""
        self.input_ids[:size].zero_()
        self.slot_mapping[:size].fill_(-1)
        self.block_table.zero_()
        if uniform:
            self.positions[:size].zero_()
            self.req_indices[:size] = torch.arange(size, dtype=torch.int32, device=self.device)
            self.seq_lens[:size].fill_(1)
            return self._context(size, list(range(size + 1)), [1] * size, True)
        L = self.ec.max_model_len
        starts = list(range(0, size, L))
        lens = [min(L, size - s) for s in starts]
        tok = torch.arange(size, device=self.device)
        self.positions[:size] = tok % L  # each request starts at a multiple of L
        self.req_indices[:size] = (tok // L).to(torch.int32)
        self.seq_lens.zero_()
        self.seq_lens[: len(lens)] = torch.tensor(lens, dtype=torch.int32, device=self.device)
        return self._context(size, starts + [size], lens, False)

    def _prepare_capture(self, size: int, full: bool) -> None:
        # FULL sizes past max_num_seqs exist only for boundary "none", whose graph code reads no host metadata
        self._capture_ctx = self._dummy_context(size, uniform=full and size <= self.ec.max_num_seqs)

    def _forward_for_capture(self, size: int, full: bool):
        self.model.set_boundary(self.ec.boundary)
        with set_forward_context(self._capture_ctx):
            return self.model(self.input_ids[:size])

    # ---- capture and steps ------------------------------------------------------------------------------
    def capture(self) -> float:
        """Capture every size in the configured mode; returns seconds taken.

        If a capture fails (out of memory, say), every graph is released, the engine falls back to eager
        execution (mode NONE) so the process stays usable, and CaptureError is raised naming the phase, the
        size and the memory ledger at that point.
        """
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self.runner.capture_all()
        except CaptureError as e:
            _drop_frames(e)  # the traceback's frames hold the failed forward's activations
            ledger = self.memory_ledger()
            if self.on_capture_failure is not None:
                self.on_capture_failure()
            self.runner.release()
            self.runner.mode = CUDAGraphMode.NONE
            released = self.model.release_static_buffers()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            hint = ("narrow_copy keeps a static buffer per layer and captured size; use narrow_copy_shared or "
                    "narrow_out, or " if self.ec.boundary == "narrow_copy" else "")
            raise CaptureError(
                f"{e}\nmemory ledger at the failure: {_fmt_ledger(ledger)}\n"
                f"what is left: all graphs released, {released / 2**30:.2f} GiB of static copy buffers released, "
                f"the engine now runs eagerly (mode NONE). To capture: {hint}lower gpu_memory_utilization (the KV "
                f"cache takes the rest of the budget) or the largest capture size (max_num_batched_tokens).") from e
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.memory["captured"] = self.memory_ledger()
        return time.perf_counter() - t0

    def _record_capture(self, phase: str, size: int) -> None:
        entry = {"phase": phase, "size": size, "static_buffers": self.model.static_buffer_bytes()}
        if self.device.type == "cuda":
            entry.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                         free=torch.cuda.mem_get_info()[0])
        self.capture_log.append(entry)

    def memory_ledger(self) -> dict:
        """Bytes: what the allocator holds now, next to the start-up accounting (weights, peak activations,
        budget, KV cache)."""
        led = {k: v for k, v in self.memory.items() if not isinstance(v, dict)}
        led["static_buffers"] = self.model.static_buffer_bytes()
        if self.device.type == "cuda":
            led.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                       free=torch.cuda.mem_get_info()[0])
        return led

    def release_graphs(self) -> None:
        self.runner.release()

    def prepare(self, step: StepInput) -> PreparedStep:
        """Place one step: check it against the engine's limits, grow each sequence's blocks, build its metadata
        with StepPlan.build, write it into the pinned host buffers (stage) and copy them into the
        static device buffers (upload: two host-to-device copies). Rows past the step are padding: they write
        nothing and attend to the empty padding request."""
        prep = self.stage(step)
        self.upload()
        return prep

    def upload(self) -> None:
        """The staged metadata to the device: one copy per buffer, asynchronous (pinned memory)."""
        self._meta.upload()

    def stage(self, step: StepInput) -> PreparedStep:
        """prepare() without the upload: host work only."""
        ec, V = self.ec, self.config.vocab_size
        if len(step.requests) > ec.max_num_seqs:
            raise ValueError(f"StepInput.requests: {len(step.requests)} requests in one step, max_num_seqs is "
                             f"{ec.max_num_seqs}")
        n = sum(len(toks) for _, toks, _ in step.requests)
        if n > self.input_ids.shape[0]:
            raise ValueError(f"step of {n} tokens exceeds max_num_batched_tokens={self.input_ids.shape[0]}")
        for b, (seq_id, toks, ctx_len) in enumerate(step.requests):
            if ctx_len + len(toks) > ec.max_model_len:
                raise ValueError(f"StepInput.requests[{b}]: sequence {seq_id} would hold {ctx_len + len(toks)} tokens "
                                 f"(context {ctx_len} + {len(toks)} new), max_model_len is {ec.max_model_len}")
            bad = [t for t in toks if not 0 <= t < V]
            if bad:
                raise ValueError(f"StepInput.requests[{b}].token_ids: ids must lie in [0, {V}) (vocab_size), "
                                 f"got {bad[:4]}")
        tables = [self.allocator.ensure(seq_id, ctx_len + len(toks)) for seq_id, toks, ctx_len in step.requests]
        plan = StepPlan.build([c for _, _, c in step.requests], [len(t) for _, t, _ in step.requests], tables,
                              ec.block_size, num_blocks=self.kv_cache.num_blocks)
        prep = PreparedStep(plan)
        B, n_max, seqs = plan.num_reqs, self.input_ids.shape[0], ec.max_num_seqs
        h64, h32 = self._meta.host()  # numpy views of the pinned buffers (waits for the previous copy)
        # int64 [3 n_max + seqs]: input ids, positions, slots, then each request's last row
        ids, pos, slots = h64[:n_max], h64[n_max:2 * n_max], h64[2 * n_max:3 * n_max]
        ids[:n] = [t for _, toks, _ in step.requests for t in toks]
        pos[:n], slots[:n] = plan.positions, plan.slot_mapping
        ids[n:], pos[n:], slots[n:] = 0, 0, -1  # padding rows: no cache write, attend to the padding request
        last = h64[3 * n_max:]
        last[:B], last[B:] = prep.last, 0
        # int32 [n_max + (seqs + 1) (1 + max_blocks)]: request of each row, seq_lens, block table
        h32[:n], h32[n:n_max] = plan.req_indices, seqs
        lens, table = h32[n_max:n_max + seqs + 1], h32[n_max + seqs + 1:].reshape(seqs + 1, -1)
        lens[:B], lens[B:] = plan.seq_lens, 0
        table[:] = 0
        for b, bt in enumerate(plan.block_tables):
            table[b, : len(bt)] = bt
        return prep

    def forward_context(self, prep: PreparedStep, size: int | None = None) -> ForwardContext:
        """The forward context of a prepared step, padded to `size` rows (default: the step's own)."""
        skip = self.ec.skip_short_topk and max(prep.plan.seq_lens) <= self.config.index_topk
        return self._context(size or prep.num_tokens, prep.plan.query_start_loc, prep.plan.seq_lens,
                             prep.uniform_decode, skip)

    @torch.no_grad()
    def step(self, step: StepInput) -> tuple[list[int], str]:
        """Run one step; returns (the next token of each request, how it ran: FULL / PIECEWISE / NONE)."""
        prep = self.prepare(step)
        how, hidden = self.execute(prep)
        return self.sample(prep, hidden), how

    def execute(self, prep: PreparedStep) -> tuple[str, torch.Tensor]:
        """The forward of a prepared step: a graph replay of its padded size, or eager. Returns (how it ran,
        hidden states [>= num_tokens, hidden])."""
        n = prep.num_tokens
        if self.model.boundary != self.ec.boundary:  # engines may share one model (the TTFT experiment)
            self.model.set_boundary(self.ec.boundary)
        how, size, captured = self.runner.lookup(n, prep.uniform_decode)
        with set_forward_context(self.forward_context(prep, size if captured is not None else n)):
            if captured is not None:
                captured.graph.replay()
                return how, captured.output
            return how, self.model(self.input_ids[:n])

    def sample(self, prep: PreparedStep, hidden: torch.Tensor) -> list[int]:
        """Greedy sampling after the graph: logits of each request's last row (kept in last_logits), argmax,
        read back to the host (the step's one sync)."""
        logits = self.model.compute_logits(hidden[self.logits_indices[: prep.plan.num_reqs]])
        self.last_logits = logits
        return logits.argmax(-1).tolist()

    def generate(self, prompt: list[int], max_new_tokens: int = 1) -> tuple[list[int], float]:
        """One request alone: prefill, then greedy decode. Returns (new tokens, time to first token in s)."""
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompt: expected a non-empty list of token ids, got {prompt!r}")
        if len(prompt) + max_new_tokens - 1 > self.ec.max_model_len:
            raise ValueError(f"prompt: {len(prompt)} tokens + {max_new_tokens - 1} decoded ones exceed max_model_len="
                             f"{self.ec.max_model_len}")
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        t0 = time.perf_counter()
        (tok,), _ = self.step(StepInput([(seq_id, list(prompt), 0)]))
        ttft = time.perf_counter() - t0  # .tolist() in step() synchronised with the GPU
        out = [tok]
        try:
            for i in range(max_new_tokens - 1):
                (tok,), _ = self.step(StepInput([(seq_id, [tok], len(prompt) + i)]))
                out.append(tok)
        finally:
            self.allocator.release(seq_id)
        return out, ttft


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


def _drop_frames(exc: BaseException | None) -> None:
    """Clear the local variables of every finished frame in an exception chain (tensors of a failed forward)."""
    import traceback

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _fmt_ledger(ledger: dict) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f} GiB" if isinstance(v, (int, float)) and k != "num_blocks" and v > 2**20
                     else f"{k} {v}" for k, v in ledger.items())
