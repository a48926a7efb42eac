"""The engine loop: place a step, run it (a graph replay or eagerly), sample greedily after the graph.

One step is one batch of scheduled requests (prefill chunks and/or decode tokens). Its metadata goes into the
input batch's static buffers, the model runner replays the captured graph of the padded size (FULL for uniform
decode, PIECEWISE otherwise) or runs eagerly, and sampling reads each request's last row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from dsv32ref.cache import BlockAllocator, PagedKVCache
from dsv32ref.checks import is_int, shown
from dsv32ref.config import ModelConfig
from dsv32ref.engine.config import EngineConfig, check_placement
from dsv32ref.engine.input_batch import PreparedStep, StepInput
from dsv32ref.engine.model import EngineModel
from dsv32ref.engine.model_runner import ModelRunner
from dsv32ref.engine.weights import build_model, share_weights

__all__ = ["LLMEngine"]


def _check_placement(config: ModelConfig, ec: EngineConfig, device, dtype) -> torch.device:
    """LLMEngine's device (a torch.device or its name) and dtype (a torch float dtype), and max_model_len within the
    positions the model was built for -> the device."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"LLMEngine: config: expected a ModelConfig (e.g. ModelConfig.preset(...)), got "
                         f"{type(config).__name__} {config!r:.80}")
    if not isinstance(ec, EngineConfig):
        raise ValueError(f"LLMEngine: engine_config: expected None or an EngineConfig, got {type(ec).__name__}")
    dev = check_placement("LLMEngine", device, dtype)
    if ec.max_model_len > config.max_position_embeddings:
        raise ValueError(f"EngineConfig.max_model_len: {ec.max_model_len} exceeds the model's max_position_embeddings "
                         f"({config.max_position_embeddings})")
    return dev


