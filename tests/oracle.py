"""An independent formulation of one DSA attention layer for a single contiguous sequence.

Written the way HF transformers and DeepSeek's inference code state it, not the way dsv32ref/reference
computes it: RoPE through complex multiplication, the indexer as a loop over heads, the attention in
naive MHA form over a dense [T, S] mask, no paged cache. float64 throughout.
"""

import math

import torch


def yarn_inv_freq(d, theta, ys):
    """DeepSeek's precompute_freqs_cis, scalar by scalar."""
    freqs = [1.0 / theta ** (2 * i / d) for i in range(d // 2)]
    if not ys or ys["factor"] <= 1:
        return torch.tensor(freqs, dtype=torch.float64)
    l0, factor = ys["original_max_position_embeddings"], ys["factor"]
    dim_of = lambda rot: d * math.log(l0 / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(dim_of(ys["beta_fast"])), 0), min(math.ceil(dim_of(ys["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        smooth = 1 - ramp
        out.append(f / factor * (1 - smooth) + f * smooth)
    return torch.tensor(out, dtype=torch.float64)


def rope_complex(x, pos, inv_freq, interleaved):
    """x [T, ..., d] rotated via complex numbers; interleaved pairs (2i, 2i+1) or halves (i, i + d/2)."""
    d = x.shape[-1]
    angle = pos.double()[:, None] * inv_freq[None, :]  # (T, d/2)
    rot = torch.polar(torch.ones_like(angle), angle).view(x.shape[0], *([1] * (x.dim() - 2)), d // 2)
    if interleaved:
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
        return torch.view_as_real(z * rot).flatten(-2)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    y = z * rot
    return torch.cat((y.real, y.imag), dim=-1)


def rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def layer_forward(attn, config, x, pos, prev_topk=None):
    """x [T, hidden] (float64) of one sequence at positions pos -> (out [T, hidden], topk [T, k])."""
    c = config
    W = {n: p.detach().double() for n, p in attn.named_parameters()}
    T, H = x.shape[0], c.num_attention_heads
    inv = yarn_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    q_c = rms(x @ W["q_a_proj.weight"].T, W["q_a_layernorm.weight"], c.rms_norm_eps)
    q = (q_c @ W["q_b_proj.weight"].T).view(T, H, c.qk_head_dim)
    q_nope, q_pe = q[..., : c.qk_nope_head_dim], rope_complex(q[..., c.qk_nope_head_dim:], pos, inv, True)
    kv = x @ W["kv_a_proj_with_mqa.weight"].T
    c_kv = rms(kv[:, : c.kv_lora_rank], W["kv_a_layernorm.weight"], c.rms_norm_eps)
    k_pe = rope_complex(kv[:, c.kv_lora_rank:], pos, inv, True)
    S = int(pos.max()) + 1
    if x.shape[0] != S:
        raise ValueError("oracle: expects the whole sequence 0..T-1")
    visible = torch.arange(S)[None, :] <= pos[:, None]  # (T, S)
    if prev_topk is None:
        Hi, D, r = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        qi = (q_c @ W["indexer.wq_b.weight"].T).view(T, Hi, D)
        ki = torch.nn.functional.layer_norm(x @ W["indexer.wk.weight"].T, (D,), W["indexer.k_norm.weight"],
                                            W["indexer.k_norm.bias"], 1e-6)
        il = c.indexer_rope_interleave
        qi = torch.cat((rope_complex(qi[..., :r], pos, inv, il), qi[..., r:]), -1)
        ki = torch.cat((rope_complex(ki[..., :r], pos, inv, il), ki[..., r:]), -1)
        w = x @ W["indexer.weights_proj.weight"].T * Hi ** -0.5  # (T, Hi)
        score = torch.zeros(T, S, dtype=torch.float64)
        for h in range(Hi):
            score += w[:, h: h + 1] * torch.relu(qi[:, h] @ ki.T * D ** -0.5)
        score = score.masked_fill(~visible, -math.inf)
        k = min(c.index_topk, S)
        topk = torch.full((T, c.index_topk), -1, dtype=torch.int32)
        for t in range(T):
            nvis = int(visible[t].sum())
            # sort by (-score, position): highest first, ties to the lower position
            order = sorted(range(S), key=lambda s: (-score[t, s].item(), s))[: min(k, nvis)]
            topk[t, : len(order)] = torch.tensor(order, dtype=torch.int32)
    else:
        topk = prev_topk
    mask = torch.zeros(T, S, dtype=torch.bool)
    for t in range(T):
        sel = topk[t][topk[t] >= 0].long()
        mask[t, sel] = True
    wkv = W["kv_b_proj.weight"].view(H, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    k_nope = torch.einsum("hdc,sc->hsd", wkv[:, : c.qk_nope_head_dim], c_kv)
    v = torch.einsum("hdc,sc->hsd", wkv[:, c.qk_nope_head_dim:], c_kv)
    keys = torch.cat((k_nope, k_pe[None].expand(H, S, -1)), -1)  # (H, S, qk_head)
    query = torch.cat((q_nope, q_pe), -1).transpose(0, 1)  # (H, T, qk_head)
    logits = query @ keys.transpose(1, 2) * c.softmax_scale  # (H, T, S)
    logits = logits.masked_fill(~mask[None], -math.inf)
    o = torch.softmax(logits, -1) @ v  # (H, T, v)
    out = o.transpose(0, 1).reshape(T, H * c.v_head_dim) @ W["o_proj.weight"].T
    return out, topk
