"""Triton kernels against the PyTorch reference: interpreted on CPU (small shapes), compiled on a GPU.

Outputs are poisoned (NaN / sentinel) before each launch, so an element the kernel fails to write fails; so are
sparse_mla_paged's top-k split partials, so that a partial merged but never written fails.
"""

import pytest
import torch

from dsv32ref import AttentionMetadata, ModelConfig
from dsv32ref.cache import gather_tokens
from dsv32ref.checks import check_same_device
from dsv32ref.kernels.fused_norm_rope import fused_norm_rope
from dsv32ref.kernels.fused_q import fused_q
from dsv32ref.kernels.indexer_topk import indexer_scores_paged, indexer_topk_paged, topk_from_scores
from dsv32ref.kernels.launch import observing_launches
from dsv32ref.kernels.sparse_mla import FP32_CONFIG, sparse_mla_paged
from dsv32ref.reference import (apply_rope, fp8_quantize, hadamard_transform, indexer_scores, layer_norm, rms_norm,
                                sparse_mla, topk_indices)
from dsv32ref.reference.fp8_cache import dequantize_latent, latent_parts, quantize_latent
from dsv32ref.reference.rope import RotaryEmbedding
from dsv32ref.testing import assert_close, eps, paged_sparse_mla_inputs, reference_sparse_mla_paged

pytestmark = pytest.mark.usefixtures("poisoned_partials")

# (device, dtype, tolerance in units of the dtype's precision, per element: dsv32ref.testing)
# Interpreted cases need TRITON_INTERPRET=1, which conftest sets only where there is no GPU (triton reads
# it once): on a GPU machine the compiled cases cover the same code.
CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on CPU-only machines")
CASES = [
    pytest.param("cpu", torch.float32, 64, id="cpu-fp32", marks=CPU),
    pytest.param("cuda", torch.float32, 256, id="cuda-fp32", marks=pytest.mark.gpu),  # exp2 is approximate on a GPU
    pytest.param("cuda", torch.bfloat16, 1, id="cuda-bf16", marks=pytest.mark.gpu),
]
# bf16 interpreted: the MMA kernels take their products in fp32 there (the interpreter's tl.dot on bf16 is wrong)
MMA_CASES = CASES + [pytest.param("cpu", torch.bfloat16, 1, id="cpu-bf16", marks=CPU)]


def _sizes(device):
    # Interpreted kernels run slowly: tiny sizes on the CPU, DeepSeek-V3.2-like ones on the GPU.
    if device == "cpu":
        return dict(H=4, d_lat=32, rope=8, q_lora=48, nope=16, h_i=4, d_i=16, k=8, block=4)
    return dict(H=128, d_lat=512, rope=64, q_lora=1536, nope=128, h_i=64, d_i=128, k=2048, block=64)


