"""The model runner: one model, its input batch, its KV cache and its captured graphs; capture (with its
recovery from an out-of-memory) and the execution of a prepared step, as a replay or eagerly.

On a GPU the graphs are CUDA graphs in one shared pool; on a CPU the recording stand-in
(dsv32ref.graphs.emulated) captures and replays the same way.
"""

from __future__ import annotations

import time
import traceback

import torch

from dsv32ref.cache import FP8_PARTS, PagedKVCache, check_cache_fits, check_kv_cache_dtype
from dsv32ref.config import ModelConfig
from dsv32ref.engine.config import EngineConfig
from dsv32ref.engine.context import ForwardContext, set_forward_context
from dsv32ref.engine.input_batch import InputBatch, PreparedStep
from dsv32ref.engine.memory import kv_bytes_per_token, plan_kv_cache
from dsv32ref.engine.model import EngineModel
from dsv32ref.graphs.breakable import CaptureError, CudaGraphBackend
from dsv32ref.graphs.emulated import RecordingBackend
from dsv32ref.graphs.runner import CUDAGraphMode, GraphRunner

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, config: ModelConfig, ec: EngineConfig, model: EngineModel, device: torch.device,
                 dtype: torch.dtype, kv_cache: PagedKVCache | None = None):
        """`kv_cache`: use this cache instead of sizing one from the memory budget (engines that run one after
        another can share it)."""
        if model.boundary != ec.spec:
            raise ValueError(f"model: built for boundary {model.boundary.name!r}, the engine runs {ec.boundary!r}")
        w = model.lm_head
        if (w.dtype, w.device.type) != (dtype, device.type):
            raise ValueError(f"model: its weights are {w.dtype} on {w.device.type}, the engine runs {dtype} on "
                             f"{device.type} (dtype and device)")
        check_kv_cache_dtype("EngineConfig.kv_cache_dtype", ec.kv_cache_dtype, config)
        self.config, self.ec, self.model, self.device, self.dtype = config, ec, model, device, dtype
        model.static_outputs.reserve(ec.max_step_tokens, model.embed_tokens)  # before profiling: the budget sees it
        self.batch = InputBatch(config, ec, device)
        self.memory: dict = {"scores_workspace": self.batch.scores.numel() * 4}
        if kv_cache is None:
            num_blocks, ledger = plan_kv_cache(self)
            self.memory.update(ledger)
            kv_cache = PagedKVCache(config, num_blocks, ec.block_size, dtype, device, ec.kv_cache_dtype)
        else:
            self._check_cache(kv_cache)
            self.memory["shared_kv_cache"] = True
        self.kv_cache = kv_cache
        self.memory.update(kv_cache=kv_cache.nbytes(), num_blocks=kv_cache.num_blocks, kv_cache_dtype=ec.kv_cache_dtype,
                           kv_tokens_per_gib=2 ** 30 // kv_bytes_per_token(config, dtype, ec.kv_cache_dtype))
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        backend = (lambda: CudaGraphBackend(pool)) if device.type == "cuda" else RecordingBackend
        self.graphs = self.graph_runner(backend, kv_cache, on_capture=self._record_capture)
        self.capture_log: list[dict] = []  # per captured (phase, size): what the allocator holds after it

    def _check_cache(self, kv_cache) -> None:
        check_cache_fits(kv_cache, self.config, self.device)
        fp8_parts = FP8_PARTS if self.ec.kv_cache_dtype == "fp8" else ()  # the engine keeps both parts in FP8
        want = (self.ec.block_size, self.dtype, self.ec.kv_cache_dtype, fp8_parts)
        got = (kv_cache.block_size, kv_cache.dtype, kv_cache.kv_cache_dtype, kv_cache.fp8_parts)
        if got != want:
            raise ValueError(f"kv_cache: expected (block_size, dtype, kv_cache_dtype, fp8_parts) = {want}, got {got}")
        if kv_cache.num_blocks < self.ec.max_blocks_per_seq:
            raise ValueError(f"kv_cache: {kv_cache.num_blocks} blocks of {kv_cache.block_size} tokens cannot hold one "
                             f"sequence of max_model_len {self.ec.max_model_len} ({self.ec.max_blocks_per_seq} blocks)")

    # ---- what memory planning and capture run -----------------------------------------------------------
    def graph_runner(self, backend, kv_cache: PagedKVCache, on_capture=None) -> GraphRunner:
        """Graphs of this model over `kv_cache`. FULL graphs serve uniform decode (at most max_num_seqs tokens),
        or every step when the boundary has no eager region (then no PIECEWISE graphs are captured: they would
        be the same graphs)."""
        ec = self.ec
        contexts: dict = {}

        def prepare(size: int, full: bool) -> None:  # FULL sizes past max_num_seqs: boundary "none" only
            contexts["now"] = self.batch.dummy(kv_cache, size, uniform=full and size <= ec.max_num_seqs)

        def forward(size: int, full: bool):
            with set_forward_context(contexts["now"]):
                return self.model(self.batch.input_ids[:size])

        return GraphRunner(forward, ec.mode, ec.capture_sizes, backend, max_full_size=ec.max_num_seqs,
                           full_serves_all=ec.spec.graph_safe_prefill, prepare=prepare, on_capture=on_capture)

    def profile_run(self, kv_cache: PagedKVCache) -> None:
        """The largest prefill step, eagerly, over `kv_cache` (memory planning's profile run)."""
        n = self.ec.max_num_batched_tokens
        with set_forward_context(self.batch.dummy(kv_cache, n, uniform=False)):
            self.model(self.batch.input_ids[:n])

    # ---- capture ---------------------------------------------------------------------------------------
    def capture(self, on_failure=None) -> float:
        """Capture every size in the configured mode; returns seconds taken.

        If a capture fails (out of memory, say), `on_failure()` is called before anything is released (to look
        at what the failure left allocated), then every graph is released, the runner falls back to eager
        execution (mode NONE) so the process stays usable, and CaptureError is raised naming the phase, the
        size and the memory ledger at that point."""
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self.graphs.capture_all()
        except CaptureError as e:
            raise self._recover(e, on_failure) from e
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.memory["captured"] = self.memory_ledger()
        return time.perf_counter() - t0

    def _recover(self, e: CaptureError, on_failure) -> CaptureError:
        chain = e
        while chain is not None:  # the traceback's frames hold the failed forward's activations
            if chain.__traceback__ is not None:
                traceback.clear_frames(chain.__traceback__)
            chain = chain.__cause__ or chain.__context__
        ledger = self.memory_ledger()
        if on_failure is not None:
            on_failure()
        self.graphs.release()
        self.graphs.mode = CUDAGraphMode.NONE
        released = self.model.static_outputs.release()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        hint = ("narrow_copy keeps a static buffer per layer and captured size; use narrow_copy_shared or "
                "narrow_out, or " if self.ec.spec.output == "per_size" else "")
        return CaptureError(
            f"{e}\nmemory ledger at the failure: {_fmt_ledger(ledger)}\n"
            f"what is left: all graphs released, {released / 2**30:.2f} GiB of static copy buffers released, "
            f"the engine now runs eagerly (mode NONE). To capture: {hint}lower gpu_memory_utilization (the KV "
            f"cache takes the rest of the budget) or the largest capture size (max_num_batched_tokens).")

    def _record_capture(self, phase: str, size: int) -> None:
        entry = {"phase": phase, "size": size, "static_buffers": self.model.static_outputs.nbytes()}
        if self.device.type == "cuda":
            entry.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                         free=torch.cuda.mem_get_info()[0])
        self.capture_log.append(entry)

    def memory_ledger(self) -> dict:
        """Bytes: what the allocator holds now, next to the start-up accounting (weights, peak activations,
        budget, KV cache)."""
        led = {k: v for k, v in self.memory.items() if not isinstance(v, dict)}
        led["static_buffers"] = self.model.static_outputs.nbytes()
        if self.device.type == "cuda":
            led.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                       free=torch.cuda.mem_get_info()[0])
        return led

    # ---- a step ----------------------------------------------------------------------------------------
    def forward_context(self, prep: PreparedStep, size: int | None = None) -> ForwardContext:
        """The forward context of a prepared step, padded to `size` rows (default: the step's own)."""
        plan = prep.plan
        skip = self.ec.skip_short_topk and max(plan.seq_lens) <= self.config.index_topk
        return self.batch.context(self.kv_cache, size or prep.num_tokens, plan.query_start_loc, plan.seq_lens,
                                  prep.uniform_decode, skip)

    def execute(self, prep: PreparedStep) -> tuple[str, torch.Tensor]:
        """The forward of a prepared step: a graph replay of its padded size, or eager. Returns (how it ran:
        FULL / PIECEWISE / NONE, hidden states [>= num_tokens, hidden])."""
        n = prep.num_tokens
        how, size, captured = self.graphs.lookup(n, prep.uniform_decode)
        with set_forward_context(self.forward_context(prep, size if captured is not None else n)):
            if captured is not None:
                captured.graph.replay()
                return how, captured.output
            return how, self.model(self.batch.input_ids[:n])

    def execute_timed(self, prep: PreparedStep) -> tuple[str, torch.Tensor, list[float]]:
        """execute() of a step that replays a captured graph, with the host time of each replay entry in
        microseconds (BreakableGraph.replay_timed): a graph segment's launch, an eager region's call."""
        how, size, captured = self.graphs.lookup(prep.num_tokens, prep.uniform_decode)
        if captured is None:
            raise ValueError(f"execute_timed: a step of {prep.num_tokens} tokens replays no graph here ({how})")
        with set_forward_context(self.forward_context(prep, size)):
            return how, captured.output, captured.graph.replay_timed()


def _fmt_ledger(ledger: dict) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f} GiB" if isinstance(v, (int, float)) and k != "num_blocks" and v > 2**20
                     else f"{k} {v}" for k, v in ledger.items())
