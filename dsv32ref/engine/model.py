"""The serving-engine form of the model: fused projections, Triton kernels, and a choice of eager boundary.

The attention's `boundary` decides what runs eagerly between graph segments under PIECEWISE capture:

    wide          everything after the A-projections is one eager region (norm/RoPE, q_b GEMM, W_UK BMM,
                  indexer wq_b GEMM, fused-Q, indexer, attention, UV BMM): the engine before the change
    narrow        only the indexer, the attention and the UV BMM are eager; the attention output is
                  allocated inside the region and consumed there by the UV BMM, no copy: the change
    narrow_copy   the attention output is copied into a static buffer, so the UV BMM is captured: the
                  alternative the change rejected. "Static" read as the layer keeping one buffer per token
                  count it has run (created on first use, so each captured size replays at a stable
                  address): the reading whose cost the start-up memory experiment measures
    narrow_copy_shared  the same copy into ONE static buffer shared by every layer and sized for the
                  largest step (layers run one after another, and the UV BMM consumes the buffer before the
                  next layer's attention writes it): the copy variant made safe
    narrow_out    the attention kernel writes straight into a graph-owned activation buffer, UV BMM
                  captured, no copy: the follow-up the change's authors asked for (forward_mqa with `out`)
    none          no eager break: prefill and mixed batches take the graph-safe path that uniform decode
                  takes (indexer scores into the engine's static [tokens, max_model_len] workspace, one top-k
                  and one sparse-attention launch per layer over the whole batch, lengths and block tables
                  read on the device), so FULL graphs capture every step of a captured size, prefill included

All six compute the same function. Under FULL capture (uniform decode) every region is captured.

`ForwardContext.skip_topk` (set by the engine when every request of the step has at most index_topk keys,
if EngineConfig.skip_short_topk): the top-k would keep every visible key, so the indexer's scoring and
selection are replaced by the causal index list they would produce (0..position, -1 padded). The indexer
keys are still written to the cache by the graph-safe part. Read by Python at run time only: graphs are
captured without it, so a replayed graph always runs the indexer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dsv32ref.config import ModelConfig
from dsv32ref.engine.context import get_forward_context
from dsv32ref.instrument import region
from dsv32ref.reference.moe import Router
from dsv32ref.graphs.breakable import eager_break, graph_split
from dsv32ref.kernels import fused_norm_rope, fused_q, indexer_scores_paged, sparse_mla_paged, topk_from_scores

BOUNDARIES = ("wide", "narrow", "narrow_copy", "narrow_copy_shared", "narrow_out", "none")
COPY_BOUNDARIES = ("narrow_copy", "narrow_copy_shared")


class TensorParallel:
    """Where this rank sits: heads and MLP columns split `size` ways, experts split `size` ways (EP = TP
    here), partial sums combined by an all-reduce over `group` (torch.distributed: NCCL or gloo)."""

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        self.rank, self.size, self.group = rank, size, group

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


class EngineDSAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, boundary: str = "narrow"):
        super().__init__()
        if boundary not in BOUNDARIES:
            raise ValueError(f"boundary: expected one of {BOUNDARIES}, got {boundary!r}")
        c = config
        self.config, self.layer_idx, self.boundary = c, layer_idx, boundary
        self.tp = SINGLE
        self.H, self.nope, self.rope, self.v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.q_lora, self.kv_lora = c.q_lora_rank, c.kv_lora_rank
        self.fused_qkv_a_proj = _param(c.q_lora_rank + c.latent_dim, c.hidden_size)  # [q_a_proj ; kv_a_proj_with_mqa]
        self.q_a_layernorm = _param(c.q_lora_rank)
        self.kv_a_layernorm = _param(c.kv_lora_rank)
        self.q_b_proj = _param(c.num_attention_heads * c.qk_head_dim, c.q_lora_rank)
        self.W_UK = _param(c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank)
        self.W_UV = _param(c.num_attention_heads, c.kv_lora_rank, c.v_head_dim)  # stored [H, lora, v] for bmm
        self.o_proj = _param(c.hidden_size, c.num_attention_heads * c.v_head_dim)
        self.has_indexer = c.runs_indexer(layer_idx)
        if self.has_indexer:
            self.H_I, self.D_I = c.index_n_heads, c.index_head_dim
            self.wq_b = _param(c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            self.wk_weights_proj = _param(c.index_head_dim + c.index_n_heads, c.hidden_size)  # [wk ; weights_proj]
            self.k_norm_weight = _param(c.index_head_dim)
            self.k_norm_bias = _param(c.index_head_dim)
        self.static_out: dict[int, torch.Tensor] = {}  # narrow_copy: token count -> [T, H, kv_lora] buffer
        self.shared_out: torch.Tensor | None = None  # narrow_copy_shared: [max_tokens, H, kv_lora], all layers

    def _copy_target(self, x: torch.Tensor) -> torch.Tensor:
        """The static buffer the copy variants copy the attention output into: [T, H, kv_lora]."""
        T = x.shape[0]
        if self.boundary == "narrow_copy_shared":
            if self.shared_out is None or self.shared_out.shape[0] < T:
                have = None if self.shared_out is None else list(self.shared_out.shape)
                raise ValueError(f"narrow_copy_shared: the shared copy buffer holds {have} but a step of {T} tokens "
                                 f"needs [{T}, {self.H}, {self.kv_lora}]; call EngineModel.reserve_copy_buffer(max_tokens)")
            return self.shared_out[:T]
        buf = self.static_out.get(T)
        if buf is None:  # kept by the layer from now on: one per token count, for the process's lifetime
            buf = self.static_out[T] = x.new_empty(T, self.H, self.kv_lora)
        return buf

    # ---- the graph-safe part ------------------------------------------------------------------------
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
            q = F.linear(q_c, self.q_b_proj).view(T, self.H, self.nope + self.rope)  # (T, H, nope + rope)
        with region("wuk_bmm"):
            q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), self.W_UK).transpose(0, 1)  # (T, H, kv_lora) view
        q_mqa = q.new_empty(T, self.H, self.kv_lora + self.rope)
        if self.has_indexer:
            with region("q_gemm"):
                q_i_raw = F.linear(q_c, self.wq_b).view(T, self.H_I, self.D_I)  # (T, H_I, D_I)
            q_idx, w_idx = torch.empty_like(q_i_raw), torch.empty_like(w_raw)
            with region("fused_q"):
                fused_q(q_lat, q, q_mqa, ctx.positions, ctx.cos, ctx.sin, q_i_raw, q_idx, w_raw, w_idx,
                        self.config.indexer_rope_interleave)
            return q_mqa, q_idx, w_idx
        with region("fused_q"):
            fused_q(q_lat, q, q_mqa, ctx.positions, ctx.cos, ctx.sin)
        return q_mqa, None, None

    def _uv(self, o_lat, out):
        """out [T, H * v] <- per head W_UV o_lat: (H, T, lora) x (H, lora, v) -> (H, T, v)."""
        T = o_lat.shape[0]
        with region("uv_bmm"):
            torch.bmm(o_lat.transpose(0, 1), self.W_UV, out=out.view(T, self.H, self.v).transpose(0, 1))

    # ---- the sparse path (host metadata: eager under PIECEWISE, unless boundary "none") ---------------
    def _indexer_and_attention(self, q_mqa, q_idx, w_idx, o_lat):
        """Top-k (or the shared one) and sparse attention into o_lat [T, H, kv_lora]."""
        ctx = get_forward_context()
        cache = ctx.kv_cache
        scale = self.config.softmax_scale
        if self.has_indexer and ctx.skip_topk:
            with region("indexer"):  # every key is kept: top-k = 0..position, -1 padded (what selection returns)
                causal_topk(ctx.positions, ctx.topk)
        if ctx.uniform_decode or self.boundary == "none":
            # Graph-safe: one launch each over the whole batch, static workspace, device metadata.
            if self.has_indexer and not ctx.skip_topk:
                with region("indexer"):
                    # a decode batch: each token its own request's keys, nothing for a token group to share
                    indexer_scores_paged(q_idx, w_idx, cache.indexer_k[self.layer_idx], ctx.block_table,
                                         ctx.req_indices, ctx.positions, self.D_I ** -0.5, ctx.scores,
                                         tokens=1 if ctx.uniform_decode else None)
                    topk_from_scores(ctx.scores, ctx.positions, ctx.topk)
            with region("attention"):
                sparse_mla_paged(q_mqa, cache.latent[self.layer_idx], ctx.block_table, ctx.req_indices, ctx.seq_lens,
                                 ctx.topk, scale, o_lat, valid_first=True, num_sms=ctx.num_sms)
            return
        # Prefill / mixed batches: work split per request on the host. These lines are what cannot be
        # captured: the loop bounds and slices come from host metadata, and the score buffer is sized by
        # each request's total length, so a graph would bake one step's shapes into every replay.
        qsl = ctx.query_start_loc_cpu
        for b in range(ctx.num_reqs):
            t0, t1 = qsl[b], qsl[b + 1]
            if self.has_indexer and not ctx.skip_topk:
                with region("indexer"):
                    scores = torch.empty(t1 - t0, ctx.seq_lens_cpu[b], dtype=torch.float32, device=q_mqa.device)
                    indexer_scores_paged(q_idx[t0:t1], w_idx[t0:t1], cache.indexer_k[self.layer_idx], ctx.block_table,
                                         ctx.req_indices[t0:t1], ctx.positions[t0:t1], self.D_I ** -0.5, scores)
                    topk_from_scores(scores, ctx.positions[t0:t1], ctx.topk[t0:t1])
            with region("attention"):
                sparse_mla_paged(q_mqa[t0:t1], cache.latent[self.layer_idx], ctx.block_table, ctx.req_indices[t0:t1],
                                 ctx.seq_lens, ctx.topk[t0:t1], scale, o_lat[t0:t1], valid_first=True,
                                 num_sms=ctx.num_sms)

    @eager_break(name="fused_attention (wide)")
    def _fused_attention(self, q_c_raw, kv, k_raw, w_raw, out):
        q_mqa, q_idx, w_idx = self._prepare(q_c_raw, kv, k_raw, w_raw)
        o_lat = q_mqa.new_empty(q_mqa.shape[0], self.H, self.kv_lora)
        self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
        self._uv(o_lat, out)
        return out

    @eager_break(name="sparse_indexer_and_attn (narrow)")
    def _sparse_indexer_and_attn(self, q_mqa, q_idx, w_idx, out):
        o_lat = q_mqa.new_empty(q_mqa.shape[0], self.H, self.kv_lora)  # backend-owned: consumed right here
        self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
        self._uv(o_lat, out)
        return out

    @eager_break(name="sparse_indexer_and_attn (copy)")
    def _sparse_indexer_and_attn_copy(self, q_mqa, q_idx, w_idx, o_static):
        o_lat = q_mqa.new_empty(q_mqa.shape[0], self.H, self.kv_lora)  # backend-owned
        self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
        with region("copy"):
            o_static.copy_(o_lat)
        return o_static

    @eager_break(name="sparse_indexer_and_attn (out)")
    def _sparse_indexer_and_attn_out(self, q_mqa, q_idx, w_idx, o_lat):
        self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
        return o_lat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        T = x.shape[0]
        with region("a_proj"):
            qkv = F.linear(x, self.fused_qkv_a_proj)
        q_c_raw, kv = qkv.split([self.q_lora, self.kv_lora + self.rope], dim=-1)
        k_raw = w_raw = None
        if self.has_indexer:
            with region("a_proj"):
                kw = F.linear(x, self.wk_weights_proj)
            with region("cast"):
                k_raw, w_raw = kw[:, : self.D_I], kw[:, self.D_I:].float()
        out = x.new_empty(T, self.H * self.v)
        if self.boundary == "wide":
            self._fused_attention(q_c_raw, kv, k_raw, w_raw, out)
        else:
            q_mqa, q_idx, w_idx = self._prepare(q_c_raw, kv, k_raw, w_raw)
            if self.boundary == "none":  # graph-safe throughout: nothing leaves the graph
                o_lat = x.new_empty(T, self.H, self.kv_lora)
                self._indexer_and_attention(q_mqa, q_idx, w_idx, o_lat)
                self._uv(o_lat, out)
            elif self.boundary == "narrow":
                self._sparse_indexer_and_attn(q_mqa, q_idx, w_idx, out)
            else:
                if self.boundary in COPY_BOUNDARIES:
                    o_lat = self._copy_target(x)  # static: per layer and size, or one for all layers
                    self._sparse_indexer_and_attn_copy(q_mqa, q_idx, w_idx, o_lat)
                else:
                    o_lat = x.new_empty(T, self.H, self.kv_lora)  # graph-owned activation
                    self._sparse_indexer_and_attn_out(q_mqa, q_idx, w_idx, o_lat)
                self._uv(o_lat, out)
        with region("o_proj"):
            o = F.linear(out, self.o_proj)
        return self.tp.all_reduce(o)  # o_proj is row-parallel: each rank holds its heads' share


class EngineMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = _param(2 * inter, hidden)
        self.down_proj = _param(hidden, inter)

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)  # a partial sum when the columns are sharded


class EngineMoE(nn.Module):
    """Graph-safe MoE: the reference's router (dsv32ref.reference.moe.Router: the same `route`, fp32 weights),
    then every expert on every token, combined with the routing weights (zero for unselected experts). No host
    sync; meant for a reduced expert count."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.config = c
        self.gate = Router(c)  # gate.weight [E, hidden], gate.e_score_correction_bias [E], both kept in fp32
        self.w13 = _param(c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size)
        self.w2 = _param(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared = EngineMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else None
        self.n_local, self.expert0 = c.n_routed_experts, 0

    def forward(self, x):
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
    def __init__(self, config: ModelConfig, layer_idx: int, boundary: str):
        super().__init__()
        self.input_layernorm = _param(config.hidden_size)
        self.post_attention_layernorm = _param(config.hidden_size)
        self.eps = config.rms_norm_eps
        self.self_attn = EngineDSAAttention(config, layer_idx, boundary)
        self.mlp = EngineMoE(config) if config.is_moe_layer(layer_idx) else EngineMLP(config.hidden_size, config.intermediate_size)

    def forward(self, h):
        with region("layer_norm"):
            x = F.rms_norm(h, (h.shape[-1],), self.input_layernorm, self.eps)
        h = h + self.self_attn(x)
        with region("layer_norm"):
            x = F.rms_norm(h, (h.shape[-1],), self.post_attention_layernorm, self.eps)
        with region("moe" if isinstance(self.mlp, EngineMoE) else "mlp"):
            y = self.mlp(x)
        return h + self.self_attn.tp.all_reduce(y)  # experts / MLP columns are sharded across ranks


class EngineModel(nn.Module):
    """Embedding, decoder layers, final norm, lm_head on each request's last token."""

    def __init__(self, config: ModelConfig, boundary: str = "narrow"):
        super().__init__()
        self.config, self.boundary = config, boundary
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(EngineLayer(config, i, boundary) for i in range(config.num_hidden_layers))
        self.norm = _param(config.hidden_size)
        self.lm_head = _param(config.vocab_size, config.hidden_size)

    def set_boundary(self, boundary: str) -> None:
        if boundary not in BOUNDARIES:
            raise ValueError(f"boundary: expected one of {BOUNDARIES}, got {boundary!r}")
        for layer in self.layers:
            layer.self_attn.boundary = boundary
        self.boundary = boundary

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> hidden states [N, hidden] before the final norm (what a graph captures)."""
        with region("embed"):
            h = F.embedding(input_ids, self.embed_tokens)
        splits = get_forward_context().graph_splits
        for i, layer in enumerate(self.layers):
            if i in splits:
                graph_split()  # a capture starts a new graph segment here (EngineConfig.split_graphs)
            h = layer(h)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (the rows to sample from) -> logits [n, vocab] fp32; eager, after the graph."""
        return F.linear(F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps), self.lm_head).float()

    # ---- weights and the copy variants' buffers: dsv32ref.engine.weights / copy_buffers ---------------------
    @classmethod
    def from_reference(cls, ref, boundary: str = "narrow") -> "EngineModel":
        from dsv32ref.engine.weights import from_reference

        return from_reference(ref, boundary)

    def shard(self, tp: TensorParallel) -> "EngineModel":
        from dsv32ref.engine.weights import shard

        return shard(self, tp)

    def init_dummy(self, seed: int = 0) -> "EngineModel":
        from dsv32ref.engine.weights import init_dummy

        return init_dummy(self, seed)

    def reserve_copy_buffer(self, max_tokens: int) -> torch.Tensor:
        from dsv32ref.engine.copy_buffers import reserve_copy_buffer

        return reserve_copy_buffer(self, max_tokens)

    def release_static_buffers(self, include_shared: bool = False) -> int:
        from dsv32ref.engine.copy_buffers import release_static_buffers

        return release_static_buffers(self, include_shared)

    def static_buffer_bytes(self) -> int:
        from dsv32ref.engine.copy_buffers import static_buffer_bytes

        return static_buffer_bytes(self)
