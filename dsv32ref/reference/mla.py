"""DeepSeek-V3.2 sparse MLA attention: projections, the paged latent cache, the indexer, sparse attention.

One token t, H heads (names as in the checkpoints and the serving engine):
    c_q  = RMSNorm(q_a_proj x)                      [q_lora_rank]
    q    = q_b_proj c_q -> per head [q_nope | q_pe]  [H, qk_nope + qk_rope]
    [c_kv | k_pe] = kv_a_proj_with_mqa x;  c_kv = RMSNorm(c_kv) [kv_lora_rank], k_pe [qk_rope], one head
    kv_b_proj rows per head: [W_UK (qk_nope rows) ; W_UV (v_head rows)] x kv_lora_rank

Two forms of the same function (choose with `form`):
    naive (MHA):     k_h = [W_UK_h c_kv ; k_pe], v_h = W_UV_h c_kv, softmax over the selected keys
    absorbed (MQA):  q~_h = W_UK_h^T q_nope_h (in latent space), score = tau (q~ . c_kv + q_pe . k_pe),
                     o_lat = sum p c_kv, o_h = W_UV_h o_lat                (what kernels run: d_qk 576, d_v 512)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv32ref.cache import AttentionMetadata, gather_tokens, write_tokens
from dsv32ref.checks import check_bool
from dsv32ref.config import ModelConfig
from dsv32ref.reference import fp8_cache
from dsv32ref.reference.indexer import Indexer, indexer_scores, topk_indices
from dsv32ref.reference.norms import RMSNorm
from dsv32ref.reference.numerics import QUANT_BLOCK, fp8_round_trip
from dsv32ref.reference.rope import apply_rope
from dsv32ref.reference.sparse_attention import sparse_mla

FORMS = ("absorbed", "naive")


@dataclass
class LayerCache:
    """One layer's views into the paged caches; index_k is None on IndexShare ("shared") layers. Each is a float
    cache or an FP8 one (uint8: dsv32ref.reference.fp8_cache), written quantised and read dequantised."""

    latent: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (FP8: 656 bytes)
    index_k: torch.Tensor | None  # [num_blocks, block_size, index_head_dim] (FP8: index_head_dim + 4 bytes)

    def write(self, slot_mapping: torch.Tensor, latent: torch.Tensor, index_k: torch.Tensor | None) -> None:
        fp8 = self.latent.dtype == torch.uint8
        (fp8_cache.write_latent if fp8 else write_tokens)(self.latent, slot_mapping, latent)
        if index_k is not None:
            fp8 = self.index_k.dtype == torch.uint8
            (fp8_cache.write_indexer_keys if fp8 else write_tokens)(self.index_k, slot_mapping, index_k)

    def latent_rows(self, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
        fp8 = self.latent.dtype == torch.uint8
        return (fp8_cache.gather_latent if fp8 else gather_tokens)(self.latent, block_table_row, seq_len)

    def index_keys(self, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
        fp8 = self.index_k.dtype == torch.uint8
        return (fp8_cache.gather_indexer_keys if fp8 else gather_tokens)(self.index_k, block_table_row, seq_len)


class DeepseekV32Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, form: str = "absorbed",
                 deployed_numerics: bool = False):
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
        check_bool("deployed_numerics", deployed_numerics)
        c = config
        self.config, self.layer_idx, self.form = c, layer_idx, form
        self.deployed_numerics = deployed_numerics
        self.num_heads = c.num_attention_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.softmax_scale = c.softmax_scale
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.indexer = Indexer(c, deployed_numerics) if c.runs_indexer(layer_idx) else None

    # W_UK / W_UV are views of kv_b_proj.weight, never separate parameters (one checkpoint tensor).
    def _kv_b(self) -> torch.Tensor:
        w = self.kv_b_proj.weight  # (H * (nope + v), kv_lora_rank)
        return w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    @property
    def W_UK(self) -> torch.Tensor:
        """[H, qk_nope_head_dim, kv_lora_rank]: k_nope_h = W_UK[h] @ c_kv."""
        return self._kv_b()[:, : self.qk_nope_head_dim]

    @property
    def W_UV(self) -> torch.Tensor:
        """[H, v_head_dim, kv_lora_rank]: v_h = W_UV[h] @ c_kv."""
        return self._kv_b()[:, self.qk_nope_head_dim:]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The graph-safe projections: x [T, hidden] -> q_c [T, q_lora], q_nope [T, H, nope],
        q_pe [T, H, rope] (roped), c_kv [T, kv_lora] (normed; fp8 round trip under deployed numerics),
        k_pe [T, rope] (roped)."""
        T = x.shape[0]
        q_c = self.q_a_layernorm(self.q_a_proj(x))  # (T, q_lora_rank)
        q = self.q_b_proj(q_c).view(T, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)  # (T, H, nope+rope)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, interleaved=True)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # (T, kv_lora_rank)
        k_pe = apply_rope(k_pe, cos, sin, interleaved=True)  # (T, qk_rope)
        if self.deployed_numerics:
            c_kv = fp8_round_trip(c_kv, block=min(QUANT_BLOCK, self.kv_lora_rank))
        return q_c, q_nope, q_pe, c_kv, k_pe

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
        prev_topk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], cos/sin [T, qk_rope/2] -> (out [T, hidden], topk_indices int32 [T, index_topk]).

        Writes this step's latent rows (and indexer keys) into `cache` at meta.slot_mapping first, then
        attends over each request's cached tokens. `prev_topk` is required on IndexShare layers.
        """
        T, H = x.shape[0], self.num_heads
        q_c, q_nope, q_pe, c_kv, k_pe = self.project(x, cos, sin)
        fp8_keys = self.indexer is not None and cache.index_k.dtype == torch.uint8
        k_idx = self.indexer.key(x, cos, sin, fp8_keys) if self.indexer is not None else None  # (T, D_I)
        cache.write(meta.slot_mapping, torch.cat((c_kv, k_pe), dim=-1), k_idx)  # (T, 576)

        # ---- indexer: this layer's own top-k, or the shared one ----
        if self.indexer is not None:
            q_idx = self.indexer.query(q_c, cos, sin, fp8_keys)  # (T, H_I, D_I)
            w_idx = self.indexer.weights(x)  # (T, H_I)
            topk = self._run_indexer(q_idx, w_idx, cache, meta)
        else:
            if prev_topk is None:
                raise ValueError(f"layer {self.layer_idx} shares its indexer: prev_topk is required")
            topk = prev_topk

        # ---- sparse attention, per request (host metadata decides the slices) ----
        o = x.new_empty(T, H, self.v_head_dim)  # (T, H, v)
        if self.form == "absorbed":
            # q~ = W_UK^T q_nope: (T, H, nope) x (H, nope, lora) -> (T, H, lora); MQA query [q~ | q_pe]
            q_lat = torch.einsum("thd,hdc->thc", q_nope, self.W_UK)
            q_mqa = torch.cat((q_lat, q_pe), dim=-1)  # (T, H, 576)
        for b in range(meta.num_reqs):
            t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
            kv = cache.latent_rows(meta.block_table[b], meta.seq_lens_cpu[b])  # (S, 576)
            if self.form == "absorbed":
                o_lat, _ = sparse_mla(q_mqa[t0:t1], kv.to(q_mqa.dtype), topk[t0:t1], self.softmax_scale, self.kv_lora_rank)
                o[t0:t1] = torch.einsum("thc,hvc->thv", o_lat, self.W_UV)  # W_UV o_lat
            else:
                o[t0:t1] = self._naive(q_nope[t0:t1], q_pe[t0:t1], kv.to(x.dtype), topk[t0:t1])
        return self.o_proj(o.reshape(T, H * self.v_head_dim)), topk  # (T, H*v) -> (T, hidden)

    def _run_indexer(self, q_idx, w_idx, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        topk = torch.full((q_idx.shape[0], self.config.index_topk), -1, dtype=torch.int32, device=q_idx.device)
        for b in range(meta.num_reqs):
            t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
            k_idx = cache.index_keys(meta.block_table[b], meta.seq_lens_cpu[b]).to(q_idx.dtype)  # (S, D_I)
            scores = indexer_scores(q_idx[t0:t1], k_idx, w_idx[t0:t1], self.indexer.softmax_scale)  # (n, S)
            topk[t0:t1] = topk_indices(scores, meta.positions[t0:t1], self.config.index_topk)
        return topk

    def _naive(self, q_nope, q_pe, kv, topk) -> torch.Tensor:
        """MHA over the selected tokens: up-project every cached latent to per-head k and v."""
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # (S, lora), (S, rope)
        k_nope = torch.einsum("sc,hdc->shd", c_kv, self.W_UK)  # (S, H, nope)
        v = torch.einsum("sc,hvc->shv", c_kv, self.W_UV)  # (S, H, v)
        acc = torch.promote_types(q_nope.dtype, torch.float32)
        scores = (torch.einsum("thd,shd->ths", q_nope.to(acc), k_nope.to(acc))
                  + torch.einsum("thr,sr->ths", q_pe.to(acc), k_pe.to(acc))) * self.softmax_scale  # (t, H, S)
        selected = torch.zeros(topk.shape[0], kv.shape[0] + 1, dtype=torch.bool, device=kv.device)
        selected.scatter_(1, torch.where(topk >= 0, topk.long(), kv.shape[0]), True)  # -1 -> spare column
        scores = scores.masked_fill(~selected[:, None, : kv.shape[0]], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return torch.einsum("ths,shv->thv", probs, v.to(acc)).to(q_nope.dtype)