def _meta(device, ctx, qlens, block):
    """Requests with scrambled, interleaved blocks."""
    tables, nxt = [], 0
    for c, n in zip(ctx, qlens):
        need = -(-(c + n) // block)
        tables.append(list(range(nxt, nxt + 2 * need, 2)))
        nxt += 2 * need
    tables = [t[::-1] if i % 2 else t for i, t in enumerate(tables)]
    return AttentionMetadata.build(ctx, qlens, tables, block, device), nxt


def _shape_for(device, cpu, gpu):
    return cpu if device == "cpu" else gpu


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_norm_rope(device, dtype, tol, interleaved, seed):
    z = _sizes(device)
    meta, nb = _meta(device, *_shape_for(device, ([3, 0], [2, 5]), ([100, 0], [7, 300])), z["block"])
    T = meta.num_tokens
    slot = meta.slot_mapping.clone()
    slot[1] = -1  # a padding token: nothing written for it
    f = dict(device=device, dtype=dtype)
    q_c, kv, ik = torch.randn(T, z["q_lora"], **f), torch.randn(T, z["d_lat"] + z["rope"], **f), torch.randn(T, z["d_i"], **f)
    q_c[0], kv[0, : z["d_lat"]], ik[0] = q_c[0] * 1e-4, kv[0, : z["d_lat"]] * 1e-4, ik[0] * 1e-4  # mean squares below eps
    wq, wkv = 1 + 0.1 * torch.randn(z["q_lora"], **f), 1 + 0.1 * torch.randn(z["d_lat"], **f)
    kw, kb = 1 + 0.1 * torch.randn(z["d_i"], **f), 0.1 * torch.randn(z["d_i"], **f)
    cfg = ModelConfig.preset("deepseek-v3.2").replace(qk_rope_head_dim=z["rope"], index_head_dim=max(z["d_i"], z["rope"]))
    cos, sin = RotaryEmbedding(cfg).to(device)(torch.arange(4096, device=device))
    q_out = torch.full_like(q_c, float("nan"))
    latent = torch.full((nb, z["block"], z["d_lat"] + z["rope"]), float("nan"), **f)
    icache = torch.full((nb, z["block"], z["d_i"]), float("nan"), **f)
    fused_norm_rope(q_c, wq, q_out, kv, wkv, latent, meta.positions, slot, cos, sin, 1e-6,
                    ik, kw, kb, icache, indexer_interleaved=interleaved)
    c, s = cos[meta.positions], sin[meta.positions]
    close = dict(dtype=dtype, rtol=tol, atol=tol)
    assert_close("q_c", q_out, rms_norm(q_c, wq, 1e-6), **close)
    want_lat = torch.cat((rms_norm(kv[:, : z["d_lat"]], wkv, 1e-6), apply_rope(kv[:, z["d_lat"]:], c, s, True)), -1)
    k = layer_norm(ik, kw, kb, 1e-6)
    want_idx = torch.cat((apply_rope(k[:, : z["rope"]], c, s, interleaved), k[:, z["rope"]:]), -1)
    written = slot >= 0
    got_lat = latent.view(-1, latent.shape[-1])[slot[written]]
    got_idx = icache.view(-1, icache.shape[-1])[slot[written]]
    assert_close("latent rows", got_lat, want_lat[written], **close)
    assert_close("indexer keys", got_idx, want_idx[written], **close)
    assert latent.isnan().all(-1).sum() == latent.shape[0] * latent.shape[1] - int(written.sum())


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_q(device, dtype, tol, interleaved, seed):
    z = _sizes(device)
    T = _shape_for(device, 5, 300)
    f = dict(device=device, dtype=dtype)
    q_lat, q = torch.randn(T, z["H"], z["d_lat"], **f), torch.randn(T, z["H"], z["nope"] + z["rope"], **f)
    # the weights as the engine passes them: weights_proj's columns of the A-projections' output, in its dtype
    q_idx, w = torch.randn(T, z["h_i"], z["d_i"], **f), torch.randn(T, 3 * z["h_i"], **f)[:, z["h_i"]: 2 * z["h_i"]]
    pos = torch.randint(0, 4000, (T,), device=device)
    cfg = ModelConfig.preset("deepseek-v3.2").replace(qk_rope_head_dim=z["rope"], index_head_dim=max(z["d_i"], z["rope"]))
    cos, sin = RotaryEmbedding(cfg).to(device)(torch.arange(4096, device=device))
    q_mqa = torch.full((T, z["H"], z["d_lat"] + z["rope"]), float("nan"), **f)
    qi_out, w_out = torch.full_like(q_idx, float("nan")), torch.full((T, z["h_i"]), float("nan"), device=device)
    fused_q(q_lat, q, q_mqa, pos, cos, sin, q_idx, qi_out, w, w_out, indexer_interleaved=interleaved)
    c, s = cos[pos], sin[pos]
    want = torch.cat((q_lat, apply_rope(q[..., z["nope"]:], c, s, True)), -1)
    want_i = torch.cat((apply_rope(q_idx[..., : z["rope"]], c, s, interleaved), q_idx[..., z["rope"]:]), -1)
    close = dict(dtype=dtype, rtol=tol, atol=tol, row_dims=2)
    assert_close("q_mqa", q_mqa, want, **close)
    assert_close("q_idx", qi_out, want_i, **close)
    assert_close("weights", w_out, w.double() * z["h_i"] ** -0.5, dtype=torch.float32, rtol=2, atol=0)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_q_copies_into_bf16_as_torch_rounds(device, seed):
    """An fp32 q_lat into a bf16 q_mqa: its copied part equals torch's cast bit for bit (round to nearest even; the
    interpreter's own cast truncates)."""
    z = _sizes(device)
    T = 5
    q_lat = torch.randn(T, z["H"], z["d_lat"], device=device)
    q = torch.randn(T, z["H"], z["nope"] + z["rope"], device=device, dtype=torch.bfloat16)
    cfg = ModelConfig.preset("deepseek-v3.2").replace(qk_rope_head_dim=z["rope"], index_head_dim=max(z["d_i"], z["rope"]))
    cos, sin = RotaryEmbedding(cfg).to(device)(torch.arange(64, device=device))
    q_mqa = torch.full((T, z["H"], z["d_lat"] + z["rope"]), float("nan"), device=device, dtype=torch.bfloat16)
    fused_q(q_lat, q, q_mqa, torch.arange(T, device=device), cos, sin)
    assert torch.equal(q_mqa[..., : z["d_lat"]].view(torch.int16), q_lat.to(torch.bfloat16).view(torch.int16))


# On CPU fp32 and fp16: triton 3.6's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even),
# which moves the bf16 intermediates this test compares exactly.
@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, marks=CPU),
                                          pytest.param("cpu", torch.float16, marks=CPU),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_q_fp8_deployed_numerics(device, dtype, interleaved, seed):
    """fp8 q_idx_out: the kernel's fp8 values and folded scales against the reference numerics
    fp8_quantize(hadamard_transform(RoPE(q_idx))). Both round RoPE's output to the activation dtype, but
    the GPU may contract a*c - b*s into an FMA on either side: a roped value can differ by one bf16 ulp
    (<= 2^-7 |x|). The orthonormal transform spreads each such difference over all outputs (/ sqrt(n)),
    so a small output, after cancellation, can move by more than one fp8 step. Bound: one step for the
    quantisation, one for the output's own rounding, plus sum_i 2^-7 |x_i| / sqrt(n) over the roped values
    (in fp8 units). Almost all values must match exactly. The same differences can move a head's amax
    across a power-of-two boundary 448 * 2^k: its scale may then be one power of two off, only where the
    reference amax lies within that bound of the boundary, and its values are checked against the
    reference quantised with the kernel's scale."""
    z = _sizes(device)
    T, d_i = _shape_for(device, 6, 300), 32 if device == "cpu" else z["d_i"]
    f = dict(device=device, dtype=dtype)
    q_lat, q = torch.randn(T, z["H"], z["d_lat"], **f), torch.randn(T, z["H"], z["nope"] + z["rope"], **f)
    q_idx = torch.randn(T, z["h_i"], d_i, **f) * torch.rand(T, z["h_i"], 1, **f) * 50  # spread of scales
    q_idx[0, 0] = 0  # amax clamped to 1e-4
    w = torch.randn(T, z["h_i"], device=device)
    # The test reads each head's scale back as w_out / w: an exact zero weight (CUDA's randn draws some)
    # would make it 0/0.
    w = torch.where(w == 0, torch.ones_like(w), w)
    pos = torch.randint(0, 4000, (T,), device=device)
    cfg = ModelConfig.preset("deepseek-v3.2").replace(qk_rope_head_dim=z["rope"], index_head_dim=d_i)
    cos, sin = RotaryEmbedding(cfg).to(device)(torch.arange(4096, device=device))
    q_mqa = torch.empty(T, z["H"], z["d_lat"] + z["rope"], **f)
    q8 = torch.full((T, z["h_i"], d_i), float("nan"), device=device).to(torch.float8_e4m3fn)
    w_out = torch.full_like(w, float("nan"))
    fused_q(q_lat, q, q_mqa, pos, cos, sin, q_idx, q8, w, w_out, indexer_interleaved=interleaved)
    roped = torch.cat((apply_rope(q_idx[..., : z["rope"]], cos[pos], sin[pos], interleaved), q_idx[..., z["rope"]:]), -1)
    h = hadamard_transform(roped).float()  # (T, H_I, d_i)
    _, want_scale = fp8_quantize(h, block=d_i)  # scale (T, H_I, 1)
    scale = (w_out / (w * z["h_i"] ** -0.5))[..., None]
    # How far a value of h may be off, in units of h: the spread, plus one bf16 ulp of its own rounding.
    spread = 2.0 ** -7 * roped[..., : z["rope"]].float().abs().sum(-1, keepdim=True) / d_i ** 0.5
    amax = h.abs().amax(-1, keepdim=True)
    slack, edge = spread + 2.0 ** -7 * amax, 448.0 * want_scale
    near = (amax > edge - slack) | ((amax <= edge / 2 + slack) & (amax > 1e-4))
    flipped = scale != want_scale
    assert not (flipped & ~near).any(), f"scales differ away from a boundary: {scale[flipped & ~near][:4]} vs {want_scale[flipped & ~near][:4]}"
    assert ((scale == 2 * want_scale) | (scale == want_scale / 2))[flipped].all(), "a scale is more than one power of two off"
    want = fp8_quantize(h, block=d_i, scale=scale)[0].float()  # the reference at the kernel's scale
    got = q8.float()
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=2.0 ** -6))) - 3)  # one e4m3 step at want
    far = (got - want).abs() > 2 * step + spread / scale
    assert not far.any(), f"{far.sum().item()} values off: {got[far][:4]} vs {want[far][:4]}"
    # "almost all": at most 0.1 %, and at least two values of the few hundred of a CPU run
    assert (got != want).sum() <= max(2, got.numel() // 1000), (got == want).float().mean()
    assert torch.equal(q8[0, 0].float(), torch.zeros(d_i, device=device)), q8[0, 0].float()


def _check_indexer_scores(scores, q, w, icache, meta, z, dtype, tol):
    """Every visible score of every token against the float64 reference -> [(t0, t1, reference scores)] per
    request. Products of both signs cancel (in q.k and across weighted heads): the error is bounded by the same
    sum over |terms| (the usual dot-product error bound), not by the result."""
    per_request = []
    for b in range(meta.num_reqs):
        t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        keys = gather_tokens(icache, meta.block_table[b], meta.seq_lens_cpu[b])
        ref = indexer_scores(q[t0:t1].double(), keys.double(), w[t0:t1].double(), z["d_i"] ** -0.5)
        bound = indexer_scores(q[t0:t1].double().abs(), keys.double().abs(), w[t0:t1].double().abs(), z["d_i"] ** -0.5)
        for i, t in enumerate(range(t0, t1)):
            n = int(meta.positions[t]) + 1
            err = (scores[t, :n].double() - ref[i, :n]).abs()
            assert (err <= tol * eps(dtype) * bound[i, :n].clamp(min=1e-30)).all(), t
        per_request.append((t0, t1, ref))
    return per_request


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_indexer_topk(device, dtype, tol, seed):
    z = _sizes(device)
    ctx, qlens = _shape_for(device, ([12, 0, 3], [3, 20, 1]), ([30000, 0, 5000], [4, 3000, 1]))
    meta, nb = _meta(device, ctx, qlens, z["block"])
    T, f = meta.num_tokens, dict(device=device, dtype=dtype)
    q, icache = torch.randn(T, z["h_i"], z["d_i"], **f), torch.randn(nb, z["block"], z["d_i"], **f)
    w = torch.randn(T, z["h_i"], device=device) * z["h_i"] ** -0.5
    s_max = max(meta.seq_lens_cpu) + 5
    scores = torch.full((T, s_max), float("nan"), device=device)
    out = torch.full((T, z["k"]), -7, dtype=torch.int32, device=device)
    indexer_topk_paged(q, w, icache, meta.block_table, meta.req_indices, meta.positions, z["d_i"] ** -0.5, scores, out)
    for t0, t1, ref in _check_indexer_scores(scores, q, w, icache, meta, z, dtype, tol):
        for i, t in enumerate(range(t0, t1)):
            n = int(meta.positions[t]) + 1
            got = out[t]
            assert (got >= 0).sum() == min(n, z["k"]) and (got[(got >= 0).sum():] == -1).all()
            sel = got[got >= 0].long()
            assert len(set(sel.tolist())) == len(sel) and int(sel.max()) < n
            if n > z["k"]:
                # every selected key scores at least the k-th best (up to the scoring tolerance)
                kth = torch.sort(ref[i, :n], descending=True).values[z["k"] - 1]
                slack = 2 * tol * eps(dtype) * ref[i, :n].abs().max()
                assert (ref[i, sel] >= kth - slack).all()
            if dtype == torch.float32:  # same scores as the reference: the exact same set
                want = topk_indices(scores[t: t + 1, :n].double().cpu(), torch.tensor([n - 1]), z["k"])[0]
                assert sorted(sel.tolist()) == sorted(want[want >= 0].tolist())


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_indexer_scores_tiles_per_program(device, dtype, tol, seed):
    """A program that walks several key tiles (decode) writes the same scores as one tile per program, stops at
    each token's position inside a tile, and leaves the entries past it untouched; so does one that scores a
    group of tokens (prefill), also when the group spans requests or holds a token of no request."""
    z = _sizes(device)
    block_s = _shape_for(device, 4, 64)
    meta, nb = _meta(device, *_shape_for(device, ([37, 5], [1, 2]), ([9000, 300], [1, 2])), z["block"])
    T, f = meta.num_tokens, dict(device=device, dtype=dtype)
    q, icache = torch.randn(T, z["h_i"], z["d_i"], **f), torch.randn(nb, z["block"], z["d_i"], **f)
    w = torch.randn(T, z["h_i"], device=device) * z["h_i"] ** -0.5
    s_max = max(meta.seq_lens_cpu) + 3
    args = (q, w, icache, meta.block_table, meta.req_indices, meta.positions, z["d_i"] ** -0.5)
    one = indexer_scores_paged(*args, torch.full((T, s_max), float("nan"), device=device), block_s=block_s, tiles=1)
    for tiles in (2, 4, 16):
        got = indexer_scores_paged(*args, torch.full((T, s_max), float("nan"), device=device), block_s=block_s,
                                   tiles=tiles)
        for t in range(T):
            n = int(meta.positions[t]) + 1
            assert torch.equal(got[t, :n], one[t, :n]), (tiles, t)
            assert got[t, n:].isnan().all(), (tiles, t)
    _check_indexer_scores(one, q, w, icache, meta, z, dtype, tol)
    # two tiles per cache block (block ids loaded before the loop), and tiles that cross blocks (a block id per key)
    for bs in (block_s // 2, 2 * block_s):
        got = indexer_scores_paged(*args, torch.full((T, s_max), float("nan"), device=device), block_s=bs, tiles=2)
        _check_indexer_scores(got, q, w, icache, meta, z, dtype, tol)
        assert all(got[t, int(meta.positions[t]) + 1:].isnan().all() for t in range(T)), bs
    for tokens in (2, 4):  # groups of tokens share each key tile; the groups here span two requests
        got = indexer_scores_paged(*args, torch.full((T, s_max), float("nan"), device=device), block_s=block_s,
                                   tiles=2, tokens=tokens)
        _check_indexer_scores(got, q, w, icache, meta, z, dtype, tol)
        assert all(got[t, int(meta.positions[t]) + 1:].isnan().all() for t in range(T)), tokens
    # token 1 scores nothing: its request is outside the block table, or it sees no key (then it leads nothing,
    # and token 2, of the same request, is still scored); the others of its group are scored as before
    bad_req, bad_pos = meta.req_indices.clone(), meta.positions.clone()
    bad_req[1], bad_pos[1] = meta.num_reqs, -1
    for req, pos in ((bad_req, meta.positions), (meta.req_indices, bad_pos)):
        got = indexer_scores_paged(q, w, icache, meta.block_table, req, pos, z["d_i"] ** -0.5,
                                   torch.full((T, s_max), float("nan"), device=device), block_s=block_s, tokens=4)
        assert got[1].isnan().all()
        got[1] = one[1]  # the other rows against the reference
        _check_indexer_scores(got, q, w, icache, meta, z, dtype, tol)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_topk_ties_negative_zero_and_small_rows(device):
    s = torch.tensor([[1.0, 3.0, 3.0, -0.0, 3.0, 3.0, -2.0, 0.0, 5.0, -1e30, 0.0, -0.0]], device=device)
    out = torch.zeros(1, 4, dtype=torch.int32, device=device)
    for p in range(12):
        topk_from_scores(s, torch.tensor([p], device=device), out, block=4)
        want = topk_indices(s.double().cpu(), torch.tensor([p]), 4)[0]
        assert sorted(out[0].tolist()) == sorted(want.tolist()), p
    zeros = torch.tensor([[0.0, -0.0, 0.0, -0.0, -0.0, 0.0]], device=device)
    topk_from_scores(zeros, torch.tensor([5], device=device), out, block=4)
    assert out[0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_indexer_scores_are_kept_and_selected_first(device):
    """A NaN in a key row, in one head of a query, or in a weight makes those scores NaN (ReLU keeps NaN, as
    torch.relu does), and the top-k ranks a NaN above every number, either sign of NaN, as torch.sort does: the
    reference, the interpreter and the compiled kernel give the same NaN positions and the same selections,
    on the one-program top-k and on the chunked one."""
    z = _sizes(device)
    meta, nb = _meta(device, [9, 0], [3, 12], z["block"])
    T = meta.num_tokens
    q, icache = torch.randn(T, z["h_i"], z["d_i"], device=device), torch.randn(nb, z["block"], z["d_i"], device=device)
    w = torch.randn(T, z["h_i"], device=device) * z["h_i"] ** -0.5
    bt = meta.block_table.long()
    icache[bt[0, 0], 2] = float("nan")  # request 0's key at position 2
    q[4, 1] = float("nan")  # one head of a token of request 1: every key of that token
    w[6, 0] = -float("nan")  # a weight, with the sign bit set
    s_max = max(meta.seq_lens_cpu)
    scores = torch.full((T, s_max), -7.0, device=device)
    indexer_scores_paged(q, w, icache, meta.block_table, meta.req_indices, meta.positions, z["d_i"] ** -0.5, scores)
    for b in range(meta.num_reqs):
        t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        keys = gather_tokens(icache, meta.block_table[b], meta.seq_lens_cpu[b]).double()
        ref = indexer_scores(q[t0:t1].double(), keys, w[t0:t1].double(), z["d_i"] ** -0.5)
        for i, t in enumerate(range(t0, t1)):
            n = int(meta.positions[t]) + 1
            assert torch.equal(scores[t, :n].isnan().cpu(), ref[i, :n].isnan().cpu()), t
    assert all(scores[t, :int(meta.positions[t]) + 1].isnan().all() for t in (4, 6))
    assert all(scores[t, 2].isnan() and scores[t, :2].isfinite().all() for t in range(3))
    k = 4
    for split_above in (10 ** 6, 0):  # one program per row; the chunked path
        out = torch.full((T, k), -7, dtype=torch.int32, device=device)
        topk_from_scores(scores, meta.positions, out, block=4, chunk=4, split_above=split_above)
        want = topk_indices(scores.double().cpu(), meta.positions.cpu(), k)
        for t in range(T):
            assert sorted(out[t].tolist()) == sorted(want[t].tolist()), (split_above, t)
        assert all(2 in out[t].tolist() for t in range(3))  # the NaN key is selected, not dropped
    signed = torch.tensor([[1.0, float("nan"), 3.0, 0.0, float("inf"), 2.0, 0.0, 0.5]], device=device)
    signed[0, [3, 6]] = -float("nan")  # the sign bit set: still above +inf
    out = torch.full((1, 3), -7, dtype=torch.int32, device=device)
    for split_above in (10 ** 6, 0):
        topk_from_scores(signed, torch.tensor([7], device=device), out, block=4, chunk=4, split_above=split_above)
        assert sorted(out[0].tolist()) == [1, 3, 6], split_above


@pytest.mark.parametrize("device,dtype,tol", MMA_CASES)
@pytest.mark.parametrize("heads", ["deepseek", "glm"])
@pytest.mark.parametrize("splits,valid_first", [(None, False), (1, True), (4, True)])
@pytest.mark.parametrize("tile", ["default", "short-steps"])
def test_sparse_mla(device, dtype, tol, heads, splits, valid_first, tile, seed):
    z = _sizes(device)
    H = z["H"] if heads == "deepseek" else max(z["H"] // 2, 2)
    if device == "cpu" and heads == "glm":
        H = 3  # not a multiple of the head block
    ctx, qlens = _shape_for(device, ([10, 0, 5], [3, 12, 1]), ([6000, 0, 100], [2, 70, 1]))
    meta, nb = _meta(device, ctx, qlens, z["block"])
    T, f = meta.num_tokens, dict(device=device, dtype=dtype)
    q = torch.randn(T, H, z["d_lat"] + z["rope"], **f)
    cache = torch.randn(nb, z["block"], z["d_lat"] + z["rope"], **f)
    topk = torch.full((T, z["k"]), -1, dtype=torch.int32, device=device)
    for t in range(T):
        n = int(meta.positions[t]) + 1
        topk[t, : min(n, z["k"])] = torch.randperm(n, device=device)[: z["k"]].int()
    topk[0, 1] = meta.seq_lens_cpu[0] + 3  # out of range: skipped
    topk[0, 2] = meta.seq_lens_cpu[0]  # the first position past the sequence (its block's row exists): skipped
    topk[1] = -1  # no valid key: out 0, lse +inf
    out = torch.full((T, H, z["d_lat"]), float("nan"), **f)
    lse = torch.full((T, H), float("nan"), device=device)
    # short steps: more steps per program, so that loading the next step's rows ahead crosses split borders
    config = {} if tile == "default" else dict(BLOCK_N=_shape_for(device, 4, 32), num_stages=_shape_for(device, 1, 3))
    config.update({} if splits is None else {"NUM_SPLITS": splits})
    sparse_mla_paged(q, cache, meta.block_table, meta.req_indices, meta.seq_lens, topk, 0.1, out, lse,
                     config=config, valid_first=valid_first)
    for b in range(meta.num_reqs):
        t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        kv = gather_tokens(cache, meta.block_table[b], meta.seq_lens_cpu[b])
        ref, ref_lse = sparse_mla(q[t0:t1].double(), kv.double(), topk[t0:t1], 0.1, z["d_lat"])
        assert_close(f"out of request {b}", out[t0:t1], ref, dtype=dtype, rtol=tol, atol=tol, row_dims=2)
        assert_close(f"lse of request {b}", lse[t0:t1], ref_lse, dtype=torch.float32, rtol=64, atol=64)
    assert (out[1] == 0).all()


def test_the_hopper_kernel_runs_only_where_it_applies(monkeypatch):
    """sparse_mla_paged runs the Gluon kernel only on a CUDA sm_90 device, for bf16 with DeepSeek's latent widths
    and without a config, under a triton it was built for; an interpreter run always takes the Triton kernel. Each
    refusal says why."""
    import triton

    from dsv32ref.kernels import sparse_mla_hopper
    from dsv32ref.kernels.sparse_mla import kernel_choice, launch_plan

    q = torch.zeros(256, 64, 576, dtype=torch.bfloat16)  # 256 programs: no top-k splits on 132 SMs
    assert launch_plan(q, 512, 2048, None, 132)[2:] == (1, False)  # a CPU tensor
    assert kernel_choice(q, 512, 1, None) == ("triton", "not a CUDA tensor")
    assert kernel_choice(q, 512, 1, {"BLOCK_N": 32}) == ("triton", "a tile config was given")
    from types import SimpleNamespace

    def fake(dtype=torch.bfloat16):  # what why_not reads of a CUDA tensor, without a GPU
        return SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=dtype)

    why = sparse_mla_hopper.why_not
    assert why(q, 512, 64) == "not a CUDA tensor"
    assert why(fake(torch.float16), 512, 64) == "torch.float16 (the sm_90 kernel is bf16)"
    assert why(fake(), 256, 64) == "latent widths 256 + 64 (the sm_90 kernel is 512 + 64)"
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    monkeypatch.setattr(sparse_mla_hopper, "_TRITON", "3.9")
    assert why(fake(), 512, 64) == "triton 3.9.0 (the sm_90 kernel is built for 3.6, 3.7, 3.8)"
    monkeypatch.undo()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        g = q.cuda()
        assert launch_plan(g, 512, 2048, None, 132)[2:] == (1, True)
        for args in ((g[:1], 512, 2048, None), (g, 512, 2048, {"BLOCK_N": 32}), (g.half(), 512, 2048, None),
                     (g[..., :320], 256, 2048, None)):  # splits; a config; fp16; other latent widths
            assert not launch_plan(*args, 132)[3], args[1:]
        # the heads on the MMA's N up to 32 heads a token, on its M past them
        assert [kernel_choice(g[:, :h], 512, 1, None)[0] for h in (1, 16, 32, 33, 64)] == (
            ["sm_90 heads as N"] * 3 + ["sm_90 key pairs"] * 2)
        assert kernel_choice(g, 512, 1, None, fp8=True)[0] == "sm_90 warp-specialized"  # FP8 rows


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 64, 40, 32, 24, 16])
@pytest.mark.parametrize("valid_first", [False, True])
def test_sparse_mla_hopper_kernel(heads, valid_first, seed):
    """sm_90's warp-specialized kernels, as sparse_mla_paged runs them over bf16 rows (the pair kernel, 64 heads a
    program, past 32 heads; heads as the MMA's N up to 32), against the reference and against the Triton kernel (a
    config selects that one): outputs poisoned; invalid, out-of-range and repeated indices; a token of a request
    outside the block table; a token with no valid key; block ids outside the cache (the producer zero-fills those
    rows and flags them invalid: they must not count); head counts that are not a multiple of a program's heads."""
    # with valid_first the top-k has 31 blocks of 64 keys: the pair kernel's last pair has no second block
    _check_sm90_kernel(heads, valid_first, 1984 if valid_first else 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("query_lens", [[70, 1, 33], [1, 1, 1]])
def test_sparse_mla_pair_kernel_on_generated_inputs(query_lens, seed):
    """The pair kernel (sparse_mla_paged's past 32 heads over bf16 rows) on the generator's inputs (NaN in every
    cache row no token selects), with one query row holding a NaN, infinite scores in both blocks of a pair and the
    outputs poisoned, against the oracle; the three decode tokens take top-k splits (each program a few pairs, fp32
    partials merged)."""
    from dsv32ref.kernels.sparse_mla import kernel_choice, launch_plan

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the pair kernel is sm_90's")
    x = paged_sparse_mla_inputs(num_heads=128, d_lat=512, d_rope=64, topk=1984, context_lens=[0, 3000, 40],
                                query_lens=query_lens, block_size=64, dtype=torch.bfloat16, device="cuda", seed=seed,
                                sm_scale=0.1352)
    x.q[-1, 1, 3] = float("nan")
    # an infinite k_pe in keys that a token selects in block 0 and block 1 of its first pair: a +inf or -inf score
    # (by the sign of q_pe's first value) in the one consumer's block and in the other's
    t = int((x.topk_indices >= 0).sum(1).argmax())
    for i in (0, 64 + 5):
        pos = int(x.topk_indices[t, i])
        if pos >= 0:
            blk = int(x.block_table[int(x.req_indices[t]), pos // 64])
            x.latent_cache[blk, pos % 64, 512] = float("inf")
    T, H = x.q.shape[:2]
    _, _, splits, sm90 = launch_plan(x.q, 512, 1984, None, torch.cuda.get_device_properties(0).multi_processor_count)
    assert sm90 and (splits > 1) == (T == 3), splits
    assert kernel_choice(x.q, 512, splits, None)[0] == "sm_90 key pairs"
    want_out, want_lse = reference_sparse_mla_paged(x)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((T, H), -7.0, device="cuda")
    sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                     out, lse)
    assert_close("out", out, want_out, dtype=torch.bfloat16, rtol=1, atol=1, row_dims=2)
    assert_close("lse", lse, want_lse, dtype=torch.float32, rtol=64, atol=64, row_dims=1)
    assert torch.isnan(out[-1, 1]).all() or not (x.topk_indices[-1] >= 0).any()  # the NaN reached its head only


@pytest.mark.parametrize("device,heads,kv_cache_dtype,config,kernel", [
    pytest.param("cpu", 4, "auto", None, "triton", marks=CPU),
    pytest.param("cuda", 128, "auto", None, "sm_90 key pairs", marks=pytest.mark.gpu),
    pytest.param("cuda", 16, "auto", None, "sm_90 heads as N", marks=pytest.mark.gpu),
    pytest.param("cuda", 64, "fp8", None, "sm_90 warp-specialized", marks=pytest.mark.gpu),
    pytest.param("cuda", 64, "auto", {"BLOCK_N": 32}, "triton", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("query_lens", [(3, 1, 2), (1, 1, 1)])  # the decode tokens take top-k splits on a GPU
@pytest.mark.parametrize("where", ["every key", "after finite keys"])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's scores past fp32
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # and inf - inf
def test_sparse_mla_flags_a_scaled_score_past_fp32s_range(device, heads, kv_cache_dtype, config, kernel, query_lens,
                                                          where, seed):
    """sm_scale 1e29 over queries of about 1e-30: scaled scores of order one, except in one head of one token, whose
    query is 1e40 times larger, so that its scaled scores pass fp32's range (finite in the float64 reference). Every
    kernel gives that head NaN out and lse, never out 0 and lse +inf ('no valid key'); every other head equals the
    reference; outputs poisoned. The pair kernel's exponent FFMA (s * scale - max, the product unrounded) gives
    such a score p 0, not NaN; then:
    - "every key": the head's top-k as drawn, every pair past fp32. Its rows meet a rescale between two maxima of
      +inf, exp2(inf - inf), which gives NaN by itself (on an H100 this case passed without the epilogue's guard).
    - "after finite keys": one top-k split; the token's last 128 slots hold distinct positions, the others -1, and
      only q_pe[0] of the head is large: its scores stay in range on the first 64 (their k_pe[0] is 0) and pass
      fp32 in the last block (one key's k_pe[0] is 1). The pair kernel's last pair is then (finite, past fp32): its
      max becomes +inf with no rescale between two maxima of +inf after it, every p and l are 0, and only the
      epilogue's guard keeps the head from reading as 'no valid key' (out 0, lse +inf)."""
    from dsv32ref.kernels.sparse_mla import kernel_choice, launch_plan

    gpu, fp8 = device == "cuda", kv_cache_dtype == "fp8"
    if gpu and kernel != "triton" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90's kernels")
    sizes = dict(d_lat=512, d_rope=64, topk=256, block_size=64) if gpu else dict(d_lat=32, d_rope=8, topk=16,
                                                                                   block_size=4)
    x = paged_sparse_mla_inputs(num_heads=heads, context_lens=(300, 500, 0), query_lens=query_lens, device=device,
                                seed=seed, sm_scale=1e29, kv_cache_dtype=kv_cache_dtype, **sizes)
    t = int((x.topk_indices >= 0).sum(1).argmax())  # a token with valid keys
    q = x.q.double() * 1e-30
    sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 4
    if where == "every key":
        q[t, 1] *= 1e40
    else:
        t, sms = 0, 1  # request 0's first query token (301 visible positions); one top-k split
        _past_fp32_after_finite_keys(x, t, min(sizes["topk"], 128))
        q[t, 1, x.d_lat] = 1e10  # q_pe's first value: past fp32 on the keys whose k_pe[0] is not small
    x.q = q.to(x.q.dtype)
    splits = launch_plan(x.q, x.d_lat, sizes["topk"], config, sms, fp8=fp8)[2]
    assert where == "every key" or splits == 1, splits
    assert kernel_choice(x.q, x.d_lat, splits, config, fp8=fp8)[0] == kernel
    want_out, want_lse = reference_sparse_mla_paged(x)
    assert want_out[t, 1].isfinite().all() and want_lse[t, 1].isfinite()
    want_out[t, 1], want_lse[t, 1] = float("nan"), float("nan")
    T, H = x.q.shape[:2]
    out = torch.full((T, H, x.d_lat), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), -7.0, device=device)
    sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                     out, lse, config=config, num_sms=sms)
    assert_close("out", out, want_out, dtype=torch.bfloat16, rtol=1, atol=1, row_dims=2)
    assert_close("lse", lse, want_lse, dtype=torch.float32, rtol=64, atol=64, row_dims=1)


def _past_fp32_after_finite_keys(x, t: int, n: int) -> None:
    """Token t's top-k for where="after finite keys": its last n slots hold n distinct visible positions, the others
    -1, so that under one split the program's last pair is these keys' two blocks (n = 128, 64-key blocks).
    k_pe[0] (column d_lat) is 0 in the rows of the first n / 2 and 1 in the last one's, exactly (in FlashMLA's rows:
    the bf16 k_pe, under the same scales): a query large only in q_pe[0] scores the first block within fp32's range
    and the last row past it."""
    req = int(x.req_indices[t])
    pos = torch.randperm(int(x.positions[t]) + 1, generator=torch.Generator().manual_seed(t))[:n]
    assert len(pos) == n, (int(x.positions[t]), n)
    K, bs = x.topk_indices.shape[1], x.latent_cache.shape[1]
    x.topk_indices[t] = -1
    x.topk_indices[t, K - n:] = pos.int().to(x.topk_indices.device)
    for at, value in ((pos[: n // 2], 0.0), (pos[-1:], 1.0)):
        blk, off = x.block_table[req, at // bs].long().cpu(), at % bs
        rows = x.latent_cache[blk, off]
        if rows.dtype == torch.uint8:  # FlashMLA's rows: the fp8 values and scales as they were
            latent = dequantize_latent(rows)
            latent[:, x.d_lat] = value
            rows = quantize_latent(latent, latent_parts(rows)[1])
        else:
            rows = rows.clone()
            rows[:, x.d_lat] = value
        x.latent_cache[blk, off] = rows


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_heads_as_n_over_splits_holds_a_token_that_selects_nothing(heads, kv_cache_dtype, seed):
    """Three decode tokens on sm_90's heads-as-N kernel (top-k splits, fp32 partials merged), over bf16 rows and
    FlashMLA's: a token whose top-k is all -1 (every split of it empty) gets out 0 and lse +inf exactly; a token
    whose valid keys all lie in its last 64 slots (its other splits empty) and the third equal the float64
    reference; unselected rows NaN, outputs poisoned."""
    from dsv32ref.kernels.sparse_mla import kernel_choice, launch_plan

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the heads-as-N kernel is sm_90's")
    fp8 = kv_cache_dtype == "fp8"
    x = paged_sparse_mla_inputs(num_heads=heads, topk=2048, context_lens=(3000, 5000, 100), query_lens=(1, 1, 1),
                                block_size=64, dtype=torch.bfloat16, device="cuda", seed=seed,
                                kv_cache_dtype=kv_cache_dtype)
    x.topk_indices[0] = -1
    x.topk_indices[1, :-64] = -1
    x.topk_indices[1, -64:] = torch.randperm(5001, device="cuda")[:64].int()  # distinct visible positions
    _, _, splits, sm90 = launch_plan(x.q, 512, 2048, None, torch.cuda.get_device_properties(0).multi_processor_count,
                                     fp8=fp8)
    assert sm90 and splits > 1 and kernel_choice(x.q, 512, splits, None, fp8=fp8)[0] == "sm_90 heads as N", splits
    out = torch.full((3, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((3, heads), float("nan"), device="cuda")
    sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                     out, lse)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()
    ref, ref_lse = reference_sparse_mla_paged(x)
    assert_close("out", out, ref, dtype=torch.bfloat16, row_dims=2, rtol=1, atol=1)
    assert_close("lse", lse, ref_lse, dtype=torch.float32, rtol=64, atol=64)


def _check_sm90_kernel(heads: int, valid_first: bool, k: int) -> None:
    """The cases of test_sparse_mla_hopper_kernel, at k top-k slots a token."""
    from dsv32ref.kernels.sparse_mla import DEFAULT_CONFIG, launch_plan

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized kernel is sm_90's")
    z = dict(_sizes("cuda"), k=k)
    meta, nb = _meta("cuda", [3000, 0, 200], [5, 64, 1], z["block"])
    T, f = meta.num_tokens, dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(T, heads, z["d_lat"] + z["rope"], **f)
    cache = torch.randn(nb, z["block"], z["d_lat"] + z["rope"], **f)
    if valid_first:  # as the indexer writes them: distinct visible positions first, then -1 or out of range
        topk = torch.full((T, z["k"]), -1, dtype=torch.int32, device="cuda")
        for t, p in enumerate(meta.positions.tolist()):
            sel = torch.randperm(p + 1, device="cuda")[: z["k"] - 3].int()
            topk[t, : len(sel)] = sel
            topk[t, len(sel): len(sel) + 2] = torch.tensor([p + 5, 10 ** 6], dtype=torch.int32)
    else:  # anything: repeats, -1, past the sequence
        topk = torch.stack([torch.randint(-1, int(p) + 2, (z["k"],), device="cuda") for p in meta.positions]).int()
    topk[0] = -1  # no valid key
    req = meta.req_indices.clone()
    req[1] = meta.num_reqs  # a request outside the block table: attends to nothing
    bt = meta.block_table.clone()
    bt[0, 3], bt[0, 7] = -1, nb + 7  # request 0's keys 192..255 and 448..511 are in no block of the cache
    bad = torch.zeros(meta.num_reqs, bt.shape[1] * z["block"], dtype=torch.bool, device="cuda")
    bad[0, 3 * z["block"]: 4 * z["block"]] = bad[0, 7 * z["block"]: 8 * z["block"]] = True
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert launch_plan(q, z["d_lat"], z["k"], None, sms)[3]  # T x head blocks fill the SMs: no splits
    outs = {}
    for name, config in (("hopper", None), ("triton", dict(DEFAULT_CONFIG))):
        out = torch.full((T, heads, z["d_lat"]), float("nan"), **f)
        lse = torch.full((T, heads), float("nan"), device="cuda")
        sparse_mla_paged(q, cache, bt, req, meta.seq_lens, topk, 0.1, out, lse, config=config,
                         valid_first=valid_first)
        outs[name] = out, lse
        for b in range(meta.num_reqs):
            t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
            kv = gather_tokens(cache, bt[b].clamp(0, nb - 1), meta.seq_lens_cpu[b])
            idx = torch.where(topk[t0:t1] < meta.seq_lens_cpu[b], topk[t0:t1], -1)
            idx[(req[t0:t1] != b)] = -1
            idx[bad[b][idx.clamp_min(0).long()] & (idx >= 0)] = -1
            ref, ref_lse = sparse_mla(q[t0:t1].double(), kv.double(), idx, 0.1, z["d_lat"])
            assert_close(f"{name}: out of request {b}", out[t0:t1], ref, dtype=torch.bfloat16, rtol=1, atol=1,
                         row_dims=2)
            assert_close(f"{name}: lse of request {b}", lse[t0:t1], ref_lse, dtype=torch.float32, rtol=64, atol=64)
        for t in (0, 1):
            assert (out[t] == 0).all() and torch.isposinf(lse[t]).all(), (name, t)
    # the two kernels agree per element to bf16 rounding of the same fp32 sums
    assert_close("hopper vs triton", outs["hopper"][0], outs["triton"][0].double(), dtype=torch.bfloat16, rtol=2,
                 atol=2, row_dims=2)


# requests of 6, 101, 64 and 65 keys, 13 tokens: the first and third are few-keys tokens (64 keys: the last that is)
FEW_KEYS_LENS = dict(context_lens=(0, 100, 61, 62), query_lens=(6, 1, 3, 3))


def _few_keys_step(heads: int, num_sms: int | None, device: str, dtype, seed: int, skip_few: bool,
                   **sizes) -> list[str]:
    """sparse_mla_paged over FEW_KEYS_LENS's step (valid-first top-k of 128 slots, unselected rows NaN, a NaN query
    value in a few-keys token, its last token's request outside the block table: no key, so a few-keys token too;
    outputs poisoned) against the float64 reference per element -> the kernels it launched. skip_few: the few-keys
    launch is not run, and its tokens must keep their poison, a finite one (no other launch writes them)."""
    from dsv32ref.kernels.sparse_mla import FEW_KEYS, FEW_KEYS_CONFIG, few_keys_launch

    x = paged_sparse_mla_inputs(num_heads=heads, topk=128, valid_first=True, dtype=dtype, device=device, seed=seed,
                                **FEW_KEYS_LENS, **sizes)
    T = x.q.shape[0]
    assert few_keys_launch(T, heads, None, True)
    t = int((x.topk_indices[:6] >= 0).any(1).nonzero()[0])  # a few-keys token that selects a key
    x.q[t, 5, 1] = float("nan")  # one of its heads: NaN there only
    B = len(FEW_KEYS_LENS["query_lens"])
    x.req_indices[-1] = B
    few = torch.tensor([r >= B or int(x.seq_lens[r]) <= FEW_KEYS for r in x.req_indices.tolist()])
    assert few.tolist() == [True] * 6 + [False] + [True] * 3 + [False, False, True]
    poison = 7.0 if skip_few else float("nan")  # a NaN that a merge of NaN partials writes would pass for poison
    out = torch.full((T, heads, x.d_lat), poison, dtype=dtype, device=device)
    lse = torch.full((T, heads), -poison, device=device)
    names = []

    def observe(name, run):
        names.append(name)
        few_launch = name == "_sparse_mla_kernel" and run.keywords.get("BLOCK_H") == FEW_KEYS_CONFIG["BLOCK_H"]
        return None if skip_few and few_launch else run()
    with observing_launches(observe):
        sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                         out, lse, valid_first=True, num_sms=num_sms)
    ref, ref_lse = reference_sparse_mla_paged(x)
    ref[-1], ref_lse[-1] = 0.0, float("inf")  # the token of no request
    if skip_few:
        assert (out[few] == poison).all() and (lse[few] == -poison).all()
    rows = ~few if skip_few else torch.ones(T, dtype=torch.bool)
    tol = 1 if dtype == torch.bfloat16 else 64  # fp32: the summation orders differ by more units of the dtype
    assert_close("out", out[rows], ref[rows], dtype=dtype, rtol=tol, atol=tol, row_dims=2)
    assert_close("lse", lse[rows], ref_lse[rows], dtype=torch.float32, rtol=64, atol=64, row_dims=1)
    if not skip_few:
        assert out[t, 5].isnan().all() and not out[t, 4].isnan().any()
    return names


@CPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("skip_few", [False, True])
@pytest.mark.parametrize("num_sms,launched", [(None, ["_sparse_mla_kernel"] * 2),
                                              (200, ["_sparse_mla_kernel", "_combine_splits_kernel",
                                                     "_sparse_mla_kernel"])])
def test_sparse_mla_few_keys_tokens_take_a_launch_of_their_own(num_sms, launched, skip_few, dtype, seed):
    """A step of 13 tokens over 64 heads, two of its requests with at most FEW_KEYS keys and a token of no request:
    those tokens take the few-keys launch, the others the plan's (one split, or two merged), per element against
    float64, the boundary (64 keys and 65) on either side, partials and outputs poisoned; without the few-keys
    launch its tokens stay poisoned (the plan's launch and its merge leave them alone)."""
    assert _few_keys_step(64, num_sms, "cpu", dtype, seed, skip_few, d_lat=32, d_rope=16, block_size=16) == launched


@pytest.mark.gpu
@pytest.mark.parametrize("skip_few", [False, True])
@pytest.mark.parametrize("heads,kv_cache_dtype", [(64, "auto"), (128, "auto"), (64, "fp8")])
def test_sparse_mla_few_keys_tokens_beside_the_sm90_kernels(heads, kv_cache_dtype, skip_few, seed):
    """The same step compiled: the few-keys tokens in the Triton launch, the others in the pair kernel (bf16
    rows) or the warp-specialized one (FlashMLA's FP8 rows) with top-k splits, which leave them alone."""
    names = _few_keys_step(heads, None, "cuda", torch.bfloat16, seed, skip_few, block_size=64,
                           kv_cache_dtype=kv_cache_dtype)
    main = "_sparse_mla_ws_kernel" if kv_cache_dtype == "fp8" else "_sparse_mla_pairs_kernel"
    assert names == [main, "_combine_splits_kernel", "_sparse_mla_kernel"]


@CPU
def test_sparse_mla_few_keys_off_is_one_launch(seed):
    """few_keys=False (the engine's decode steps): the plan's launch alone takes every token; a non-bool refused."""
    x = paged_sparse_mla_inputs(num_heads=64, d_lat=32, d_rope=16, topk=128, valid_first=True, seed=seed,
                                block_size=16, **FEW_KEYS_LENS)
    T = x.q.shape[0]
    out = torch.full((T, 64, 32), float("nan"), dtype=x.q.dtype)
    lse = torch.full((T, 64), float("nan"))
    args = (x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale, out, lse)
    names = []
    with observing_launches(lambda name, run: (names.append(name), run())[1]):
        sparse_mla_paged(*args, valid_first=True, few_keys=False)
    assert names == ["_sparse_mla_kernel"]
    ref, ref_lse = reference_sparse_mla_paged(x)
    assert_close("out", out, ref, dtype=x.q.dtype, rtol=1, atol=1, row_dims=2)
    with pytest.raises(ValueError, match="few_keys"):
        sparse_mla_paged(*args, valid_first=True, few_keys=1)


@CPU
def test_sparse_mla_top_k_within_few_keys_is_the_few_keys_launch_alone(seed):
    """A top-k of 64 slots: no token has more to visit, so the few-keys launch takes every token, alone."""
    from dsv32ref.kernels.sparse_mla import FEW_KEYS, FEW_KEYS_CONFIG

    x = paged_sparse_mla_inputs(num_heads=64, d_lat=32, d_rope=16, topk=FEW_KEYS, valid_first=True, seed=seed,
                                block_size=16, **FEW_KEYS_LENS)
    T = x.q.shape[0]
    out = torch.full((T, 64, 32), float("nan"), dtype=x.q.dtype)
    lse = torch.full((T, 64), float("nan"))
    launched = []
    with observing_launches(lambda name, run: (launched.append((name, run.keywords["BLOCK_H"])), run())[1]):
        sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                         out, lse, valid_first=True, num_sms=200)
    assert launched == [("_sparse_mla_kernel", FEW_KEYS_CONFIG["BLOCK_H"])]
    ref, ref_lse = reference_sparse_mla_paged(x)
    assert_close("out", out, ref, dtype=x.q.dtype, rtol=1, atol=1, row_dims=2)
    assert_close("lse", lse, ref_lse, dtype=torch.float32, rtol=64, atol=64, row_dims=1)


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_sparse_mla_unpacked_cache_matches_packed(device, dtype, tol, seed):
    """The kernel resolves (block, offset) to one row number in units of the cache's row stride. A view whose
    blocks are not back to back (every other block of a larger pool) gives the same output, bit for bit, as
    the packed copy of the same cache."""
    z = _sizes(device)
    meta, nb = _meta(device, *_shape_for(device, ([9, 4], [2, 3]), ([3000, 500], [5, 64])), z["block"])
    T, f = meta.num_tokens, dict(device=device, dtype=dtype)
    q = torch.randn(T, z["H"], z["d_lat"] + z["rope"], **f)
    pool = torch.randn(nb, 2, z["block"], z["d_lat"] + z["rope"], **f)
    unpacked = pool[:, 0]  # [NB, BS, D] with stride(0) = 2 * BS * D
    topk = torch.stack([torch.randint(0, int(p) + 1, (z["k"],), device=device) for p in meta.positions]).int()
    outs = []
    for cache in (unpacked, unpacked.contiguous()):
        out = torch.full((T, z["H"], z["d_lat"]), float("nan"), **f)
        sparse_mla_paged(q, cache, meta.block_table, meta.req_indices, meta.seq_lens, topk, 0.1, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    for b in range(meta.num_reqs):
        t0, t1 = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        kv = gather_tokens(unpacked.contiguous(), meta.block_table[b], meta.seq_lens_cpu[b])
        ref, _ = sparse_mla(q[t0:t1].double(), kv.double(), topk[t0:t1], 0.1, z["d_lat"])
        assert_close(f"out of request {b}", outs[0][t0:t1], ref, dtype=dtype, rtol=tol, atol=tol, row_dims=2)


@CPU
def test_launchers_reject_bad_inputs():
    q, cache = torch.zeros(2, 4, 40), torch.zeros(3, 4, 40)
    bt, req, sl = torch.zeros(1, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    topk, out = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 4, 32)
    with pytest.raises(ValueError, match="topk_indices: expected dtype torch.int32, got torch.int64"):
        sparse_mla_paged(q, cache, bt, req, sl, topk.long(), 0.1, out)
    with pytest.raises(ValueError, match=r"latent_cache: expected shape \[\*, \*, 40\], got \[3, 4, 48\]"):
        sparse_mla_paged(q, torch.zeros(3, 4, 48), bt, req, sl, topk, 0.1, out)
    with pytest.raises(ValueError, match="qk_rope_head_dim .* must be a power of two, got 12"):
        sparse_mla_paged(torch.zeros(2, 4, 44), torch.zeros(3, 4, 44), bt, req, sl, topk, 0.1, out)
    with pytest.raises(ValueError, match="out: expected dtype torch.float32, got torch.bfloat16"):
        sparse_mla_paged(q, cache, bt, req, sl, topk, 0.1, out.bfloat16())
    with pytest.raises(ValueError, match="latent_cache: a tensor on the meta device holds no values"):
        sparse_mla_paged(q, cache.to("meta"), bt, req, sl, topk, 0.1, out)
    # a second device (meta stands in for one here, as check_tensor refuses it before)
    with pytest.raises(ValueError, match="tensors on different devices: q on cpu, latent_cache on meta"):
        check_same_device(q=q, latent_cache=cache.to("meta"))
    with pytest.raises(ValueError, match=r"out: the last dim must be dense \(stride 1 at dim 2\), got strides \(256, 64, 2\)"):
        sparse_mla_paged(q, cache, bt, req, sl, topk, 0.1, torch.zeros(2, 4, 64)[..., ::2])
    with pytest.raises(ValueError, match=r"latent_cache: stride\(0\) must be a multiple of stride\(1\) > 0 .*got strides "
                       r"\(161, 40, 1\)"):
        sparse_mla_paged(q, torch.zeros(3 * 161).as_strided((3, 4, 40), (161, 40, 1)), bt, req, sl, topk, 0.1, out)
    with pytest.raises(ValueError, match="sparse_mla_paged: config: unknown key.*SLOTS"):
        sparse_mla_paged(q, cache, bt, req, sl, topk, 0.1, out, config=dict(SLOTS=True))
    with pytest.raises(ValueError, match="sparse_mla_paged: NUM_SPLITS must be a power of two, got 3"):
        sparse_mla_paged(q, cache, bt, req, sl, topk, 0.1, out, config=dict(NUM_SPLITS=3))
    with pytest.raises(ValueError, match=r"weights: expected shape \[2, 4\], got \[2, 3\]"):
        indexer_topk_paged(torch.zeros(2, 4, 16), torch.zeros(2, 3), torch.zeros(3, 4, 16), bt, req,
                           torch.zeros(2, dtype=torch.long), 0.1, torch.zeros(2, 8), torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out: expected dtype torch.int32, got torch.int64"):
        topk_from_scores(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"latent_cache: expected shape \[\*, \*, 41\], got \[3, 4, 40\]"):  # kv is 41 wide
        fused_norm_rope(torch.zeros(2, 48), torch.ones(48), torch.zeros(2, 48), torch.zeros(2, 41), torch.ones(32),
                        torch.zeros(3, 4, 40), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                        torch.zeros(8, 4), torch.zeros(8, 4), 1e-6)
    with pytest.raises(ValueError, match=r"weights: expected shape \[2, 8\], got \[2, 4\]"):
        fused_q(torch.zeros(2, 4, 32), torch.zeros(2, 4, 24), torch.zeros(2, 4, 40), torch.zeros(2, dtype=torch.long),
                torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(2, 8, 16), torch.zeros(2, 8, 16),
                torch.zeros(2, 4), torch.zeros(2, 8))


def _captured(fn):
    """fn run once (compiled outside the capture), then captured: the CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.gpu
def test_kernels_replay_in_cuda_graph(seed):
    """Capture indexer_topk + sparse_mla once, then change the metadata and data in the static buffers:
    replays must follow (nothing baked in on the host), and equal eager launches."""
    z = _sizes("cuda")
    meta, nb = _meta("cuda", [3000, 100], [1, 1], z["block"])  # a decode batch of two requests
    T, f = meta.num_tokens, dict(device="cuda", dtype=torch.bfloat16)
    q_idx, w = torch.randn(T, z["h_i"], z["d_i"], **f), torch.randn(T, z["h_i"], device="cuda")
    icache = torch.randn(nb + 8, z["block"], z["d_i"], **f)
    latent = torch.randn(nb + 8, z["block"], z["d_lat"] + z["rope"], **f)
    q = torch.randn(T, z["H"], z["d_lat"] + z["rope"], **f)
    bt = torch.full((2, 64), 0, dtype=torch.int32, device="cuda")
    bt[:, : meta.block_table.shape[1]] = meta.block_table.clamp_min(0)
    positions, seq_lens, req = meta.positions.clone(), meta.seq_lens.clone(), meta.req_indices.clone()
    scores = torch.empty(T, 64 * z["block"], device="cuda")
    topk = torch.empty(T, z["k"], dtype=torch.int32, device="cuda")
    out = torch.empty(T, z["H"], z["d_lat"], **f)

    def step():
        indexer_topk_paged(q_idx, w, icache, bt, req, positions, z["d_i"] ** -0.5, scores, topk)
        sparse_mla_paged(q, latent, bt, req, seq_lens, topk, 0.1, out)

    g = _captured(step)
    for trial in range(3):
        positions.add_(17 * (trial + 1))  # decode moves on: longer contexts, new data
        seq_lens.copy_(positions[[0, 1]] + 1)
        q_idx.normal_()
        q.normal_()
        g.replay()
        got_topk, got_out = topk.clone(), out.clone()
        step()
        assert torch.equal(torch.sort(got_topk, -1).values, torch.sort(topk, -1).values)
        assert torch.equal(got_out, out)
        assert int((got_topk >= 0).sum()) == sum(min(int(p) + 1, z["k"]) for p in positions)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_topk_split_path_matches_reference(device, seed):
    """Few long rows take the chunked path (a launch per radix pass over all chunks, then a compaction): same
    sets as the reference, in increasing order, ties included, also with chunks shorter than the top-k."""
    T, S, K = 6, _shape_for(device, 70, 40000), _shape_for(device, 6, 2048)
    chunk = _shape_for(device, 4, 1024)
    scores = torch.randint(0, 4, (T, S), device=device).float()  # heavy ties across chunk borders
    scores[0] = torch.randn(S, device=device)
    positions = torch.tensor([S - 1, K - 2, K, S // 2, chunk + 1, K - 1], device=device)
    out = torch.full((T, K), -7, dtype=torch.int32, device=device)
    topk_from_scores(scores, positions, out, block=_shape_for(device, 4, 1024), chunk=chunk, split_above=0)
    want = topk_indices(scores.double().cpu(), positions.cpu(), K)
    for t in range(T):
        got = out[t].tolist()
        assert sorted(got) == sorted(want[t].tolist()), t
        valid = [g for g in got if g >= 0]
        assert valid == sorted(valid) and got[len(valid):] == [-1] * (K - len(valid))


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_topk_split_path_places_a_later_chunks_keys_after_the_ties_it_takes(device):
    """The chunked top-k's compaction, where an earlier chunk holds more keys equal to the threshold than are taken
    and a later chunk keys above it: each chunk writes at its own offset, and nothing past out's K columns (out
    is a view into a wider buffer)."""
    buf = torch.full((1, 10), -7, dtype=torch.int32, device=device)
    scores = torch.tensor([[1.0, 1, 1, 1, 5, 5, 0, 0]], device=device)
    topk_from_scores(scores, torch.tensor([7], device=device), buf[:, :3], block=4, chunk=4, split_above=0)
    assert buf[0].tolist() == [0, 4, 5] + [-7] * 7


@pytest.mark.gpu
@pytest.mark.parametrize("T,ctx", [(1, 40000), (3, 9000)])  # the chunked top-k (six launches), the one-program one
def test_indexer_chained_launches_replay_like_plain_ones(T, ctx, seed):
    """Under programmatic dependent launch each kernel may start while the one before runs (it waits before it
    reads that one's output): captured in a CUDA graph and replayed on changing inputs, the chain gives the
    scores and the top-k of plain launches, bit for bit."""
    z = _sizes("cuda")
    meta, nb = _meta("cuda", [ctx - 1] * T, [1] * T, z["block"])
    f = dict(device="cuda", dtype=torch.bfloat16)
    q_idx, w = torch.randn(T, z["h_i"], z["d_i"], **f), torch.randn(T, z["h_i"], device="cuda")
    icache = torch.randn(nb, z["block"], z["d_i"], **f)
    args = (q_idx, w, icache, meta.block_table, meta.req_indices, meta.positions, z["d_i"] ** -0.5)
    scores, topk = torch.empty(T, ctx, device="cuda"), torch.empty(T, z["k"], dtype=torch.int32, device="cuda")

    def chained():
        indexer_scores_paged(*args, scores)
        topk_from_scores(scores, meta.positions, topk, pdl=True)

    g = _captured(chained)
    for trial in range(3):
        q_idx.normal_()
        icache.normal_()
        scores.fill_(float("nan"))
        topk.fill_(-7)
        g.replay()
        want_scores = indexer_scores_paged(*args, torch.full_like(scores, float("nan")))
        want_topk = topk_from_scores(want_scores, meta.positions, torch.full_like(topk, -7), pdl=False)
        assert torch.equal(scores, want_scores), trial
        assert torch.equal(topk, want_topk), trial


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_q_with_more_indexer_heads_than_mla_heads(device, seed):
    """A tensor-parallel rank holds H / tp MLA heads but the whole (replicated) indexer."""
    T, H, H_I = 3, 2, 4
    f = dict(device=device, dtype=torch.float32)
    q_lat, q = torch.randn(T, H, 32, **f), torch.randn(T, H, 24, **f)
    q_idx, w = torch.randn(T, H_I, 16, **f), torch.randn(T, H_I, **f)
    cfg = ModelConfig.preset("deepseek-v3.2").replace(qk_rope_head_dim=8, index_head_dim=16)
    cos, sin = RotaryEmbedding(cfg).to(device)(torch.arange(64, device=device))
    pos = torch.tensor([0, 5, 63], device=device)
    q_mqa, qi_out, w_out = torch.full((T, H, 40), float("nan"), **f), torch.full_like(q_idx, float("nan")), torch.full_like(w, float("nan"))
    fused_q(q_lat, q, q_mqa, pos, cos, sin, q_idx, qi_out, w, w_out, indexer_interleaved=True)
    c, s = cos[pos], sin[pos]
    assert_close("q_mqa", q_mqa, torch.cat((q_lat, apply_rope(q[..., 16:], c, s, True)), -1), rtol=64, atol=64,
                 row_dims=2)
    assert_close("q_idx", qi_out, torch.cat((apply_rope(q_idx[..., :8], c, s, True), q_idx[..., 8:]), -1),
                 rtol=64, atol=64, row_dims=2)
    assert_close("weights", w_out, w * H_I ** -0.5, rtol=2, atol=0)