def _differing(a: ModelConfig, b: ModelConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


class LLMEngine:
    def __init__(self, config: ModelConfig, engine_config: EngineConfig | None = None, device="cuda",
                 dtype=torch.bfloat16, model: EngineModel | None = None, weights: EngineModel | None = None,
                 kv_cache: PagedKVCache | None = None):
        """The engine's model: `model` (built for this engine's boundary), or one built over the parameters of
        `weights` (a model of any boundary: engines that compare boundaries share one copy of the weights), or
        dummy weights drawn from engine_config.seed. `kv_cache`: share a cache between engines that run one
        after another (each keeps its own block allocator; a step is refused while another engine on the cache holds
        live sequences)."""
        self.config, self.ec = config, EngineConfig() if engine_config is None else engine_config
        self.device = _check_placement(config, self.ec, device, dtype)
        for name, m in (("model", model), ("weights", weights)):
            if m is not None and not isinstance(m, EngineModel):
                raise ValueError(f"LLMEngine: {name}: expected an EngineModel (dsv32ref.engine.from_reference, "
                                 f"build_model, load_pretrained), got {type(m).__name__}")
            if m is not None and dataclasses.replace(m.config, name=config.name) != config:  # (names may differ)
                raise ValueError(f"LLMEngine: {name} was built for another ModelConfig than `config` (fields that "
                                 f"differ: {_differing(m.config, config)})")
        if model is None:
            model = share_weights(weights, self.ec.boundary, self.ec.moe) if weights is not None else \
                build_model(config, self.ec.boundary, self.device, dtype, self.ec.seed, self.ec.moe)
        elif model.moe != self.ec.moe:
            raise ValueError(f"model: built with moe={model.moe!r}, the engine config says moe={self.ec.moe!r}")
        self.model = model
        self.runner = ModelRunner(config, self.ec, model, self.device, dtype, kv_cache)
        self.allocator = BlockAllocator(self.runner.kv_cache.num_blocks, self.ec.block_size)
        self.runner.kv_cache.allocators.add(self.allocator)
        self.last_logits: torch.Tensor | None = None
        self._next_seq = 0
        self._staged: dict[int, tuple[int | None, int]] = {}  # the last stage()'s sequences, as they were before

    def capture(self, on_failure=None) -> float:
        """Capture the graphs (see ModelRunner.capture); returns seconds taken."""
        return self.runner.capture(on_failure)

    def release_graphs(self) -> None:
        self.runner.graphs.release()

    def stage(self, step: StepInput) -> PreparedStep:
        """Check a step against the engine's limits, grow each sequence's blocks and write its metadata into
        the pinned staging buffers: host work only."""
        self._staged = {}  # (a refused stage leaves nothing for unstage to undo)
        if not isinstance(step, StepInput):
            raise ValueError(f"step: expected a StepInput, got {type(step).__name__}")
        ec, V = self.ec, self.config.vocab_size
        if len(step.requests) > ec.max_num_seqs:
            raise ValueError(f"StepInput.requests: {len(step.requests)} requests in one step, max_num_seqs is "
                             f"{ec.max_num_seqs}")
        if step.num_tokens > ec.max_num_batched_tokens:  # the token budget (a capture size past it pads decode)
            raise ValueError(f"step of {step.num_tokens} tokens exceeds max_num_batched_tokens="
                             f"{ec.max_num_batched_tokens}")
        for b, (seq_id, toks, ctx_len) in enumerate(step.requests):
            if ctx_len + len(toks) > ec.max_model_len:
                raise ValueError(f"StepInput.requests[{b}]: sequence {seq_id} would hold {ctx_len + len(toks)} tokens "
                                 f"(context {ctx_len} + {len(toks)} new), max_model_len is {ec.max_model_len}")
            held = self.allocator.held.get(seq_id, 0)
            if ctx_len != held:  # the attention would read cache rows no step wrote, or skip written ones
                raise ValueError(f"StepInput.requests[{b}]: sequence {seq_id} holds {held} cached tokens, got "
                                 f"context_len {ctx_len} (a sequence's steps follow one another from 0)")
            bad = [t for t in toks if not 0 <= t < V]
            if bad:
                raise ValueError(f"StepInput.requests[{b}].token_ids: ids must lie in [0, {V}) (vocab_size), "
                                 f"got {bad[:4]}")
        others = [a for a in self.runner.kv_cache.allocators if a is not self.allocator and a.tables]
        if others:  # its blocks would overwrite theirs: engines on one cache take turns
            busy = sorted(seq for a in others for seq in a.tables)
            raise ValueError(f"kv_cache: another engine on this cache holds live sequences {busy[:4]}: release them "
                             f"(its allocator.release) before this engine runs a step")
        need = sum(self.allocator.blocks_needed(seq_id, ctx_len + len(toks)) for seq_id, toks, ctx_len in step.requests)
        if need > len(self.allocator.free):  # refused before any block moves: the engine is as it was
            raise ValueError(f"StepInput.requests: the step needs {need} more cache blocks of {ec.block_size} tokens, "
                             f"{len(self.allocator.free)} are free (release finished sequences)")
        self._staged = {seq_id: self.allocator.state(seq_id) for seq_id, _, _ in step.requests}
        try:
            tables = [self.allocator.assume(seq_id, ctx_len + len(toks)) for seq_id, toks, ctx_len in step.requests]
            return self.runner.batch.stage(step, tables, self.runner.kv_cache.num_blocks)
        except BaseException:
            self.unstage()
            raise

    @contextlib.contextmanager
    def staged(self, step: StepInput):
        """stage(step) for code that runs a step's parts itself (upload, execute, sample: the experiments): yields the
        prepared step and releases its sequences on leaving, whatever happened in between. A refused stage
        releases nothing (the ids may be the caller's)."""
        prep = self.stage(step)
        try:
            yield prep
        finally:
            for seq_id, _, _ in step.requests:
                self.allocator.release(seq_id)

    def unstage(self) -> None:
        """Undo the last stage() when its step does not run (its forward raised, or the caller gave it up): its
        sequences hold the tokens and blocks they held before, so that no later step reads rows it never wrote.
        step() does this itself; code that calls stage() and the runner's execute should on failure. A step that
        ran, or a stage() that was refused, leaves nothing to undo."""
        for seq_id, state in self._staged.items():
            self.allocator.restore(seq_id, state)
        self._staged = {}

    def upload(self) -> None:
        """The staged metadata to the device (two asynchronous copies)."""
        self.runner.batch.upload()

    def execute(self, prep: PreparedStep) -> tuple[str, torch.Tensor]:
        return self.runner.execute(prep)

    def sample(self, prep: PreparedStep, hidden: torch.Tensor) -> list[int]:
        """Greedy sampling after the graph: logits of each request's last row (kept in last_logits), argmax,
        read back to the host (the step's one sync)."""
        rows = self.runner.batch.logits_indices[: prep.plan.num_reqs]
        self.last_logits = self.model.compute_logits(hidden[rows])
        return self.last_logits.argmax(-1).tolist()

    @torch.no_grad()
    def step(self, step: StepInput) -> tuple[list[int], str]:
        """Run one step; returns (the next token of each request, how it ran: FULL / PIECEWISE / NONE)."""
        prep = self.stage(step)
        try:
            self.upload()
            how, hidden = self.execute(prep)
            tokens = self.sample(prep, hidden)
        except BaseException:  # (an interrupt too) the step did not happen: nothing it staged stays
            self.unstage()
            raise
        self._staged = {}  # it ran: nothing to undo
        return tokens, how

    def generate(self, prompt: list[int], max_new_tokens: int = 1) -> tuple[list[int], float]:
        """One request alone: prefill (chunked: steps of at most max_num_batched_tokens, each over the cache the
        earlier ones wrote; the first token comes from the last), then greedy decode. Returns (new tokens, time
        to first token in s)."""
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompt: expected a non-empty list of token ids, got {prompt!r}")
        V = self.config.vocab_size
        bad = next((i for i, t in enumerate(prompt) if not is_int(t) or not 0 <= t < V), None)
        if bad is not None:  # before any chunk is prefilled
            raise ValueError(f"prompt[{bad}]: expected a token id, an int in [0, {V}) (vocab_size), got "
                             f"{shown(prompt[bad])}")
        if len(prompt) + max_new_tokens - 1 > self.ec.max_model_len:
            raise ValueError(f"prompt: {len(prompt)} tokens + {max_new_tokens - 1} decoded ones exceed max_model_len="
                             f"{self.ec.max_model_len}")
        while self._next_seq in self.allocator.tables:  # an id a caller's own steps hold: not this request's
            self._next_seq += 1
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        chunk = self.ec.max_num_batched_tokens
        try:
            t0 = time.perf_counter()
            for c0 in range(0, len(prompt), chunk):
                (tok,), _ = self.step(StepInput([(seq_id, list(prompt[c0:c0 + chunk]), c0)]))
            ttft = time.perf_counter() - t0  # .tolist() in step() synchronised with the GPU
            out = [tok]
            for i in range(max_new_tokens - 1):
                (tok,), _ = self.step(StepInput([(seq_id, [tok], len(prompt) + i)]))
                out.append(tok)
        finally:
            self.allocator.release(seq_id)
        return out, ttft
