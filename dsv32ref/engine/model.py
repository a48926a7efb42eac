"""The serving-engine form of the model: fused projections, Triton kernels, and one eager boundary.

The boundary (dsv32ref.engine.boundary) decides what runs eagerly between graph segments under PIECEWISE
capture and who owns the attention's latent output; `EngineDSAAttention.forward` reads its description and
nothing else. A model is built for one boundary; engines that compare boundaries on the same weights build one
model each over the same parameter tensors (`dsv32ref.engine.weights.share_weights`).

`ForwardContext.skip_topk` (set by the engine when every request of the step has at most index_topk keys, if
EngineConfig.skip_short_topk): the top-k would keep every visible key, so the indexer's scoring and selection
are replaced by the causal index list they would produce (0..position, -1 padded). The indexer keys are still
written to the cache by the graph-safe part. Read by Python at run time only: graphs are captured without it,
so a replayed graph always runs the indexer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dsv32ref.checks import check_int, is_int
from dsv32ref.config import ModelConfig
from dsv32ref.engine.boundary import FUSED_ATTENTION, SPARSE_INDEXER_AND_ATTN, Boundary, StaticOutputs, get_boundary
from dsv32ref.engine.config import MOE_IMPLS
from dsv32ref.engine.context import ForwardContext, current_forward_context, get_forward_context
from dsv32ref.graphs.breakable import eager_break
from dsv32ref.instrument import region
from dsv32ref.kernels import (add_rms_norm, fused_norm_rope, fused_q, indexer_scores_paged, sparse_mla_paged,
                              topk_from_scores)
from dsv32ref.kernels.fused_moe import fused_moe
from dsv32ref.kernels.skinny_gemm import skinny_gemm
from dsv32ref.kernels.sparse_mla import FEW_KEYS
from dsv32ref.reference.moe import Router

__all__ = ["EngineDSAAttention", "EngineModel", "TensorParallel", "a_split", "causal_topk"]


class TensorParallel:
    """Where this rank sits: heads and MLP columns split `size` ways, experts split `size` ways (EP = TP
    here), partial sums combined by an all-reduce over `group` (torch.distributed: NCCL or gloo)."""

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        check_int("TensorParallel.size", size, low=1)
        if not is_int(rank) or not 0 <= rank < size:
            raise ValueError(f"TensorParallel.rank: expected an int in [0, {size}) (size {size}), got {rank!r}")
        self.rank, self.size, self.group = rank, size, group

    def split(self, name: str, total: int) -> int:
        """This rank's share of `total` (heads, experts, MLP columns); ValueError unless it divides evenly."""
        if total % self.size:
            raise ValueError(f"{name}={total} is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def check(self, config: ModelConfig) -> None:
        """ValueError unless each of config's splits divides evenly (heads, experts, MLP columns)."""
        self.split("num_attention_heads", config.num_attention_heads)
        self.split("n_routed_experts", config.n_routed_experts)
        self.split("moe_intermediate_size x n_shared_experts", config.moe_intermediate_size * config.n_shared_experts)
        self.split("intermediate_size", config.intermediate_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            with region("all_reduce"):
                torch.distributed.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()


def causal_topk(positions: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """topk [T, K] <- j where j <= positions[t], else -1: the indices a top-k returns when every visible key is
    kept (increasing, -1 padded), without scores. Four small launches, no host sync."""
    iota = torch.arange(topk.shape[1], dtype=topk.dtype, device=topk.device)  # (K,)
    return topk.copy_(torch.where(iota[None, :] <= positions[:, None], iota[None, :], -1))  # (T, K)


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


SKINNY_ROWS = 16  # EngineConfig.gemm "skinny": steps of at most this many tokens take skinny_gemm


def _skinny(x: torch.Tensor) -> ForwardContext | None:
    """The step's context where its projections take skinny_gemm (EngineConfig.gemm "skinny", at most SKINNY_ROWS
    tokens), else None (also outside a step: a module called on its own takes torch's GEMMs)."""
    ctx = current_forward_context()
    return ctx if ctx is not None and ctx.gemm == "skinny" and x.shape[-2] <= SKINNY_ROWS else None


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (x [T, K], w [N, K]), or skinny_gemm, K split over the step's counters, where the step asks
    for it (EngineConfig.gemm)."""
    ctx = _skinny(x)
    if ctx is None:
        return F.linear(x, w)
    out = x.new_empty(x.shape[0], w.shape[0])
    return skinny_gemm(x, w, out, counters=ctx.gemm_counters, num_sms=ctx.num_sms)


def per_head(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = torch.bmm(x, w) (x [H, T, K], w stored [H, K, N], out [H, T, N], any strides), or skinny_gemm over w's
    [H, N, K] view where the step asks for it."""
    ctx = _skinny(x)
    if ctx is None:
        return torch.bmm(x, w, out=out)
    return skinny_gemm(x, w.transpose(1, 2), out, counters=ctx.gemm_counters, num_sms=ctx.num_sms)


def a_split(config: ModelConfig, has_indexer: bool) -> list[int]:
    """The rows of fused_qkv_a_proj, part by part. The indexer's key and weight projections read the hidden state
    as the A-projections do, so a layer that runs its indexer has them in the same GEMM: [q_a_proj ;
    kv_a_proj_with_mqa ; indexer wk ; indexer weights_proj], otherwise the first two."""
    c = config
    return [c.q_lora_rank, c.latent_dim] + ([c.index_head_dim, c.index_n_heads] if has_indexer else [])


class EngineDSAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, boundary: Boundary, outputs: StaticOutputs,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        c = config
        self.config, self.layer_idx, self.boundary, self.outputs, self.tp = c, layer_idx, boundary, outputs, tp
        self.H = tp.split("num_attention_heads", c.num_attention_heads)  # this rank's heads
        self.nope, self.rope, self.v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.q_lora, self.kv_lora = c.q_lora_rank, c.kv_lora_rank
        self.has_indexer = c.runs_indexer(layer_idx)
        self.H_I, self.D_I = c.index_n_heads, c.index_head_dim
        self.a_split = a_split(c, self.has_indexer)
        self.fused_qkv_a_proj = _param(sum(self.a_split), c.hidden_size)
        self.q_a_layernorm = _param(c.q_lora_rank)
        self.kv_a_layernorm = _param(c.kv_lora_rank)
        self.q_b_proj = _param(self.H * c.qk_head_dim, c.q_lora_rank)
        self.W_UK = _param(self.H, c.qk_nope_head_dim, c.kv_lora_rank)
        self.W_UV = _param(self.H, c.kv_lora_rank, c.v_head_dim)  # stored [H, lora, v] for bmm
        self.o_proj = _param(c.hidden_size, self.H * c.v_head_dim)
        if self.has_indexer:
            self.wq_b = _param(c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            self.k_norm_weight = _param(c.index_head_dim)
            self.k_norm_bias = _param(c.index_head_dim)

    # ---- the graph-safe part ------------------------------------------------------------------------
    def _a_proj(self, x):
        """x [T, hidden] -> q_c_raw [T, q_lora], kv [T, kv_lora + rope], and for layers that run their indexer
        the raw indexer key k_raw [T, D_I] and weights w_raw [T, H_I]; None otherwise. Views of one GEMM's output."""
        with region("a_proj"):
            parts = project(x, self.fused_qkv_a_proj).split(self.a_split, dim=-1)
        return parts if self.has_indexer else (*parts, None, None)

    def _prepare(self, q_c_raw, kv, k_raw, w_raw):
        """Norms, RoPE, cache writes, q_b GEMM, W_UK BMM, indexer wq_b GEMM, fused-Q. Returns the MQA query
        [T, H, 576], the indexer query [T, H_I, D_I] and weights [T, H_I] (None on IndexShare layers)."""
        ctx = get_forward_context()
        T = q_c_raw.shape[0]
        cache = ctx.kv_cache
        q_c = torch.empty_like(q_c_raw)
        with region("norm_rope"):
            fused_norm_rope(q_c_raw, self.q_a_layernorm, q_c, kv, self.kv_a_layernorm, cache.latent[self.layer_idx],
                            ctx.positions, ctx.slot_mapping, ctx.cos, ctx.sin, self.config.rms_norm_eps,
                            k_raw, getattr(self, "k_norm_weight", None), getattr(self, "k_norm_bias", None),
                            cache.indexer_k[self.layer_idx], self.config.indexer_rope_interleave)
        with region("q_gemm"):
            q = project(q_c, self.q_b_proj).view(T, self.H, self.nope + self.rope)  # (T, H, nope + rope)
        with region("wuk_bmm"):
            q_lat = per_head(q[..., : self.nope].transpose(0, 1), self.W_UK,
                             q.new_empty(self.H, T, self.kv_lora)).transpose(0, 1)  # (T, H, kv_lora) view
        q_mqa = q.new_empty(T, self.H, self.kv_lora + self.rope)
        if not self.has_indexer:
            with region("fused_q"):
                fused_q(q_lat, q, q_mqa, ctx.positions, ctx.cos, ctx.sin)
            return q_mqa, None, None
        with region("q_gemm"):
            q_i_raw = project(q_c, self.wq_b).view(T, self.H_I, self.D_I)  # (T, H_I, D_I)
        # over FP8 keys the indexer's queries are fp8 too, rotated as the keys are (fused_q, fused_norm_rope)
        fp8_keys = cache.indexer_k[self.layer_idx].dtype == torch.uint8
        q_idx = torch.empty_like(q_i_raw, dtype=torch.float8_e4m3fn if fp8_keys else None)
        w_idx = torch.empty_like(w_raw, dtype=torch.float32)
        with region("fused_q"):
            fused_q(q_lat, q, q_mqa, ctx.positions, ctx.cos, ctx.sin, q_i_raw, q_idx, w_raw, w_idx,
                    self.config.indexer_rope_interleave)
        return q_mqa, q_idx, w_idx

    def _uv(self, o_lat, out):
        """out [T, H * v] <- per head W_UV o_lat: (H, T, lora) x (H, lora, v) -> (H, T, v)."""
        T = o_lat.shape[0]
        with region("uv_bmm"):
            per_head(o_lat.transpose(0, 1), self.W_UV, out.view(T, self.H, self.v).transpose(0, 1))

    # ---- the sparse path (host metadata: eager under PIECEWISE, unless the boundary has no eager region) ---
    def _indexer_and_attention(self, q_mqa, q_idx, w_idx, o_lat):
        """Top-k (or the shared one) and sparse attention into o_lat [T, H, kv_lora]."""
        ctx = get_forward_context()
        if self.has_indexer and ctx.skip_topk:
            with region("indexer"):  # every key is kept: top-k = 0..position, -1 padded (what selection returns)
                causal_topk(ctx.positions, ctx.topk)
        if ctx.uniform_decode or self.boundary.graph_safe_prefill:
            self._graph_safe_sparse(q_mqa, q_idx, w_idx, o_lat)
        else:
            self._per_request_sparse(q_mqa, q_idx, w_idx, o_lat)

    def _graph_safe_sparse(self, q_mqa, q_idx, w_idx, o_lat):
        """One launch each over the whole batch, static workspace, device metadata."""
        ctx = get_forward_context()
        cache = ctx.kv_cache
        if self.has_indexer and not ctx.skip_topk:
            with region("indexer"):
                # a decode batch: each token its own request's keys, nothing for a token group to share
                indexer_scores_paged(q_idx, w_idx, cache.indexer_k[self.layer_idx], ctx.block_table,
                                     ctx.req_indices, ctx.positions, self.D_I ** -0.5, ctx.scores,
                                     tokens=1 if ctx.uniform_decode else None, num_sms=ctx.num_sms)
                topk_from_scores(ctx.scores, ctx.positions, ctx.topk)
        # Here a step is a decode step unless the boundary has no eager region, whose FULL graphs (captured once a
        # size) serve prefill steps too. The few-keys launch is for short prompts: at decode only a request's first
        # steps would gain from it, and every step would pay its launch.
        with region("attention"):
            sparse_mla_paged(q_mqa, cache.latent[self.layer_idx], ctx.block_table, ctx.req_indices, ctx.seq_lens,
                             ctx.topk, self.config.softmax_scale, o_lat, valid_first=True, num_sms=ctx.num_sms,
                             few_keys=self.boundary.graph_safe_prefill)

    def _per_request_sparse(self, q_mqa, q_idx, w_idx, o_lat):
        """Prefill / mixed steps, work split per request on the host. These lines are what cannot be captured:
        the loop bounds and slices come from host metadata, and the score buffer is sized by each request's
        total length, so a graph would bake one step's shapes into every replay."""
        ctx = get_forward_context()
        cache, qsl = ctx.kv_cache, ctx.query_start_loc_cpu
        for b in range(ctx.num_reqs):
            t0, t1 = qsl[b], qsl[b + 1]
            if self.has_indexer and not ctx.skip_topk:
                with region("indexer"):
                    scores = torch.empty(t1 - t0, ctx.seq_lens_cpu[b], dtype=torch.float32, device=q_mqa.device)
                    indexer_scores_paged(q_idx[t0:t1], w_idx[t0:t1], cache.indexer_k[self.layer_idx], ctx.block_table,
                                         ctx.req_indices[t0:t1], ctx.positions[t0:t1], self.D_I ** -0.5, scores,
                                         num_sms=ctx.num_sms)
                    topk_from_scores(scores, ctx.positions[t0:t1], ctx.topk[t0:t1])
            with region("attention"):  # valid first: the request's keys are in its first seq_len slots
                n = ctx.seq_lens_cpu[b]
                sparse_mla_paged(q_mqa[t0:t1], cache.latent[self.layer_idx], ctx.block_table, ctx.req_indices[t0:t1],
                                 ctx.seq_lens, ctx.topk[t0:t1, :n], self.config.softmax_scale, o_lat[t0:t1],
                                 valid_first=True, num_sms=ctx.num_sms, few_keys=n <= FEW_KEYS)

    @eager_break(name=FUSED_ATTENTION)
    def _fused_attention(self, q_c_raw, kv, k_raw, w_raw, out):
        """wide: everything after the A-projections, eager; out [T, H * v]."""
        q_mqa, q_idx, w_idx = self._prepare(q_c_raw, kv, k_raw, w_raw)
        o_lat = q_mqa.new_empty(q_mqa.shape[0], self.H, self.kv_lora)
        self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
        self._uv(o_lat, out)
        return out

    @eager_break(name=SPARSE_INDEXER_AND_ATTN)
    def _sparse_indexer_and_attn(self, q_mqa, q_idx, w_idx, dest):
        """The narrow boundaries' eager region. dest: `out` [T, H * v] where the region owns the latent output
        (then the UV BMM runs here), else the latent output's destination [T, H, kv_lora]: a static buffer to
        copy into, or the graph-owned activation to write."""
        b = self.boundary
        o_lat = dest if b.output == "graph" else q_mqa.new_empty(q_mqa.shape[0], self.H, self.kv_lora)
        self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
        if b.copies_output:
            with region("copy"):
                dest.copy_(o_lat)
        elif b.uv_in_region:
            self._uv(o_lat, dest)
        return dest

    def _latent_output(self, x):
        """Where the latent output o_lat [T, H, kv_lora] lives outside the eager region: None where the region
        owns it, a static buffer for the copy boundaries, else a graph-owned activation."""
        output = self.boundary.output
        if output == "region":
            return None
        if output == "graph":
            return x.new_empty(x.shape[0], self.H, self.kv_lora)
        return self.outputs.target(self.layer_idx, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q_c_raw, kv, k_raw, w_raw = self._a_proj(x)
        out = x.new_empty(x.shape[0], self.H * self.v)
        if self.boundary.eager == FUSED_ATTENTION:
            self._fused_attention(q_c_raw, kv, k_raw, w_raw, out)
        else:
            q_mqa, q_idx, w_idx = self._prepare(q_c_raw, kv, k_raw, w_raw)
            o_lat = self._latent_output(x)
            if self.boundary.eager is None:  # graph-safe throughout: nothing leaves the graph
                self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
            else:
                self._sparse_indexer_and_attn(q_mqa, q_idx, w_idx, out if o_lat is None else o_lat)
            if not self.boundary.uv_in_region:
                self._uv(o_lat, out)
        with region("o_proj"):
            o = project(out, self.o_proj)
        return self.tp.all_reduce(o)  # o_proj is row-parallel: each rank holds its heads' share


class EngineMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = _param(2 * inter, hidden)
        self.down_proj = _param(hidden, inter)

    def forward(self, x):
        gate, up = project(x, self.gate_up_proj).chunk(2, dim=-1)
        return project(F.silu(gate) * up, self.down_proj)  # a partial sum when the columns are sharded


class EngineMoE(nn.Module):
    """Graph-safe MoE, no host sync, in one of two forms (MOE_IMPLS). "dense": the reference's router
    (dsv32ref.reference.moe.Router: the same `route`, fp32 weights), then every expert of this rank on every token,
    combined with the routing weights (zero for unselected experts), in PyTorch ops: for a reduced expert count.
    "fused": dsv32ref.kernels.fused_moe, the router and grouped GEMMs over the tokens each expert received, the
    shared expert among them, in six launches (five at steps of at most 16 tokens)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE, impl: str = "dense"):
        super().__init__()
        c = config
        if impl not in MOE_IMPLS:
            raise ValueError(f"EngineMoE: impl expected one of {MOE_IMPLS}, got {impl!r}")
        self.config, self.impl = c, impl
        self.gate = Router(c)  # gate.weight [E, hidden], gate.e_score_correction_bias [E], both kept in fp32
        self.n_local = tp.split("n_routed_experts", c.n_routed_experts)
        self.expert0 = tp.rank * self.n_local
        self.w13 = _param(self.n_local, 2 * c.moe_intermediate_size, c.hidden_size)
        self.w2 = _param(self.n_local, c.hidden_size, c.moe_intermediate_size)
        shared = tp.split("moe_intermediate_size x n_shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        self.shared = EngineMLP(c.hidden_size, shared) if c.n_shared_experts else None

    def forward(self, x):
        if self.impl == "fused":
            out = torch.empty_like(x)
            shared = None if self.shared is None else (self.shared.gate_up_proj, self.shared.down_proj)
            ctx = current_forward_context()
            fused_moe(self.config, x, self.gate.weight, self.gate.e_score_correction_bias, self.w13, self.w2, shared,
                      out, expert0=self.expert0, num_sms=ctx.num_sms if ctx is not None else None)
            return out
        ids, w = self.gate(x)  # (T, k), (T, k)
        dense_w = torch.zeros(x.shape[0], self.config.n_routed_experts, dtype=w.dtype, device=x.device)
        dense_w.scatter_(1, ids, w)  # (T, E)
        if self.n_local != self.config.n_routed_experts:  # expert parallel: this rank's experts only
            dense_w = dense_w[:, self.expert0: self.expert0 + self.n_local]
        h = torch.einsum("th,eih->eti", x, self.w13)  # (E, T, 2 * inter)
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.w2)  # (E, T, hidden)
        out = torch.einsum("te,eth->th", dense_w.to(x.dtype), y)
        return out + self.shared(x) if self.shared is not None else out


class EngineLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, boundary: Boundary, outputs: StaticOutputs,
                 tp: TensorParallel, moe: str = "dense"):
        super().__init__()
        self.input_layernorm = _param(config.hidden_size)
        self.post_attention_layernorm = _param(config.hidden_size)
        self.eps, self.tp = config.rms_norm_eps, tp
        self.self_attn = EngineDSAAttention(config, layer_idx, boundary, outputs, tp)
        if config.is_moe_layer(layer_idx):
            self.mlp = EngineMoE(config, tp, moe)
        else:
            self.mlp = EngineMLP(config.hidden_size, tp.split("intermediate_size", config.intermediate_size))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's output, residual: the stream before it (None at layer 0) -> the same pair for
        the next layer (vLLM's form: each residual add is fused into the norm after it)."""
        x, residual = self._add_norm(h, residual, self.input_layernorm)
        x, residual = self._add_norm(self.self_attn(x), residual, self.post_attention_layernorm)
        with region("moe" if isinstance(self.mlp, EngineMoE) else "mlp"):
            y = self.mlp(x)
        return self.tp.all_reduce(y), residual  # experts / MLP columns are sharded across ranks

    def _add_norm(self, h, residual, weight):
        """(RMSNorm(h + residual), h + residual), one launch."""
        with region("layer_norm"):
            x, residual_out = torch.empty_like(h), torch.empty_like(h)
            add_rms_norm(h, residual, weight, self.eps, x, residual_out)
        return x, residual_out


class EngineModel(nn.Module):
    """Embedding, decoder layers, final norm, lm_head on each request's last token; built for one boundary
    (a name of dsv32ref.engine.boundary.BOUNDARIES) and one tensor-parallel rank."""

    def __init__(self, config: ModelConfig, boundary="narrow", tp: TensorParallel = SINGLE, moe: str = "dense"):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"EngineModel: config: expected a ModelConfig, got {type(config).__name__}")
        if not isinstance(tp, TensorParallel):
            raise ValueError(f"EngineModel: tp: expected a TensorParallel (rank, size), got {type(tp).__name__}")
        self.config, self.boundary, self.tp, self.moe = config, get_boundary(boundary), tp, moe
        self.static_outputs = StaticOutputs(self.boundary, tp.split("num_attention_heads", config.num_attention_heads),
                                            config.kv_lora_rank)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(EngineLayer(config, i, self.boundary, self.static_outputs, tp, moe)
                                    for i in range(config.num_hidden_layers))
        self.norm = _param(config.hidden_size)
        self.lm_head = _param(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> hidden states [N, hidden] before the final norm (what a graph captures)."""
        with region("embed"):
            h = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual)
        with region("residual"):
            return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (the rows to sample from) -> logits [n, vocab] fp32; eager, after the graph."""
        return F.linear(F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps),
                        self.lm_head).float()
