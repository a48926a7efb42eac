# %% [markdown]
# # One DeepSeek-V3.2 sparse MLA layer, step by step
#
# vLLM's pull request "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region" is about which parts of this layer
# a serving engine can capture in a CUDA graph: after it, only the *lightning indexer* and the *sparse
# attention* stay eager. This notebook shows what those two are. DeepSeek-V3.2 keeps V3's Multi-head Latent
# Attention (MLA) and adds the indexer, a cheap scorer that picks, for every query token, the `index_topk`
# earlier tokens worth attending to; the attention then reads only those tokens' cached latents. We walk one
# layer through the reference implementation in `dsv32ref.reference`, on a tiny configuration with the same
# structure, and check each step against an independent formulation:
#
# 1. the projections and the shapes at each step;
# 2. the paged latent cache: one `[c_kv | k_pe]` row per token, written through `slot_mapping` (a picture);
# 3. the indexer's scores and the top-k it keeps (a picture);
# 4. the absorbed (MQA) form of MLA agreeing with the naive (MHA) form;
# 5. sparse attention over the top-k indices agreeing with dense attention under the same mask;
# 6. one decode step: the new token's top-k, read through the block table.
#
# Everything runs in float64 on the CPU, so agreement is to rounding error.

# %%
import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

from dsv32ref import AttentionMetadata, DeepseekV32ForCausalLM, ModelConfig, init_dummy_weights
from dsv32ref.cache import gather_tokens, write_tokens
from dsv32ref.report import OKABE_ITO, show
from dsv32ref.reference import dense_mla, indexer_scores, sparse_mla, topk_indices
from dsv32ref.reference.mla import LayerCache

torch.manual_seed(0)
torch.set_grad_enabled(False)  # inference only: no autograd graphs
config = ModelConfig.preset("tiny-deepseek-v3.2")
model = init_dummy_weights(DeepseekV32ForCausalLM(config).double(), seed=0).eval()
attn = model.model.layers[0].self_attn  # layer 0: runs its own indexer
for name in ["hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk"]:
    print(f"{name:<20} {getattr(config, name)}")
print(f"{'softmax_scale':<20} {config.softmax_scale:.6f}")

# %% [markdown]
# For scale, the real model's sizes. The softmax scale is not `qk_head_dim^-1/2`: YaRN's mscale
# multiplies it by m² with m = 0.1·ln(40) + 1. FlashMLA's default scale (576^-1/2) is different again,
# so an engine must pass τ explicitly.

# %%
real = ModelConfig.preset("deepseek-v3.2")
print(f"tau = 192^-1/2 * m^2 = {real.softmax_scale:.6f}   (576^-1/2 = {576 ** -0.5:.6f})")
print(f"latent cache per token per layer: {real.latent_dim} values = {real.latent_dim * 2} bytes in bf16")
print(f"indexer key per token per layer:  {real.index_head_dim} values = {real.index_head_dim * 2} bytes in bf16")
print(f"a naive MHA cache would hold {real.num_attention_heads * (real.qk_head_dim + real.v_head_dim)} values per token")

# %% [markdown]
# ## 1. Projections
# `q_a_proj` compresses the hidden state to `c_q`; `q_b_proj` expands it to per-head queries, split into
# a *nope* part (no position) and a *rope* part. `kv_a_proj_with_mqa` produces the latent `c_kv` and one
# shared `k_pe` head. RoPE on MLA is interleaved: pairs (x0, x1), (x2, x3), ...

# %%
T = 24
x = torch.randn(T, config.hidden_size, dtype=torch.float64)
positions = torch.arange(T)
cos, sin = model.model.rotary_emb(positions, torch.float64)
q_c, q_nope, q_pe, c_kv, k_pe = attn.project(x, cos, sin)
for name, t in [("x", x), ("q_c", q_c), ("q_nope", q_nope), ("q_pe", q_pe), ("c_kv", c_kv), ("k_pe", k_pe),
                ("W_UK", attn.W_UK), ("W_UV", attn.W_UV)]:
    print(f"{name:<7} {list(t.shape)}")

# %% [markdown]
# ## 2. The paged latent cache
# Each token's row `[c_kv | k_pe]` goes to slot `block_table[b, p // block_size] * block_size + p % block_size`.
# The blocks of one sequence need not be contiguous; reading back through the block table recovers the rows.

# %%
block_size = 4
meta = AttentionMetadata.build(context_lens=[0], query_lens=[T], block_tables=[[5, 2, 7, 0, 3, 1]],
                               block_size=block_size)
cache = model.new_cache(num_blocks=8, block_size=block_size)
print("slot_mapping:", meta.slot_mapping.tolist())
write_tokens(cache.latent[0], meta.slot_mapping, torch.cat((c_kv, k_pe), dim=-1))
rows = gather_tokens(cache.latent[0], meta.block_table[0], T)
print("rows read back through the block table equal the written ones:", torch.equal(rows, torch.cat((c_kv, k_pe), -1)))

