"""dsv32ref.testing: the comparator catches what a global norm hides, and the paged generators feed the
kernel and the oracle the corner cases; the oracle's semantics on unselected and non-finite values."""

import pytest
import torch

from dsv32ref.kernels.sparse_mla import sparse_mla_paged
from dsv32ref.reference import sparse_mla
from dsv32ref.reference.sparse_attention import dense_mla
from dsv32ref.testing import assert_close, compare, eps, paged_sparse_mla_inputs, reference_sparse_mla_paged

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on CPU-only machines")


def test_one_wrong_row_fails_where_a_global_norm_passes(seed):
    """A 70-token, 128-head output with one (token, head) row 50 % off: ||a - b|| / ||b|| stays under 1e-2."""
    want = torch.randn(70, 128, 64, dtype=torch.float64)
    got = want.clone()
    got[33, 77] *= 1.5
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    c = compare("out", got.float(), want, dtype=torch.float32, row_dims=2)
    assert not c.ok and c.bad_rows == 1 and c.rows == 70 * 128
    assert "(33, 77," in c.message and "1 of 8960 row(s)" in c.message
    with pytest.raises(AssertionError, match=r"out: 64 element\(s\) in 1 of 8960 row\(s\)"):
        assert_close("out", got.float(), want, dtype=torch.float32, row_dims=2)
    assert compare("out", want.float(), want, dtype=torch.float32, row_dims=2).ok


def test_comparator_checks_shape_dtype_and_non_finite_positions():
    a = torch.tensor([[1.0, float("nan"), float("inf")], [2.0, 3.0, -float("inf")]])
    assert compare("x", a, a.double(), dtype=torch.float32).ok
    assert "shape [2, 3], expected [3, 2]" in compare("x", a, a.T.contiguous()).message
    assert "dtype torch.float32, expected torch.float64" in compare("x", a, a.double()).message
    b = a.clone()
    b[0, 1] = 0.0
    assert "NaN positions differ at 1 element(s)" in compare("x", b, a).message
    b = a.clone()
    b[0, 2] = -float("inf")
    m = compare("x", b, a).message
    assert "+inf positions differ" in m and "(0, 2)" in m
    b = a.clone()
    b[1, 0] = float("nan")
    assert not compare("x", b, a).ok  # a NaN where a finite value is expected
    with pytest.raises(ValueError, match="expected.s dtype: expected a float dtype"):
        compare("x", a.int(), a.int())
    with pytest.raises(ValueError, match="got: expected a torch.Tensor, got list"):
        compare("x", [1.0], a)
    with pytest.raises(ValueError, match="row_dims must lie in"):
        compare("x", a, a, row_dims=3)


def test_comparator_tolerance_is_in_units_of_the_dtype():
    want = torch.ones(4, 8, dtype=torch.float64)
    got = (want + 3 * eps(torch.bfloat16)).bfloat16()  # 3 ulps off at 1.0
    assert not compare("x", got, want, dtype=torch.bfloat16, rtol=1, atol=1).ok
    assert compare("x", got, want, dtype=torch.bfloat16, rtol=2, atol=2).ok
    # a small element is held to the row's scale through atol, not to its own magnitude alone
    want = torch.tensor([[100.0, 1e-3]], dtype=torch.float64)
    got = torch.tensor([[100.0, 1e-3 + 50 * eps(torch.float32)]])
    assert compare("x", got, want, dtype=torch.float32, rtol=1, atol=1).ok
    assert not compare("x", got, want, dtype=torch.float32, rtol=1, atol=0).ok


