"""The FP8 caches as deployed (FlashMLA's 656-byte latent rows, DeepGEMM's paged indexer keys): the bytes where
the formats put them, round trips bit-exact, the values fp8 rounding gives, the reference over them against the
bf16 reference, and what a hostile caller passes."""

import dataclasses
import struct

import pytest
import torch
import triton
import triton.language as tl

from dsv32ref.reference import hadamard_transform, indexer_scores, sparse_mla
from dsv32ref.reference.fp8_cache import (LATENT_ROW_BYTES, dequantize_indexer_keys, dequantize_latent,
                                          gather_indexer_keys, gather_latent, indexer_key_bytes, indexer_key_parts,
                                          indexer_scores_fp8, latent_parts, latent_scale, quantize_indexer_keys,
                                          quantize_latent, sparse_mla_fp8, write_indexer_keys, write_latent)
from dsv32ref.kernels.fp8 import cast, e4m3_bytes, pow2_scale
from dsv32ref.kernels.indexer_topk import indexer_scores_paged, scores_block
from dsv32ref.kernels.launch import observing_launches
from dsv32ref.kernels.sparse_mla import sparse_mla_paged
from dsv32ref.testing import (assert_close, fp8_indexer_inputs, fp8_sparse_decode_inputs, paged_sparse_mla_inputs,
                              reference_indexer_scores_fp8, reference_sparse_decode_fp8, reference_sparse_mla_paged)
from helpers import hadamard_butterflies_fp32

pytestmark = pytest.mark.usefixtures("poisoned_partials")  # sparse_mla_paged's split partials start as NaN


def _fp8_byte(v: float) -> int:
    """The e4m3 byte of a value that is exactly representable (an independent encoder: sign, 4-bit exponent with
    bias 7, 3-bit mantissa; subnormals below 2^-6)."""
    sign, a = (0x80 if v < 0 else 0), abs(v)
    if a == 0:
        return sign
    e = max(int(torch.tensor(a).log2().floor()), -6)
    m = a / 2.0 ** e - (1 if e > -6 or a >= 2 ** -6 else 0)
    exp_field = e + 7 if a >= 2 ** -6 else 0
    return sign | exp_field << 3 | int(round(m * 8))


def test_latent_row_bytes_sit_where_flashmla_puts_them():
    """One row, built by hand: group i of c_kv holds +-(i + 1) x 2^(i - 3) patterns whose amax is 448 x 2^-i, so the
    scales are 2^-i exactly; values, scales (little-endian fp32) and k_pe (bf16) at bytes 0, 512 and 528."""
    c_kv = torch.zeros(4, 128)
    for i in range(4):
        c_kv[i, 0], c_kv[i, 1], c_kv[i, 2 + i] = 448 * 2.0 ** -i, -(2.0 ** -i), 1.5 * 2.0 ** -i
    k_pe = torch.arange(64, dtype=torch.float32) / 8 - 3
    row = quantize_latent(torch.cat((c_kv.flatten(), k_pe))[None])[0]
    assert row.shape == (LATENT_ROW_BYTES,) == (656,) and row.dtype == torch.uint8
    b = bytes(row.tolist())
    for i in range(4):
        assert struct.unpack_from("<f", b, 512 + 4 * i)[0] == 2.0 ** -i, i
        group = b[128 * i: 128 * (i + 1)]
        assert group[0] == _fp8_byte(448.0) and group[1] == _fp8_byte(-1.0) and group[2 + i] == _fp8_byte(1.5), i
        assert sum(group) == group[0] + group[1] + group[2 + i]  # the rest are +0.0
    assert b[528:] == k_pe.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def test_indexer_key_bytes_sit_where_deepgemm_puts_them():
    """Per block: block_kv x D values token by token, then block_kv fp32 scales; one scale per token."""
    keys = torch.zeros(2, 4, 8)
    for blk in range(2):
        for t in range(4):
            keys[blk, t, t] = 448.0 * 2.0 ** -(t + blk)  # token t of block blk: scale 2^-(t + blk)
    cache = quantize_indexer_keys(keys)
    assert cache.shape == (2, 4, 1, 12) and indexer_key_bytes(128) == 132
    b = bytes(cache[1].flatten().tolist())
    for t in range(4):
        assert b[t * 8 + t] == _fp8_byte(448.0) and struct.unpack_from("<f", b, 32 + 4 * t)[0] == 2.0 ** -(t + 1)


