import math

import pytest
import torch

from dsv32ref.reference.sparse_attention import dense_mla, sparse_mla
from dsv32ref.testing import assert_close


def unique_indices(n, S, k, invalid_frac=0.0):
    """Per query: k distinct keys of S (or fewer, padded with invalid -1 / >= S entries)."""
    idx = torch.stack([torch.randperm(S)[:k] if k <= S else torch.cat((torch.randperm(S), torch.full((k - S,), -1)))
                       for _ in range(n)]).int()
    if invalid_frac:
        drop = torch.rand(n, k) < invalid_frac
        drop[0, 0] = False  # row 0 keeps a valid key (randperm puts valid keys first)
        idx[drop] = torch.where(torch.rand(int(drop.sum())) < 0.5, -1, S + 3).int()
    return idx


@pytest.mark.parametrize("n,H,S,k,d_qk,d_v", [(4, 3, 17, 8, 24, 16), (1, 2, 5, 8, 12, 8), (7, 1, 64, 64, 40, 32)])
def test_sparse_equals_dense_with_same_mask(n, H, S, k, d_qk, d_v, seed):
    q, kv = torch.randn(n, H, d_qk, dtype=torch.float64), torch.randn(S, d_qk, dtype=torch.float64)
    idx = unique_indices(n, S, k, invalid_frac=0.2)
    mask = torch.zeros(n, S + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where((idx >= 0) & (idx < S), idx, S).long(), True)
    mask = mask[:, :S]
    scale = 0.3
    out, lse = sparse_mla(q, kv, idx, scale, d_v)
    ref_out, ref_lse = dense_mla(q, kv, mask, scale, d_v)
    has_key = mask.any(1)
    assert_close("out", out, ref_out, rtol=2**12, atol=2**12, row_dims=2)  # empty rows: 0 on both sides
    assert_close("lse", lse, ref_lse, rtol=2**12, atol=2**12, row_dims=2)  # +inf at the same places
    assert (out[~has_key] == 0).all() and torch.isposinf(lse[~has_key]).all()


def test_lse_is_natural_log_and_output_is_convex_combination(seed):
    q, kv = torch.randn(1, 1, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    idx = torch.tensor([[0, 2, -1]], dtype=torch.int32)
    out, lse = sparse_mla(q, kv, idx, 0.5, 8)
    s = [0.5 * float(q[0, 0] @ kv[j]) for j in (0, 2)]
    assert lse.item() == pytest.approx(math.log(math.exp(s[0]) + math.exp(s[1])), rel=1e-12)
    p = [math.exp(x - lse.item()) for x in s]
    assert torch.allclose(out[0, 0], p[0] * kv[0] + p[1] * kv[2], atol=1e-12)


def test_no_valid_index_gives_zero_and_inf():
    q, kv = torch.randn(2, 2, 8), torch.randn(4, 8)
    idx = torch.tensor([[-1, 4, 99], [1, -1, -1]], dtype=torch.int32)
    out, lse = sparse_mla(q, kv, idx, 1.0, 8)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()
    assert torch.isfinite(lse[1]).all() and torch.allclose(out[1], kv[1].expand(2, 8))
    out, lse = sparse_mla(q, kv[:0], idx, 1.0, 8)  # empty cache
    assert (out == 0).all() and torch.isposinf(lse).all()


def test_bf16_close_to_float64(seed):
    q, kv = torch.randn(8, 16, 576), torch.randn(300, 576)
    idx = unique_indices(8, 300, 128)
    ref, _ = sparse_mla(q.double(), kv.double(), idx, 576 ** -0.5, 512)
    got, lse = sparse_mla(q.bfloat16(), kv.bfloat16(), idx, 576 ** -0.5, 512)
    assert got.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # bf16 inputs, gathered rows and products rounded to bf16 on the way: a few bf16 units per element
    assert_close("out", got, ref, dtype=torch.bfloat16, rtol=4, atol=4, row_dims=2)


def test_bad_inputs():
    q, kv, idx = torch.zeros(2, 4, 16), torch.zeros(5, 16), torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv: expected shape \[\*, 16\], got \[5, 12\]"):
        sparse_mla(q, torch.zeros(5, 12), idx, 1.0, 8)
    with pytest.raises(ValueError, match="indices: expected dtype torch.int32, got torch.int64"):
        sparse_mla(q, kv, idx.long(), 1.0, 8)
    with pytest.raises(ValueError, match=r"indices: expected shape \[2, \*\], got \[3, 3\]"):
        sparse_mla(q, kv, torch.zeros(3, 3, dtype=torch.int32), 1.0, 8)
    with pytest.raises(ValueError, match="kv: expected dtype torch.float32, got torch.bfloat16"):
        sparse_mla(q, kv.bfloat16(), idx, 1.0, 8)
    with pytest.raises(ValueError, match="d_v: expected an int in 1..16, got 17"):
        sparse_mla(q, kv, idx, 1.0, 17)
    with pytest.raises(ValueError, match="kv: expected device cpu, got meta"):
        sparse_mla(q, kv.to("meta"), idx, 1.0, 8)