def test_generator_corners(seed):
    x = paged_sparse_mla_inputs(num_heads=4, d_lat=32, d_rope=8, topk=8, context_lens=[0, 9, 3],
                                query_lens=[5, 1, 6], block_size=4, dtype=torch.float32, seed=seed)
    T = x.q.shape[0]
    lens, req = x.seq_lens.tolist(), x.req_indices.tolist()
    rows = x.topk_indices
    assert T == 12 and x.latent_cache.shape[1:] == (4, 40)
    # blocks scrambled and disjoint; slots outside the visible tokens are NaN
    used = [b for b in x.block_table.flatten().tolist() if b >= 0]
    assert len(used) == len(set(used)) and used != sorted(used)
    flat = x.latent_cache.view(-1, 40)
    visible = torch.zeros(flat.shape[0], dtype=torch.bool)
    for b, n in enumerate(lens):
        bt = x.block_table[b]
        for p in range(n):
            visible[int(bt[p // 4]) * 4 + p % 4] = True
    assert torch.isfinite(flat[visible]).all() and torch.isnan(flat[~visible]).all()
    for t in range(T):
        valid = rows[t][(rows[t] >= 0) & (rows[t] < lens[req[t]])]
        assert len(set(valid.tolist())) == len(valid)  # distinct
        assert (valid <= int(x.positions[t])).all()  # causal
    # across seeds the rows take every form: empty, -1 padded, out of range, shuffled
    forms = set()
    for s in range(6):
        y = paged_sparse_mla_inputs(num_heads=2, d_lat=16, d_rope=8, topk=8, context_lens=[0, 9], query_lens=[6, 1],
                                    block_size=4, dtype=torch.float32, seed=s)
        lens = y.seq_lens[y.req_indices.long()]
        for t, r in enumerate(y.topk_indices):
            forms.add("empty" if (r < 0).all() else "padded" if (r < 0).any() else "full")
            if (r >= lens[t]).any():
                forms.add("out of range")
            v = r[(r >= 0) & (r < lens[t])]
            if (r >= 0).any() and not bool((r[: len(v)] == v).all()):
                forms.add("shuffled")
    assert forms >= {"empty", "padded", "out of range", "shuffled"}
    with pytest.raises(ValueError, match=r"context_lens \(1\) and query_lens \(2\) must have one length"):
        paged_sparse_mla_inputs(context_lens=[0], query_lens=[1, 2])
    with pytest.raises(ValueError, match=r"query_lens\[0\]: expected an int in \[1, 16777216\], got 0"):
        paged_sparse_mla_inputs(context_lens=[0], query_lens=[0])


def test_top_k_rows_over_long_contexts_are_drawn_in_time_of_k_and_uniformly(seed, monkeypatch):
    """A row's positions are drawn in O(topk) whatever the context: 64 queries deep in a 2^24-token context, no
    permutation past 4 topk drawn, each row distinct and causal; and the draws past a permutation's reach are
    uniform in what they pick and in their order: over 4000 rows of 10 of 100 positions, each position's count
    within 5 standard deviations of 400, and the first value below the second in 2000 of them, within 5 too."""
    from dsv32ref.testing import _distinct
    randperm = torch.randperm

    def short_randperm(n, *args, **kwargs):
        assert n <= 4 * 2048, f"a permutation of {n} values"
        return randperm(n, *args, **kwargs)

    monkeypatch.setattr(torch, "randperm", short_randperm)
    x = paged_sparse_mla_inputs(num_heads=1, d_lat=4, d_rope=0, topk=2048, context_lens=[2 ** 24 - 64],
                                query_lens=[64], block_size=2 ** 16, extra_blocks=0, dtype=torch.float32, seed=seed)
    for t, r in enumerate(x.topk_indices):
        v = r[(r >= 0) & (r <= int(x.positions[t]))]
        assert len(set(v.tolist())) == len(v) and (len(v) in (0, 2048))
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([_distinct(100, 10, g) for _ in range(4000)])  # (4000, 10)
    counts = torch.bincount(rows.flatten(), minlength=100)
    assert counts.sum() == 40000 and ((counts - 400).abs() <= 5 * (4000 * 0.1 * 0.9) ** 0.5).all(), counts
    ordered = int((rows[:, 0] < rows[:, 1]).sum())
    assert abs(ordered - 2000) <= 5 * (4000 * 0.25) ** 0.5, ordered


@pytest.mark.parametrize("kw,match", [
    (dict(d_rope=-2), r"paged_sparse_mla_inputs: d_rope: expected an int in \[0, 16777216\], got -2"),
    (dict(d_lat=0), r"paged_sparse_mla_inputs: d_lat: expected an int in \[1, "),
    (dict(block_size=0), r"block_size: expected an int in \[1, "),
    (dict(block_size=-4), r"block_size: expected an int in \[1, "),
    (dict(topk=-1), r"topk: expected an int in \[1, "),
    (dict(num_heads=2.0), r"num_heads: expected an int, got float 2.0"),
    (dict(dtype=torch.int32), r"dtype: expected one of torch.bfloat16, .*got torch.int32"),
    (dict(sm_scale=0.0), r"sm_scale: expected a finite number > 0, got 0.0"),
    (dict(sm_scale=float("nan")), r"sm_scale: expected a finite number > 0, got nan"),
    (dict(valid_first=1), r"valid_first: expected a bool"),
    (dict(context_lens=[-1], query_lens=[1]), r"context_lens\[0\]: expected an int in \[0, "),
    (dict(context_lens=(0, 2 ** 40), query_lens=(1, 1)), r"context_lens\[1\]: expected an int in \[0, 16777216\]"),
    (dict(context_lens=5, query_lens=[1]), r"context_lens: expected a non-empty list of ints, got 5"),
])
def test_the_generators_refuse_what_they_cannot_draw(kw, match):
    """Sizes, lengths, dtypes and scales no kernel input could have are refused, naming the argument (they were a
    ZeroDivisionError, a torch error deep in the draw, or inputs quietly built from a negative width)."""
    with pytest.raises(ValueError, match=match):
        paged_sparse_mla_inputs(**kw)


def test_the_fp8_indexer_generator_refuses_mismatched_lengths():
    from dsv32ref.testing import fp8_indexer_inputs
    with pytest.raises(ValueError, match=r"fp8_indexer_inputs: context_lens \(2\) and query_lens \(3\) must"):
        fp8_indexer_inputs(context_lens=(0, 200), query_lens=(5, 1, 2))  # zip() kept two requests
    with pytest.raises(ValueError, match=r"fp8_indexer_inputs: context_lens\[0\]: expected an int in \[0, "):
        fp8_indexer_inputs(context_lens=(-3,), query_lens=(1,))
    with pytest.raises(ValueError, match=r"fp8_indexer_inputs: block_kv: expected an int in \[1, "):
        fp8_indexer_inputs(block_kv=0)


def test_unselected_non_finite_keys_never_reach_the_oracle(seed):
    """FlashMLA's semantics: a key that is not selected contributes nothing, whatever its values."""
    q = torch.randn(3, 2, 24, dtype=torch.float64)
    kv = torch.randn(6, 24, dtype=torch.float64)
    idx = torch.tensor([[0, 2, -1, 9], [1, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    out, lse = sparse_mla(q, kv, idx, 0.2, 16)
    poisoned = kv.clone()
    poisoned[[3, 4, 5]] = float("nan")  # rows no token selects
    poisoned[5, 0] = float("inf")
    out2, lse2 = sparse_mla(q, poisoned, idx, 0.2, 16)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    for t in range(3):
        sel = idx[t][(idx[t] >= 0) & (idx[t] < 6)].long()
        mask[t, sel] = True
    mask[0, 4] = False
    out3, lse3 = dense_mla(q, poisoned, mask, 0.2, 16)
    assert_close("dense out", out3, out, rtol=64, atol=64, row_dims=2)
    assert_close("dense lse", lse3, lse, rtol=64, atol=64)
    assert (out[2] == 0).all() and torch.isposinf(lse[2]).all()  # no valid key: out 0, lse +inf
    # row 1 is selected by token 1 only: poisoning it spoils token 1, never token 0
    poisoned[1, 3] = float("nan")
    out4, lse4 = sparse_mla(q, poisoned, idx, 0.2, 16)
    assert torch.isnan(out4[1]).all() and torch.isnan(lse4[1]).all()
    assert torch.equal(out4[0], out[0]) and torch.equal(lse4[0], lse[0])


def test_non_finite_query_gives_nan_rows(seed):
    q = torch.randn(3, 2, 24, dtype=torch.float64)
    kv = torch.randn(6, 24, dtype=torch.float64)
    idx = torch.tensor([[0, 2, -1], [1, 3, 4], [-1, -1, -1]], dtype=torch.int32)
    kv[[1, 3, 4], 0] = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)  # token 1's scores: +-inf of both signs
    q[0, 1, 5] = float("nan")
    q[1, 0, 0] = float("inf")
    q[2, 0, 0] = float("nan")  # but token 2 has no valid key
    out, lse = sparse_mla(q, kv, idx, 0.2, 16)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, 1])
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(lse[0, 0])
    assert torch.isnan(out[1, 0]).all() and torch.isnan(lse[1, 0])
    assert (out[2] == 0).all() and torch.isposinf(lse[2]).all()
    q[1, 0, 0] = -float("inf")  # scores -inf, +inf, -inf: still NaN
    out, lse = sparse_mla(q, kv, idx, 0.2, 16)
    assert torch.isnan(out[1, 0]).all() and torch.isnan(lse[1, 0])
    kv[3, 0] = 1.0  # every valid score -inf: counts as no key
    out, lse = sparse_mla(q, kv, idx, 0.2, 16)
    assert (out[1, 0] == 0).all() and torch.isposinf(lse[1, 0])


@pytest.mark.parametrize("device,dtype,tol", [pytest.param("cpu", torch.float32, 64, marks=CPU),
                                              pytest.param("cuda", torch.bfloat16, 1, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.usefixtures("poisoned_partials")
def test_kernel_on_generated_inputs_with_poison_and_nan_queries(device, dtype, tol, splits, seed):
    """The Triton kernel against the oracle on the generator's inputs (NaN outside every selection), with
    one non-finite query row, and its outputs poisoned before the launch."""
    big = device == "cuda"
    x = paged_sparse_mla_inputs(num_heads=128 if big else 4, d_lat=512 if big else 32, d_rope=64 if big else 8,
                                topk=2048 if big else 8, context_lens=[0, 3000, 40] if big else [0, 9, 3],
                                query_lens=[70, 1, 33] if big else [5, 1, 6], block_size=64 if big else 4,
                                dtype=dtype, device=device, seed=seed, sm_scale=0.1352)
    x.q[2, 1, 3] = float("nan")
    want_out, want_lse = reference_sparse_mla_paged(x)
    T, H = x.q.shape[:2]
    out = torch.full((T, H, x.d_lat), float("nan"), dtype=dtype, device=device)
    lse = torch.full((T, H), -7.0, device=device)
    sparse_mla_paged(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale,
                     out, lse, config={"NUM_SPLITS": splits})
    assert_close("out", out, want_out, dtype=dtype, rtol=tol, atol=tol, row_dims=2)
    # lse's error is absolute (a log): held to the token's largest |lse| over its heads
    assert_close("lse", lse, want_lse, dtype=torch.float32, rtol=64, atol=64, row_dims=1)
    assert torch.isnan(want_out[2, 1]).all() or not (x.topk_indices[2] >= 0).any()


def test_instrument_is_a_no_op_unless_measuring():
    from dsv32ref.instrument import current_region, eager_range, is_measuring, measuring, region

    assert not is_measuring()
    with region("attention") as r:
        assert current_region() == "other" and r == ()
    with pytest.raises(KeyError):  # the no-op lets exceptions through
        with region("attention"):
            raise KeyError("x")
    with measuring():
        with region("attention"):
            with region("uv_bmm"):
                assert current_region() == "uv_bmm"
            assert current_region() == "attention"
        with pytest.raises(KeyError):
            with region("indexer"):
                raise KeyError("x")
        assert current_region() == "other"
        with eager_range("x"):
            pass
    assert not is_measuring() and region("a") is region("b") is eager_range("c")