def test_round_trips_are_bit_exact_on_any_valid_bytes(seed):
    """Random bytes of every valid kind (fp8 values but the NaN codes, power-of-two scales, finite bf16 k_pe): read,
    dequantised and quantised again with their own scales, the same bytes come back; and a quantised row
    dequantises to fp8(x / s) x s."""
    g = torch.Generator().manual_seed(seed)
    n = 64
    values = torch.randint(0, 256, (n, 512), generator=g, dtype=torch.uint8)
    values[(values & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
    scales = torch.exp2(torch.randint(-20, 10, (n, 4), generator=g).float())
    k_pe = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    rows = torch.cat((values, scales.view(torch.uint8).view(n, 16), k_pe.view(torch.uint8).view(n, 128)), -1)
    parts = latent_parts(rows)
    assert torch.equal(parts[1], scales) and torch.equal(parts[2], k_pe)
    assert torch.equal(quantize_latent(dequantize_latent(rows), parts[1]), rows)
    keys = torch.randint(0, 256, (3, 8, 16), generator=g, dtype=torch.uint8)
    keys[(keys & 0x7F) == 0x7F] = 0
    kscale = torch.exp2(torch.randint(-20, 10, (3, 8), generator=g).float())
    cache = torch.cat((keys.view(3, 128), kscale.view(torch.uint8).view(3, 32)), -1).view(3, 8, 1, 20)
    assert torch.equal(quantize_indexer_keys(dequantize_indexer_keys(cache), indexer_key_parts(cache)[1]), cache)
    x = torch.randn(5, 576, generator=g, dtype=torch.float64) * 10
    s = latent_scale(x[:, :512].reshape(5, 4, 128).abs().amax(-1).float())
    want = ((x[:, :512].reshape(5, 4, 128) / s[..., None]).float().to(torch.float8_e4m3fn).double()
            * s[..., None]).reshape(5, 512)
    got = dequantize_latent(quantize_latent(x))
    assert torch.equal(got[:, :512].double(), want) and torch.equal(got[:, 512:], x[:, 512:].to(torch.bfloat16).float())


def test_scales_follow_each_format():
    """FlashMLA's latent: 2^ceil(log2(max(amax / 448, 1e-4))) (so an all-zero group gets 2^-13); DeepGEMM's keys
    as vLLM quantises them: 2^ceil(log2(max(amax, 1e-4) / 448)); values saturate at 448."""
    assert latent_scale(torch.tensor([0.0, 448.0, 449.0, 224.0])).tolist() == [2.0 ** -13, 1.0, 2.0, 0.5]
    z = quantize_latent(torch.zeros(1, 576))
    assert latent_parts(z)[1].tolist() == [[2.0 ** -13] * 4]
    k = quantize_indexer_keys(torch.tensor([[[0.0] * 4, [896.0, 1, 0, 0]]]))
    assert indexer_key_parts(k)[1].tolist() == [[2.0 ** -22, 2.0]]
    big = torch.zeros(1, 576)
    big[0, 0], big[0, 1] = 1000.0, -1000.0  # past 448 at a given scale of 1: saturated, not NaN
    assert latent_parts(quantize_latent(big, torch.ones(1, 4)))[0][0, :2].float().tolist() == [448.0, -448.0]


def test_scales_are_exact_powers_of_two_at_the_boundaries(seed):
    """amax = 448 x 2^k takes 2^k, the next float32 up 2^(k + 1) (fp32 log2 rounds that quotient down to k: the value
    would saturate); elsewhere the scale is 2^ceil(log2(max(amax / 448, 1e-4))) computed in float64; zero and
    subnormal amax take the floor."""
    from dsv32ref.reference.numerics import pow2_scale, ue8m0_scale
    k = torch.arange(-12, 40)
    at = 448.0 * torch.exp2(k.float())
    up = torch.nextafter(at, torch.tensor(float("inf")))
    assert torch.equal(pow2_scale(at, -13), torch.exp2(k.float())) and torch.equal(pow2_scale(up, -13), torch.exp2(k + 1.0))
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(100_000, generator=g) * torch.exp2(torch.randint(-40, 40, (100_000,), generator=g).float())
    want = torch.exp2(torch.ceil(torch.log2((x.double() / 448).clamp(min=1e-4))))
    assert torch.equal(pow2_scale(x, -13).double(), want)
    want = torch.exp2(torch.ceil(torch.log2(x.double().clamp(min=1e-4) / 448)))
    assert torch.equal(ue8m0_scale(x).double(), want)
    assert latent_scale(torch.tensor([0.0, 1e-45])).tolist() == [2.0 ** -13] * 2
    tiny = torch.tensor([1e-300, 1e-46, 0.0], dtype=torch.float64)  # float64 below fp32's subnormals: the floor too
    assert ue8m0_scale(tiny).tolist() == [2.0 ** -22] * 3 and latent_scale(tiny).tolist() == [2.0 ** -13] * 3


def test_the_fp8_reference_is_the_bf16_one_up_to_fp8_rounding(seed):
    """sparse_mla_fp8 over a quantised cache against sparse_mla over the cache it came from: within what fp8
    rounding of c_kv moves a softmax-weighted mean; exactly the reference on the dequantised rows; no valid slot:
    0 and +inf."""
    x = fp8_sparse_decode_inputs(num_heads=16, topk=64, context_lens=(40, 200), block_size=16, seed=seed)
    out, lse = reference_sparse_decode_fp8(x)
    out32, lse32 = reference_sparse_decode_fp8(x, dtype=torch.float32)
    assert_close("out fp32 vs fp64", out32, out, dtype=torch.float32, row_dims=2, rtol=2 ** 8, atol=2 ** 8)
    nb, bs = x.kv_cache.shape[:2]
    kv = dequantize_latent(x.kv_cache.view(nb * bs, 656)).double()
    o2, l2 = sparse_mla(x.q.double(), kv, x.indices, x.sm_scale, 512)
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    exact = torch.nan_to_num(x.paged.latent_cache.view(nb * bs, -1).double(), nan=0.0)  # before quantisation
    o3, _ = sparse_mla(x.q.double(), exact, x.indices, x.sm_scale, 512)
    # out is a softmax-weighted mean of c_kv rows: fp8 moves each value by at most 2^-4 of its group's largest
    # (and the scores a little with it); measured against the largest |c_kv|, 40 seeds gave at most 0.019
    err = (o3 - out).abs().max() / exact[:, :512].abs().max()
    assert err < 2 ** -4, err
    none = torch.full_like(x.indices[:1], -1)
    o4, l4 = sparse_mla_fp8(x.q[:1].double(), x.kv_cache, none, x.sm_scale)
    assert (o4 == 0).all() and torch.isinf(l4).all()


def test_unselected_rows_never_count(seed):
    """Every row outside the sequences' visible tokens reads as NaN (poisoned bytes): the reference never reads
    one, and the slots past the cache and -1 select nothing."""
    x = fp8_sparse_decode_inputs(num_heads=16, topk=64, context_lens=(30, 5), block_size=16, seed=seed)
    nb, bs = x.kv_cache.shape[:2]
    x.indices[0, -1], x.indices[1, -1] = nb * bs + 5, -1  # one of each, whatever the draw gave
    out, lse = reference_sparse_decode_fp8(x)
    assert out.isfinite().all() and not lse.isnan().any()
    assert dequantize_latent(x.kv_cache.view(nb * bs, 656)).isnan().any(-1).sum() > 0


def test_fp8_indexer_reference_against_float64_keys(seed):
    """indexer_scores_fp8 equals the bf16 reference on the dequantised keys gathered independently, -inf past each
    token's position; against the keys before quantisation it differs by fp8 rounding only."""
    x = fp8_indexer_inputs(num_heads=8, head_dim=32, context_lens=(0, 70), query_lens=(3, 2), block_kv=16, seed=seed)
    ref = reference_indexer_scores_fp8(x)
    keys = dequantize_indexer_keys(x.k_cache).double()  # (NB, BK, D)
    for t in range(ref.shape[0]):
        b, p = int(x.req_indices[t]), int(x.positions[t])
        rows = torch.stack([keys[int(x.block_table[b, s // 16]), s % 16] for s in range(p + 1)])
        want = indexer_scores(x.q[t:t + 1].double(), rows, x.weights[t:t + 1].double(), x.softmax_scale)[0]
        assert torch.allclose(ref[t, : p + 1], want, rtol=1e-12, atol=1e-12), t
        assert torch.isinf(ref[t, p + 1:]).all()
    with pytest.raises(ValueError, match=r"block_table_row: a sequence of 300 tokens needs 19 blocks of 16, the row"):
        indexer_scores_fp8(x.q[:1], x.weights[:1], x.k_cache, x.block_table[1], 300, x.softmax_scale)
    with pytest.raises(ValueError, match=r"block_table_row: a sequence of 70 tokens reads blocks outside"):
        indexer_scores_fp8(x.q[:1], x.weights[:1], x.k_cache, torch.full((5,), 99, dtype=torch.int32), 70,
                           x.softmax_scale)


def test_the_references_read_only_what_they_select(seed):
    """A cache partly written, as an engine's is: every row (latent) or token (indexer key) that nothing selects is
    left as zero bytes, whose scales are not the formats'. The references read the selected ones alone: same results
    bit for bit; a selected row that was never written is refused, naming its scales."""
    for s in range(seed, seed + 100):  # both decode rows are empty for one seed in 64: the next that selects a row
        x = fp8_sparse_decode_inputs(num_heads=16, topk=64, context_lens=(40, 200), block_size=16, seed=s)
        if (x.indices >= 0).any():
            break
    else:
        pytest.fail(f"no seed in [{seed}, {seed + 100}) selects a row")
    nb, bs = x.kv_cache.shape[:2]
    want = sparse_mla_fp8(x.q, x.kv_cache, x.indices, x.sm_scale)
    flat = x.kv_cache.clone().view(nb * bs, LATENT_ROW_BYTES)
    keep = torch.zeros(nb * bs, dtype=torch.bool)
    sel = x.indices[(x.indices >= 0) & (x.indices < nb * bs)].long()
    keep[sel] = True
    flat[~keep] = 0
    got = sparse_mla_fp8(x.q, flat.view(nb, bs, 1, -1), x.indices, x.sm_scale)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and (~keep).any()
    flat[sel[0]] = 0
    with pytest.raises(ValueError, match=r"rows: c_kv scales"):
        sparse_mla_fp8(x.q, flat.view(nb, bs, 1, -1), x.indices, x.sm_scale)
    k = fp8_indexer_inputs(num_heads=8, head_dim=32, context_lens=(0, 70), query_lens=(3, 2), block_kv=16, seed=seed)
    L = int(k.seq_lens[1])
    want = indexer_scores_fp8(k.q[3:], k.weights[3:], k.k_cache, k.block_table[1], L, k.softmax_scale)
    d, nbk, bk = k.k_cache.shape[-1] - 4, k.k_cache.shape[0], k.k_cache.shape[1]
    cache = k.k_cache.clone().view(nbk, -1)
    read = set()
    for pos in range(L):
        read.add((int(k.block_table[1, pos // bk]), pos % bk))
    for b in range(nbk):
        for t in range(bk):
            if (b, t) not in read:  # its fp8 values and its scale
                cache[b, t * d:(t + 1) * d] = 0
                cache[b, bk * d + 4 * t: bk * d + 4 * t + 4] = 0
    got = indexer_scores_fp8(k.q[3:], k.weights[3:], cache.view(k.k_cache.shape), k.block_table[1], L, k.softmax_scale)
    assert torch.equal(got, want)
    b0 = int(k.block_table[1, 0])
    cache[b0, bk * d: bk * d + 4] = 0  # the sequence's first token: read, not a power of two
    with pytest.raises(ValueError, match=r"key scales .* of the sequence's tokens: expected finite powers of two"):
        indexer_scores_fp8(k.q[3:], k.weights[3:], cache.view(k.k_cache.shape), k.block_table[1], L, k.softmax_scale)


BAD = [
    (lambda: quantize_latent(torch.full((2, 576), float("nan"))), r"latent: expected finite values, got 1152 NaN or inf"),
    (lambda: quantize_latent(torch.tensor([[float("inf")] + [0.0] * 575])), r"latent: expected finite values, got 1 NaN"),
    (lambda: quantize_latent(torch.full((1, 576), 1e300, dtype=torch.float64)),
     r"latent: expected finite values, got 576 NaN or inf \(in float32"),
    (lambda: quantize_indexer_keys(torch.full((1, 2, 4), -1e300, dtype=torch.float64)),
     r"keys: expected finite values, got 8 NaN or inf \(in float32"),
    (lambda: quantize_latent(torch.zeros(2, 575)), r"latent: expected shape \[..., 576\], got \[2, 575\]"),
    (lambda: quantize_latent(torch.zeros(2, 576, dtype=torch.int32)), r"latent: expected dtype"),
    (lambda: quantize_latent(torch.zeros(2, 576), torch.full((2, 4), 3.0)), r"scale: expected finite powers of two"),
    (lambda: quantize_latent(torch.zeros(2, 576), torch.zeros(2, 4)), r"scale: expected finite powers of two > 0, got \[0.0"),
    (lambda: quantize_latent(torch.zeros(2, 576), torch.ones(2, 3)), r"scale: expected shape \[2, 4\]"),
    (lambda: dequantize_latent(torch.zeros(2, 656, dtype=torch.int8)), r"rows: expected dtype torch.uint8, got torch.int8"),
    (lambda: dequantize_latent(torch.zeros(2, 640, dtype=torch.uint8)), r"rows: expected shape \[..., 656\]"),
    (lambda: dequantize_latent(torch.zeros(2, 656, dtype=torch.uint8)),
     r"rows: c_kv scales \(bytes 512-527\): expected finite powers of two > 0, got \[0.0"),
    (lambda: quantize_indexer_keys(torch.zeros(2, 4, 8).index_fill_(2, torch.tensor([3]), float("inf"))),
     r"keys: expected finite values, got 8 NaN or inf"),
    (lambda: quantize_indexer_keys(torch.zeros(8, 8)), r"keys: expected shape \[\*, \*, \*\], got \[8, 8\]"),
    (lambda: quantize_indexer_keys(torch.zeros(2, 4, 8), torch.ones(2, 4, device="meta")),
     r"scale: expected device cpu, got meta"),
    (lambda: gather_indexer_keys(quantize_indexer_keys(torch.zeros(2, 4, 8)), [0, 1], 5),
     r"block_table_row: expected a torch.Tensor, got list"),
    (lambda: dequantize_indexer_keys(torch.zeros(2, 4, 12, dtype=torch.uint8)), r"cache: expected shape \[\*, \*, 1, \*\]"),
    (lambda: dequantize_indexer_keys(torch.zeros(2, 4, 1, 4, dtype=torch.uint8)),
     r"cache: expected block_kv >= 1 and a last dim of D \+ 4 > 4, got shape \[2, 4, 1, 4\]"),
    (lambda: dequantize_indexer_keys(torch.zeros(2, 0, 1, 20, dtype=torch.uint8)),
     r"cache: expected block_kv >= 1 and a last dim of D \+ 4 > 4, got shape \[2, 0, 1, 20\]"),
    (lambda: quantize_indexer_keys(torch.randn(2, 4, 0)), r"keys: expected block_kv and D >= 1, got shape \[2, 4, 0\]"),
    (lambda: write_indexer_keys(torch.zeros(4, 8, 40, dtype=torch.uint8)[..., :36], torch.tensor([0]), torch.randn(1, 32)),
     r"cache: .*contiguous"),
    (lambda: dequantize_indexer_keys(quantize_indexer_keys(torch.ones(1, 2, 4)).index_fill_(3, torch.tensor([1]), 3)),
     r"cache: key scales .*expected finite powers of two"),
    (lambda: sparse_mla_fp8(torch.zeros(1, 4, 576), torch.zeros(2, 4, 1, 656, dtype=torch.uint8),
                            torch.zeros(1, 8, dtype=torch.int64), 0.1), r"slots: expected dtype torch.int32"),
]


@pytest.mark.parametrize("call,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_hostile_inputs_are_refused_naming_the_tensor(call, match):
    with pytest.raises(ValueError, match=match):
        call()



@triton.jit
def _encode_kernel(x_ptr, code_ptr, scale_ptr, n, MIN_EXP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < n, other=0.0)
    tl.store(code_ptr + o, e4m3_bytes(x), mask=o < n)
    tl.store(scale_ptr + o, pow2_scale(tl.abs(x), MIN_EXP)[0], mask=o < n)


def test_kernels_write_the_bytes_torch_writes(seed):
    """dsv32ref.kernels.fp8 (integer arithmetic) against torch's fp8 cast and the reference's scales: every e4m3
    value, every midpoint between neighbours (ties to even) and the floats either side of it, values past 448,
    fp32 subnormals, -0, random values over 2^-14..2^10; NaN and +-inf write NaN."""
    from dsv32ref.reference.numerics import pow2_scale as reference_scale
    g = torch.Generator().manual_seed(seed)
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), -mids,
                   torch.randn(4096, generator=g) * torch.exp2(torch.randint(-14, 10, (4096,), generator=g).float()),
                   torch.tensor([448.0, 449.0, 463.9, 464.0, 1e30, -0.0, 1e-45, -1e-40, 2.0 ** -10])])
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    x = torch.cat((x, special))
    code, scale = torch.empty(x.shape, dtype=torch.uint8), torch.empty_like(x)
    for min_exp in (-13, -22):
        _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, code, scale, x.numel(), MIN_EXP=min_exp, BLOCK=1024)
        n = x.numel() - 3
        assert torch.equal(code[:n], x[:n].clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
        assert torch.equal(scale[:n], reference_scale(x[:n].abs(), min_exp))
    assert code[-3:].tolist() == [0x7F, 0xFF, 0x7F]


@triton.jit
def _bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + o, cast(tl.load(x_ptr + o, mask=o < n, other=0.0), tl.bfloat16), mask=o < n)


def test_kernels_round_to_bf16_as_torch_does(seed):
    """kernels.fp8.cast to bf16 (integer arithmetic) against torch's cast: every normal bf16 value, the midpoints
    between neighbours (ties to even) and the floats either side of them, both signs, the largest finite floats
    (which round to inf), random values; NaN (with a payload in its low bits only) stays NaN, +-inf stay. fp32
    subnormals (|x| < 2^-126) are left out: the interpreter's own conversion of them to bf16 is a step off even
    where the value is exact; no activation is that small."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:].double() + vals[:-1].double()) / 2
    mids = mids[(mids.float().double() == mids)].float()  # midpoints fp32 holds exactly
    x = torch.cat([vals, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                   torch.randn(4096, generator=g) * torch.exp2(torch.randint(-130, 120, (4096,), generator=g).float()),
                   torch.tensor([3.4028235e38, -3.4028235e38, -0.0, float("inf"), -float("inf")])])
    x = x[(x.abs() >= 2.0 ** -126) | (x == 0)]
    nan = torch.tensor([0x7F800001, 0xFFC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat((x, nan))
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    n = x.numel() - 2
    assert torch.equal(out[:n].view(torch.int16), x[:n].to(torch.bfloat16).view(torch.int16))
    assert out[n:].isnan().all()


# ---- the kernels over the FP8 caches --------------------------------------------------------------------------

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the compiled cases")
KERNEL_CASES = [  # the interpreter computes in fp32; compiled, bf16 as deployed
    pytest.param("cpu", torch.float32, 64, id="cpu-fp32", marks=CPU),
    pytest.param("cuda", torch.bfloat16, 1, id="cuda-bf16", marks=pytest.mark.gpu),
]
# The readers with bf16 queries interpreted too (their products are taken in fp32 there: dsv32ref.kernels.grid.mma)
READER_CASES = KERNEL_CASES + [pytest.param("cpu", torch.bfloat16, 1, id="cpu-bf16", marks=CPU)]


@pytest.mark.parametrize("device,dtype,tol", READER_CASES)
@pytest.mark.parametrize("splits,valid_first", [(None, False), (1, True), (4, False)])
def test_sparse_mla_paged_reads_fp8_rows(device, dtype, tol, splits, valid_first, seed):
    """sparse_mla_paged over FlashMLA's rows equals the float64 reference over the dequantised rows, per element:
    scrambled blocks, -1 and out-of-range entries, empty rows, every unselected row NaN, outputs poisoned."""
    cpu = device == "cpu"
    x = paged_sparse_mla_inputs(num_heads=3 if cpu else 64, topk=16 if cpu else 2048,
                                context_lens=(0, 21, 5) if cpu else (0, 3000, 100), query_lens=(4, 1, 2) if cpu else (70, 1, 2),
                                block_size=8 if cpu else 64, dtype=dtype, device=device, seed=seed,
                                valid_first=valid_first, kv_cache_dtype="fp8")
    assert x.latent_cache.dtype == torch.uint8 and x.latent_cache.shape[-1] == LATENT_ROW_BYTES
    T, H = x.q.shape[:2]
    out = torch.full((T, H, 512), float("nan"), dtype=dtype, device=device)
    lse = torch.full((T, H), float("nan"), device=device)
    config = {"BLOCK_N": 8} if cpu else {}
    config.update({} if splits is None else {"NUM_SPLITS": splits})
    sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                     out, lse, config=config, valid_first=valid_first)
    ref, ref_lse = reference_sparse_mla_paged(x)
    assert_close("out", out, ref, dtype=dtype, row_dims=2, rtol=tol, atol=tol)
    assert_close("lse", lse, ref_lse, dtype=torch.float32, rtol=64, atol=64)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 24, 16])
@pytest.mark.parametrize("valid_first", [False, True])
@pytest.mark.parametrize("query_lens", [(150, 1, 2, 1), (1, 1, 1, 1)], ids=["no-splits", "decode-splits"])
def test_sm90_dequantises_fp8_rows_in_its_producer(heads, valid_first, query_lens, seed):
    """bf16 q, no config: on sm_90 a warp-specialized kernel runs over FlashMLA's rows (its producer dequantises
    them into shared memory; up to 32 heads the one with the heads as the MMA's N, two steps of rows in flight),
    with enough tokens to fill the GPU and with four decode tokens (top-k splits), and equals the float64 reference per
    element: scrambled blocks, -1 and out-of-range entries, empty rows, unselected rows NaN, outputs poisoned."""
    from dsv32ref.kernels.sparse_mla import kernel_choice, launch_plan
    x = paged_sparse_mla_inputs(num_heads=heads, topk=2048, context_lens=(0, 3000, 100, 5000), query_lens=query_lens,
                                block_size=64, dtype=torch.bfloat16, device="cuda", seed=seed, valid_first=valid_first,
                                kv_cache_dtype="fp8")
    T, H = x.q.shape[:2]
    plan = launch_plan(x.q, 512, 2048, None, torch.cuda.get_device_properties(0).multi_processor_count, fp8=True)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert plan[3] == sm90 and kernel_choice(x.q, 512, plan[2], None, fp8=True)[0] == (
        "triton" if not sm90 else "sm_90 heads as N" if heads <= 32 else "sm_90 warp-specialized")
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((T, H), float("nan"), device="cuda")
    sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                     out, lse, valid_first=valid_first)
    ref, ref_lse = reference_sparse_mla_paged(x)
    assert_close("out", out, ref, dtype=torch.bfloat16, row_dims=2, rtol=1, atol=1)
    assert_close("lse", lse, ref_lse, dtype=torch.float32, rtol=64, atol=64)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sparse_mla_paged_with_no_topk_column_writes_what_the_reference_does(kv_cache_dtype):
    """A top-k of width 0 selects no key: every head's out 0 and lse +inf, as the reference's (no program ran, and
    the poisoned outputs were handed back as they were)."""
    x = paged_sparse_mla_inputs(num_heads=2, topk=4, context_lens=(3, 5), query_lens=(1, 2), block_size=4,
                                dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    none = x.topk_indices[:, :0]
    out, lse = torch.full((3, 2, 512), 7.0), torch.full((3, 2), 7.0)
    sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, none, x.sm_scale, out, lse)
    ref_out, ref_lse = sparse_mla(x.q, torch.zeros(1, x.q.shape[-1]), none, x.sm_scale, 512)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse.float())
    assert (out == 0).all() and (lse == float("inf")).all()


def test_sparse_mla_paged_refuses_what_fp8_rows_cannot_be():
    """An fp8 cache of the wrong width, for other latent widths, with a float16 q (fp8 x scale can overflow it),
    or with rows not 16-byte aligned: a ValueError naming the tensor."""
    x = paged_sparse_mla_inputs(num_heads=2, topk=4, context_lens=(3,), query_lens=(1,), block_size=4,
                                dtype=torch.float32, kv_cache_dtype="fp8")
    out, args = torch.empty(1, 2, 512), (x.block_table, x.req_indices, x.seq_lens, x.topk_indices, 0.1)
    nb, bs, _ = x.latent_cache.shape
    with pytest.raises(ValueError, match=r"latent_cache: expected shape \[\*, \*, 656\], got \[\d+, 4, 640\]"):
        sparse_mla_paged(x.q, x.latent_cache[..., :640], *args, out)
    with pytest.raises(ValueError, match=r"q: expected bfloat16 or float32 with an fp8 latent_cache"):
        sparse_mla_paged(x.q.half(), x.latent_cache, *args, out.half())
    with pytest.raises(ValueError, match=r"kv_lora_rank 512 and qk_rope_head_dim 64, got 256 and 64"):
        sparse_mla_paged(x.q[..., 256:], x.latent_cache, *args, torch.empty(1, 2, 256))
    wide = torch.zeros(nb, bs, 664, dtype=torch.uint8)[..., 4:660]  # rows 664 bytes apart, starting at byte 4
    with pytest.raises(ValueError, match=r"latent_cache: fp8 rows and blocks must start 16 bytes apart and aligned"):
        sparse_mla_paged(x.q, wide, *args, out)


@CPU
def test_decode_scores_over_fp8_keys_take_scores_blocks_tile_and_equal_64_key_tiles(seed):
    """A token a program, fp8 queries over FP8 keys (decode) at up to 32 heads take scores_block's wider tile by
    default where it still makes 8 programs an SM, each tile spanning two 64-key cache blocks (every key looks up its
    own), the last one short: its scores are the 64-key tiles' per element (interpreted, where the tile size changes
    no score's arithmetic); the scores past a token's position are left as they were. With fewer programs an SM
    (num_sms 2 here), 64-key tiles."""
    wide_args = dict(tokens=1, heads=32, groups=128, s_max=131072, sms=132)  # GLM-5.2, 128 requests at 128k
    assert scores_block(True, True, **wide_args) == 128
    assert all(scores_block(*flags, **wide_args) == 64 for flags in ((False, True), (True, False)))
    # the last two: 256 and 1024 programs of 128-key tiles (512 and 2048 of 64-key tiles)
    for change in ({"tokens": 2}, {"heads": 64}, {"groups": 16, "s_max": 32768}, {"groups": 64, "s_max": 32768}):
        assert scores_block(True, True, **{**wide_args, **change}) == 64, change
    x = fp8_indexer_inputs(num_heads=4, head_dim=32, context_lens=(0, 300, 9, 40, 200, 1, 64, 130),
                           query_lens=(1,) * 8, block_kv=64, seed=seed)
    cache = x.k_cache.squeeze(2)
    args = (x.q, x.weights, cache, x.block_table, x.req_indices, x.positions, x.softmax_scale)
    wide, narrow, fewer = (torch.full((8, 310), float("nan")) for _ in range(3))
    launched = []
    with observing_launches(lambda name, run: (launched.append(run.keywords), run())[1]):
        indexer_scores_paged(*args, wide, tokens=1, num_sms=1)
        indexer_scores_paged(*args, fewer, tokens=1, num_sms=2)
    assert [(k["BLOCK_S"], k["TILE_IN_BLOCK"]) for k in launched] == [(128, False), (64, True)], launched
    indexer_scores_paged(*args, narrow, block_s=64, tokens=1)
    assert torch.equal(wide.isnan(), narrow.isnan()) and int((~wide.isnan()).sum()) == int(x.positions.sum()) + 8
    assert torch.equal(wide.nan_to_num(), narrow.nan_to_num())
    assert torch.equal(fewer.nan_to_num(), narrow.nan_to_num())


@pytest.mark.parametrize("device,dtype,tol", READER_CASES)
@pytest.mark.parametrize("tokens", [1, 2])
def test_indexer_scores_paged_reads_fp8_keys(device, dtype, tol, tokens, seed):
    """indexer_scores_paged over DeepGEMM's FP8 key blocks equals the float64 reference per element, every visible
    key of every token (compiled: the default tiles, scores_block's); the scores past a token's position are left
    as they were (NaN here)."""
    cpu = device == "cpu"
    x = fp8_indexer_inputs(num_heads=4 if cpu else 64, head_dim=16 if cpu else 128,
                           context_lens=(0, 37, 9) if cpu else (0, 3000, 100), query_lens=(3, 1, 2) if cpu else (70, 1, 2),
                           block_kv=8 if cpu else 64, device=device, seed=seed)
    ref = reference_indexer_scores_fp8(x)
    cache = x.k_cache.squeeze(2)  # (NB, BK, D + 4): the kernel's cache has no head dim
    scores = torch.full((x.q.shape[0], ref.shape[1] + 5), float("nan"), device=device)
    indexer_scores_paged(x.q.to(dtype), x.weights, cache, x.block_table, x.req_indices, x.positions,
                         x.softmax_scale, scores, block_s=8 if cpu else None, tokens=tokens)
    visible = torch.arange(scores.shape[1]) <= x.positions.cpu()[:, None]  # (T, S_MAX)
    got = torch.where(visible, scores.cpu(), 0.0)
    want = torch.where(visible, torch.cat((ref, torch.full((ref.shape[0], 5), float("-inf"), dtype=ref.dtype)), 1), 0.0)
    # bf16 queries: fp32 sums of the heads' products in the MMA's order (compiled) or numpy's (interpreted, where
    # the products are taken in fp32), not the reference's: a few steps of the row's scale, more where weights of
    # both signs cancel (1.07 seen compiled; interpreted 1.08, and 3.73 x of 4 steps at a cancelled score in CI)
    tol = 16 * tol if dtype == torch.bfloat16 else tol
    assert_close("scores", got, want, dtype=torch.float32, row_dims=1, rtol=tol, atol=tol)
    assert scores.cpu()[~visible].isnan().all()


# fp8 queries as deployed: interpreted, the fp8 products are taken in fp32 (exact) and summed in fp32; compiled, the
# sm_90 fp8 MMA accumulates at reduced precision (DeepSeek-V3's report: about 14 bits), so it is held to 2^-13
# (1024 fp32 steps) of the scale of the terms it sums instead of a few steps. That scale is the score of the inputs'
# magnitudes, sum_h |w_h| |q_h| . |k| s: a score is a difference of head terms and can be far smaller than they are.
FP8_QUERY_CASES = [pytest.param("cpu", 64, id="cpu-fp8", marks=CPU),
                   pytest.param("cuda", 1024, id="cuda-fp8", marks=pytest.mark.gpu)]


def _term_scale(x) -> torch.Tensor:
    """The reference score of |q|, |w| and |k| (sign bits of the fp8 values cleared, the fp32 scales kept): the sum of
    the magnitudes of the terms each score adds up, [T, max seq_len] float64."""
    keys = x.k_cache.clone()
    nb, block_kv, _, row = keys.shape
    keys.view(nb, -1)[:, : block_kv * (row - 4)] &= 0x7F  # per block: the values first, then one scale a key
    return reference_indexer_scores_fp8(dataclasses.replace(x, q=x.q.float().abs().to(x.q.dtype),
                                                            weights=x.weights.abs(), k_cache=keys))


@pytest.mark.parametrize("device,tol", FP8_QUERY_CASES)
@pytest.mark.parametrize("tokens", [1, 2])
def test_indexer_scores_paged_scores_fp8_queries_over_fp8_keys(device, tol, tokens, seed):
    """fp8 queries (their per-head scales in the weights) over DeepGEMM's FP8 keys: fp8 x fp8 MMAs, every visible
    score of every token equal to the float64 reference per element, within tol fp32 steps of its terms' scale;
    nothing past a token's position written."""
    _check_fp8_query_scores(device, tol, seed, tokens=tokens, block_s=8 if device == "cpu" else 64)


@pytest.mark.gpu
@pytest.mark.parametrize("block_s,num_warps", [(64, 8), (128, 4), (128, 8), (256, 4), (256, 8)])
def test_indexer_scores_paged_fp8_scores_hold_at_every_launch_tile(block_s, num_warps, seed):
    """The same check at the key tiles and warps a caller may pass (each another MMA layout), decode-sized groups."""
    _check_fp8_query_scores("cuda", 1024, seed, tokens=1, block_s=block_s, num_warps=num_warps)


def _check_fp8_query_scores(device, tol, seed, **launch):
    cpu = device == "cpu"
    x = fp8_indexer_inputs(num_heads=4 if cpu else 64, head_dim=32 if cpu else 128,
                           context_lens=(0, 37, 9) if cpu else (0, 3000, 100), query_lens=(3, 1, 2) if cpu else (70, 1, 2),
                           block_kv=8 if cpu else 64, device=device, seed=seed)
    assert x.q.dtype == torch.float8_e4m3fn
    ref = reference_indexer_scores_fp8(x)
    scores = torch.full((x.q.shape[0], ref.shape[1] + 5), float("nan"), device=device)
    indexer_scores_paged(x.q, x.weights, x.k_cache.squeeze(2), x.block_table, x.req_indices, x.positions,
                         x.softmax_scale, scores, **launch)
    visible = torch.arange(scores.shape[1]) <= x.positions.cpu()[:, None]  # (T, S_MAX)
    assert scores.cpu()[~visible].isnan().all()
    visible = visible[:, : ref.shape[1]]
    scale = torch.where(visible, _term_scale(x), 1.0)  # (T, max seq_len)
    got = torch.where(visible, scores.cpu()[:, : ref.shape[1]].double(), 0.0)
    err = ((got - torch.where(visible, ref, 0.0)).abs() / scale).nan_to_num(nan=float("inf"))  # units of its terms
    bound = tol * torch.finfo(torch.float32).eps
    worst = divmod(int(err.argmax()), err.shape[1])
    assert not (err > bound).any(), (f"scores: {int((err > bound).sum())} element(s) in {int((err > bound).any(1).sum())} "
                                     f"row(s) past {tol} fp32 steps of their terms' scale; worst at {worst}: got "
                                     f"{got[worst]:.6g}, expected {ref[worst]:.6g}, {err[worst] / bound:.3g} x the bound")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_fp8_nan_scores_nan_in_both_readers(device, seed):
    """fp8 NaN bytes (0x7F, what fused_norm_rope writes for a non-finite activation): a NaN key scores NaN for every
    token, a NaN query head makes its token's scores NaN, a NaN latent row makes the out and lse of the tokens that
    select it NaN; everything else as the reference. (The interpreter reads the byte as 480 unless told.)"""
    x = fp8_indexer_inputs(num_heads=4, head_dim=32, context_lens=(0, 37), query_lens=(3, 1), block_kv=8,
                           device=device, seed=seed)
    key_block = int(x.block_table[1, 0])
    x.k_cache.view(-1, 8 * 36)[key_block, 5 * 32 + 3] = 0x7F  # key 5 of request 1 (its block's 6th key)
    x.q.view(torch.uint8)[1, 2, 7] = 0x7F  # token 1 (request 0), head 2
    scores = torch.full((4, 45), float("nan"), device=device)
    indexer_scores_paged(x.q, x.weights, x.k_cache.squeeze(2), x.block_table, x.req_indices, x.positions,
                         x.softmax_scale, scores, block_s=8)
    got = scores.cpu()
    assert got[1, :2].isnan().all() and got[3, 5].isnan() and not got[3, :5].isnan().any()
    assert not got[0, :1].isnan().any() and not got[2, :3].isnan().any() and not got[3, 6:38].isnan().any()
    p = paged_sparse_mla_inputs(num_heads=3, topk=16, context_lens=(21,), query_lens=(2,), block_size=8,
                                dtype=torch.float32, device=device, seed=seed, kv_cache_dtype="fp8")
    if not ((p.topk_indices >= 0) & (p.topk_indices < int(p.seq_lens[0]))).any():  # (the generator's empty rows)
        p.topk_indices[0, 0] = 3
    topk = p.topk_indices.cpu()
    valid = (topk >= 0) & (topk < int(p.seq_lens[0]))
    pos = int(topk[valid][0])  # a row some token selects: its tokens' out and lse NaN, the others' not
    p.latent_cache.view(-1, 656)[int(p.block_table[0, pos // 8]) * 8 + pos % 8, 100] = 0x7F
    out = torch.full((2, 3, 512), float("nan"), device=device)
    lse = torch.full((2, 3), float("nan"), device=device)
    sparse_mla_paged(p.q, p.latent_cache, p.block_table, p.req_indices, p.seq_lens, p.topk_indices, p.sm_scale, out,
                     lse, config={"BLOCK_N": 8} if device == "cpu" else {})
    for t in range(2):
        hit = bool((topk[t][valid[t]] == pos).any())
        assert bool(lse[t].isnan().all()) == hit and bool(out[t].isnan().all()) == hit, t
        assert hit or not (lse[t].isnan().any() or out[t].isnan().any()), t


def test_fp8_queries_need_the_fp8_key_cache():
    x = fp8_indexer_inputs(num_heads=4, head_dim=16, context_lens=(5,), query_lens=(1,), block_kv=8)
    bf16_keys = torch.zeros(x.k_cache.shape[0], 8, 16)
    with pytest.raises(ValueError, match=r"q_idx: fp8 queries score the FP8 key cache \(uint8\), got an index_cache "
                                         r"of torch.float32"):
        indexer_scores_paged(x.q, x.weights, bf16_keys, x.block_table, x.req_indices, x.positions, 0.25,
                             torch.empty(1, 8))
    with pytest.raises(ValueError, match=r"q_idx: fp8 queries need index_head_dim >= 32 \(an 8-bit MMA's depth on sm_90\), "
                                         r"got 16"):
        indexer_scores_paged(x.q, x.weights, x.k_cache.squeeze(2), x.block_table, x.req_indices, x.positions, 0.25,
                             torch.empty(1, 8))


def _norm_rope_inputs(device, dtype, g):
    """Two requests on scrambled blocks of 8, one padding token (slot -1), DeepSeek-V3.2's latent widths; an
    outlier in each indexer key, in turn among its rotated values and among the others; one token's first group of
    128 latent values zero and another's second group small (their fp8 scales at FlashMLA's floor of 2^-13)."""
    from dsv32ref.cache import AttentionMetadata
    meta = AttentionMetadata.build([3, 0], [2, 5], [[5, 1], [0, 3]], 8, device)
    slot = meta.slot_mapping.clone()
    slot[1] = -1
    T, f = meta.num_tokens, dict(device=device, dtype=dtype)
    r = lambda *shape: torch.randn(*shape, generator=g).to(**f)  # noqa: E731
    outlier = torch.tensor([0, 100] * T, device=device)[:T]  # a rotated value, a kept one
    kv = r(T, 576) * 3
    kv[0, :128], kv[2, 128:256] = 0, kv[2, 128:256] * 1e-3
    return dict(q_c=r(T, 48), q_a_norm_weight=1 + 0.1 * r(48), q_c_out=torch.empty(T, 48, **f), kv=kv,
                kv_a_norm_weight=1 + 0.1 * r(512), positions=meta.positions, slot_mapping=slot, rms_eps=1e-6,
                index_k=r(T, 128) + 40 * (torch.arange(128, device=device) == outlier[:, None]),
                k_norm_weight=1 + 0.1 * r(128), k_norm_bias=0.1 * r(128)), 6


def test_the_butterflies_are_the_hadamard_transform(seed):
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(seed))
    assert_close("rotated", hadamard_butterflies_fp32(x), hadamard_transform(x.double()), dtype=torch.float32, rtol=8, atol=8)


@pytest.mark.parametrize("device,dtype,tol", KERNEL_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_norm_rope_writes_the_fp8_bytes_of_its_bf16_rows(device, dtype, tol, interleaved, seed):
    """The same launch into float caches and into FP8 ones: the FP8 bytes are the oracle's quantisation of the float
    rows, slot by slot (fp8 values, scales and the bf16 k_pe exactly, interpreted and compiled), the indexer keys
    rotated first (Hadamard, rounded to the activations' dtype); slots not written (padding) keep their bytes."""
    from dsv32ref.config import ModelConfig
    from dsv32ref.kernels.fused_norm_rope import fused_norm_rope
    from dsv32ref.reference import RotaryEmbedding
    x, nb = _norm_rope_inputs(device, dtype, torch.Generator().manual_seed(seed))
    cos, sin = RotaryEmbedding(ModelConfig.preset("deepseek-v3.2")).to(device)(torch.arange(64, device=device))
    lat = torch.full((nb, 8, 576), float("nan"), device=device, dtype=dtype)
    idx = torch.full((nb, 8, 128), float("nan"), device=device, dtype=dtype)
    fused_norm_rope(**x, latent_cache=lat, index_cache=idx, cos=cos, sin=sin, indexer_interleaved=interleaved)
    lat8 = torch.full((nb, 8, 656), 0xAB, device=device, dtype=torch.uint8)
    idx8 = torch.full((nb, 8, 132), 0xAB, device=device, dtype=torch.uint8)
    fused_norm_rope(**x, latent_cache=lat8, index_cache=idx8, cos=cos, sin=sin, indexer_interleaved=interleaved)
    slots = x["slot_mapping"][x["slot_mapping"] >= 0].cpu()
    want = quantize_latent(lat.view(-1, 576)[slots].cpu())  # (written, 656)
    got = lat8.view(-1, 656)[slots].cpu()
    assert torch.equal(got, want)  # c_kv values, scales, k_pe
    blocks = idx8.view(nb, 8 * 132).cpu()  # each block: 8 keys of 128 fp8 values, then their 8 scales
    rotated = hadamard_butterflies_fp32(idx.view(-1, 1, 128)[slots].cpu()).to(dtype)  # (written, 1, 128)
    keys = quantize_indexer_keys(rotated)  # (written, 1, 1, 132): a block per key
    for n, s in enumerate(slots.tolist()):
        b, r = divmod(s, 8)
        assert torch.equal(blocks[b, r * 128:(r + 1) * 128], keys[n, 0, 0, :128]), s
        assert torch.equal(blocks[b, 1024 + 4 * r:1024 + 4 * (r + 1)], keys[n, 0, 0, 128:]), s
    untouched = torch.ones(nb * 8, dtype=torch.bool)
    untouched[slots] = False
    assert (lat8.view(-1, 656)[untouched] == 0xAB).all()
    assert (blocks.view(nb, -1)[:, :1024].reshape(-1, 128)[untouched] == 0xAB).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("device,dtype,tol", KERNEL_CASES)
def test_a_non_finite_activation_is_written_as_nan(device, dtype, tol, seed):
    """A NaN in one token's kv and an inf in another's indexer key: those rows read back as NaN (never as numbers, and
    the scale stays a power of two), the other tokens' rows as before."""
    from dsv32ref.config import ModelConfig
    from dsv32ref.kernels.fused_norm_rope import fused_norm_rope
    from dsv32ref.reference import RotaryEmbedding
    x, nb = _norm_rope_inputs(device, dtype, torch.Generator().manual_seed(seed))
    x["kv"][0, 7], x["index_k"][2, 90] = float("nan"), float("inf")
    cos, sin = RotaryEmbedding(ModelConfig.preset("deepseek-v3.2")).to(device)(torch.arange(64, device=device))
    lat8 = quantize_latent(torch.zeros(nb, 8, 576)).to(device)  # valid rows of zeros before the write
    idx8 = quantize_indexer_keys(torch.zeros(nb, 8, 128)).squeeze(2).to(device)
    fused_norm_rope(**x, latent_cache=lat8, index_cache=idx8, cos=cos, sin=sin)
    s = x["slot_mapping"].cpu()
    rows = dequantize_latent(lat8.view(-1, 656)[s[[0, 2, 3]]].cpu())
    assert rows[0, :512].isnan().all() and rows[1:].isfinite().all()
    keys = dequantize_indexer_keys(idx8.cpu().unsqueeze(2)).view(-1, 128)[s[[0, 2, 3]]]
    assert keys[1].isnan().all() and keys[[0, 2]].isfinite().all()


def test_token_writes_land_where_the_block_layouts_put_them(seed):
    """write_latent / write_indexer_keys token by token, in scrambled slot order, give the bytes the whole-block
    quantisers give; gather_* read them back through a block table as the dequantised values, in position order."""
    g = torch.Generator().manual_seed(seed)
    nb, bs, d = 5, 8, 64
    latent, keys = torch.randn(nb, bs, 576, generator=g) * 3, torch.randn(nb, bs, d, generator=g)
    slots = torch.randperm(nb * bs, generator=g)
    lat_cache = torch.zeros(nb, bs, LATENT_ROW_BYTES, dtype=torch.uint8)
    key_cache = torch.zeros(nb, bs, d + 4, dtype=torch.uint8)
    write_latent(lat_cache, slots, latent.view(-1, 576)[slots])
    write_indexer_keys(key_cache, slots, keys.view(-1, d)[slots])
    assert torch.equal(lat_cache, quantize_latent(latent))
    assert torch.equal(key_cache.view(nb, bs, 1, d + 4), quantize_indexer_keys(keys))
    table = torch.tensor([3, 0, 4], dtype=torch.int32)
    pos = torch.arange(20)
    want = table.long()[pos // bs] * bs + pos % bs
    assert torch.equal(gather_latent(lat_cache, table, 20), dequantize_latent(lat_cache.view(-1, 656)[want]))
    assert torch.equal(gather_indexer_keys(key_cache, table, 20), dequantize_indexer_keys(
        key_cache.view(nb, bs, 1, d + 4)).view(-1, d)[want])
    with pytest.raises(ValueError, match=r"slot_mapping: slots must lie in \[0, 40\), got \[0, 40\]"):
        write_latent(lat_cache, torch.tensor([0, 40]), latent.view(-1, 576)[:2])
    with pytest.raises(ValueError, match=r"keys: expected shape \[\*, 64\]"):
        write_indexer_keys(key_cache, slots[:2], torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"slot_mapping: each slot at most once, got slots \[5\] 2 times"):
        write_latent(lat_cache, torch.tensor([5, 5]), latent.view(-1, 576)[:2])
    with pytest.raises(ValueError, match=r"slot_mapping: each slot at most once, got slots \[1\] 2 times"):
        write_indexer_keys(key_cache, torch.tensor([1, 1]), keys.view(-1, d)[:2])
    with pytest.raises(ValueError, match=r"block_table_row: a sequence of 20 tokens reads blocks outside \[0, 5\)"):
        gather_latent(lat_cache, torch.tensor([3, 0, 5], dtype=torch.int32), 20)