# %%
table = meta.block_table[0].tolist()
fig, ax = plt.subplots(figsize=(9, 3.2))
for j, blk in enumerate(table):
    pos = list(range(j * block_size, (j + 1) * block_size))
    ax.scatter(pos, [blk * block_size + p % block_size for p in pos], color=OKABE_ITO[j % len(OKABE_ITO)], s=28,
               label=f"block_table[0][{j}] = {blk}")
ax.set_xlabel("token position p in the sequence")
ax.set_ylabel("cache slot")
ax.set_title(f"slot = block_table[p // {block_size}] * {block_size} + p % {block_size}: one sequence, "
             f"{len(table)} scattered blocks")
ax.legend(fontsize=7, ncol=2, loc="lower left")
show(fig)

# %% [markdown]
# ## 3. The indexer picks the top-k
# Score I[t, s] = Σ_h w[t, h] · ReLU(q^I[t, h] · k^I[s] / √d): a few small heads, ReLU instead of softmax,
# fp32. Keys after the query are masked; the top-k keeps min(k, #visible) positions, pads with -1.

# %%
k_idx = attn.indexer.key(x, cos, sin)  # (T, index_head_dim)
q_idx = attn.indexer.query(q_c, cos, sin)  # (T, index_n_heads, index_head_dim)
w_idx = attn.indexer.weights(x)  # (T, index_n_heads)
scores = indexer_scores(q_idx, k_idx, w_idx, attn.indexer.softmax_scale)  # (T, T)
topk = topk_indices(scores, positions, config.index_topk)  # (T, index_topk), int32
for t in (3, 12, 23):
    print(f"query {t:>2} keeps {topk[t].tolist()}")
print("selected per query:", (topk >= 0).sum(1).tolist())

# %%
masked = scores.masked_fill(positions[None, :] > positions[:, None], float("nan"))
fig, ax = plt.subplots(figsize=(6.5, 5.5))
im = ax.imshow(masked.numpy(), cmap="viridis")
sel_t, sel_j = torch.nonzero(topk >= 0, as_tuple=True)
ax.scatter(topk[sel_t, sel_j].numpy(), sel_t.numpy(), marker="s", s=18, facecolors="none", edgecolors="red",
           label=f"kept (top-{config.index_topk})")
ax.set_xlabel("key position s")
ax.set_ylabel("query position t")
ax.set_title("indexer score I[t, s] (causal) and the keys each query keeps")
ax.legend(loc="upper right")
fig.colorbar(im, ax=ax, shrink=0.8).set_label("score (no unit)")
show(fig)

# %% [markdown]
# Queries with at most k visible keys keep all of them; later ones keep a scattered subset, not a
# sliding window. With dummy weights the choice is arbitrary but far from degenerate; with trained
# weights it is what the model learnt to look at.
#
# ## 4. Absorbed (MQA) form = naive (MHA) form
# Naive: up-project each cached latent to per-head keys `[W_UK c_kv ; k_pe]` and values `W_UV c_kv`.
# Absorbed: fold W_UK into the query (q̃ = W_UKᵀ q_nope, 512 values), attend over the 576-value latents
# directly, and apply W_UV after. Same function, far fewer bytes per key, which is why kernels use it.

# %%
def run_layer(form):
    attn.form = form
    fresh = model.new_cache(num_blocks=8, block_size=block_size)
    out, topk_used = attn(x, cos, sin, LayerCache(fresh.latent[0], fresh.indexer_k[0]), meta)
    return out, topk_used


with torch.no_grad():
    out_absorbed, topk_a = run_layer("absorbed")
    out_naive, topk_n = run_layer("naive")
attn.form = "absorbed"
err = (out_absorbed - out_naive).abs().max().item()
print("same top-k:", torch.equal(topk_a, topk_n) and torch.equal(topk_a, topk))
print(f"largest |absorbed - naive| over every element: {err:.1e} (outputs of size {out_naive.abs().max():.2f})")

# %% [markdown]
# ## 5. Sparse attention = dense attention under the same mask
# `sparse_mla` gathers the k selected latent rows per query (FlashMLA's interface: indices into the
# sequence, -1 = none, natural-log lse). `dense_mla` scores every key and masks all but the selected ones.

# %%
q_mqa = torch.cat((torch.einsum("thd,hdc->thc", q_nope, attn.W_UK), q_pe), dim=-1)  # (T, H, 576-like)
kv = torch.cat((c_kv, k_pe), dim=-1)  # (T, 576-like)
o_sparse, lse_sparse = sparse_mla(q_mqa, kv, topk, config.softmax_scale, config.kv_lora_rank)
mask = torch.zeros(T, T, dtype=torch.bool)
mask.scatter_(1, topk.clamp(min=0).long(), True)  # -1 entries only ever follow valid ones
mask &= positions[None, :] <= positions[:, None]
o_dense, lse_dense = dense_mla(q_mqa, kv, mask, config.softmax_scale, config.kv_lora_rank)
print(f"sparse vs dense under the same mask: largest |difference| {(o_sparse - o_dense).abs().max():.1e} "
      f"(output), {(lse_sparse - lse_dense).abs().max():.1e} (lse)")
causal = positions[None, :] <= positions[:, None]
o_causal, _ = dense_mla(q_mqa, kv, causal, config.softmax_scale, config.kv_lora_rank)
k = config.index_topk
print(f"queries t < {k} (every key kept) vs full causal attention: {(o_sparse[:k] - o_causal[:k]).abs().max():.1e}")
print(f"queries t >= {k} (the top-k bites) vs full causal attention: {(o_sparse[k:] - o_causal[k:]).abs().max():.1e}")

# %% [markdown]
# ## 6. One decode step
# A new token at position T arrives. Its latent row and indexer key are written to the next free slot (the
# block table grows by a block when the last one is full); its indexer query scores every cached key and the
# attention reads only the top-k rows, wherever the block table put them.

# %%
table6 = table + [4]  # one more block for position T
x_new = torch.randn(1, config.hidden_size, dtype=torch.float64)
pos_all = torch.arange(T + 1)
cos_a, sin_a = model.model.rotary_emb(pos_all, torch.float64)
x_all = torch.cat((x, x_new))
keys = attn.indexer.key(x_all, cos_a, sin_a)  # (T + 1, index_head_dim)
q_c_all = attn.project(x_all, cos_a, sin_a)[0]
q_new = attn.indexer.query(q_c_all[T:], cos_a[T:], sin_a[T:])  # (1, index_n_heads, index_head_dim)
s_new = indexer_scores(q_new, keys, attn.indexer.weights(x_new), attn.indexer.softmax_scale)  # (1, T + 1)
kept = topk_indices(s_new, pos_all[T:], config.index_topk)[0]
kept = sorted(p for p in kept.tolist() if p >= 0)
slot = {p: table6[p // block_size] * block_size + p % block_size for p in range(T + 1)}
grid = torch.zeros(8, block_size)  # 0 empty, 1 written, 2 the new token, 3 kept by the new token's top-k
for p, sl in slot.items():
    grid[sl // block_size, sl % block_size] = 3 if p in kept else (2 if p == T else 1)
fig, ax = plt.subplots(figsize=(5, 5))
from matplotlib.colors import ListedColormap  # noqa: E402

ax.imshow(grid.numpy(), cmap=ListedColormap(["#FFFFFF", "#DDDDDD", OKABE_ITO[5], OKABE_ITO[0]]), vmin=0, vmax=3)
for p, sl in slot.items():
    ax.text(sl % block_size, sl // block_size, str(p), ha="center", va="center", fontsize=8,
            color="white" if p in kept else "black")
ax.set_xticks(range(block_size))
ax.set_yticks(range(8))
ax.set_xlabel("offset in the block")
ax.set_ylabel("cache block")
ax.set_title(f"decode at position {T}: its top-{config.index_topk} (blue) in the paged cache\n"
             f"(numbers: token positions; red: the new token; grey: written, not kept)")
show(fig)

# %% [markdown]
# ## What this buys at the real size
# Per query token and head, the absorbed attention reads `index_topk` latent rows instead of the whole
# context; the indexer still scores every key, but with a few small heads.

# %%
S = 128 * 1024
flops_dense = 2 * real.num_attention_heads * S * (real.latent_dim + real.kv_lora_rank)
flops_sparse = 2 * real.num_attention_heads * real.index_topk * (real.latent_dim + real.kv_lora_rank)
flops_indexer = 2 * real.index_n_heads * S * real.index_head_dim
print(f"per query token at {S} tokens of context:")
print(f"  attention, dense : {flops_dense / 1e9:.2f} GFLOP")
print(f"  attention, sparse: {flops_sparse / 1e9:.3f} GFLOP ({flops_sparse / flops_dense:.1%})")
print(f"  indexer          : {flops_indexer / 1e9:.2f} GFLOP")

# %% [markdown]
# ## Conclusion

# %%
display(Markdown(
    f"- The reference layer's two forms of MLA agree to {err:.0e} in float64, and its sparse attention equals "
    f"dense attention under the top-k mask to {(o_sparse - o_dense).abs().max():.0e}: these are the two "
    f"functions our kernels and the engine are checked against.\n"
    f"- The indexer keeps {config.index_topk} keys per query here ({real.index_topk} in DeepSeek-V3.2); at "
    f"{S // 1024}k tokens of context the attention then costs {flops_sparse / flops_dense:.1%} of its dense "
    f"FLOPs, and the indexer, which scores every key, {flops_indexer / flops_dense:.1%}.\n"
    f"- Why the PR keeps exactly these two eager: both read per-request lengths (`seq_lens`, the visible keys "
    f"of each query) and the block table, which change every step. A graph can replay them only if those "
    f"lengths are read on the device, which is what notebook 06's `none` boundary does."))
