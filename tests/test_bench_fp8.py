"""dsv32ref.bench.fp8 on the CPU: what a decode row says bounds the bf16 decode (the timing itself needs the GPU)."""

import pytest

import torch

from dsv32ref.bench.fp8 import _fractions, selects_nothing


def _row(bytes_bf16, ms_bf16_no_rows=None):
    row = {"bytes_bf16": bytes_bf16, "ms_bf16": 0.1, "bytes_fp8": bytes_bf16 // 2, "ms_fp8": 0.08}
    if ms_bf16_no_rows is not None:
        row["ms_bf16_no_rows"] = ms_bf16_no_rows
    return row


# (bytes, the no-rows call's ms, the bytes' ms at 4000 GB/s, the bf16 call's fraction of copy (0.1 ms), the bound)
@pytest.mark.parametrize("bytes_bf16,no_rows_ms,bytes_ms,fraction,bound", [
    (400_000_000, 0.05, 0.1, 1.0, "bytes"),
    (400_000_000, 0.1, 0.1, 1.0, "bytes"),  # as long: the bytes bound it
    (400_000_000, 0.2, 0.1, 1.0, "compute"),
    (4_000_000, 0.0009, 0.001, 0.01, "bytes"), (4_000_000, 0.0011, 0.001, 0.01, "compute")])
def test_a_decode_row_is_bound_by_its_bytes_where_they_take_as_long_as_the_call_without_them(
        bytes_bf16, no_rows_ms, bytes_ms, fraction, bound):
    r = _fractions(_row(bytes_bf16, no_rows_ms), 4000.0)
    assert r["ms_bf16_bytes_at_copy"] == pytest.approx(bytes_ms)
    assert r["bf16_bound_by"] == bound
    assert r["fraction_of_copy_bf16"] == pytest.approx(fraction)


def test_an_indexer_row_says_no_bound_and_the_copy_rate_a_run_settles_on_replaces_the_first():
    r = _fractions(_row(400_000_000), 4000.0)
    assert "bf16_bound_by" not in r and "ms_bf16_bytes_at_copy" not in r
    r = _fractions(_row(400_000_000, 0.09), 4000.0)
    assert r["bf16_bound_by"] == "bytes"
    assert _fractions(r, 3000.0)["bf16_bound_by"] == "bytes" and r["ms_bf16_bytes_at_copy"] == pytest.approx(0.4 / 3)
    assert _fractions(r, 5000.0)["bf16_bound_by"] == "compute"  # 0.08 ms of bytes against 0.09


def test_selects_nothing_holds_every_out_exactly_zero_and_every_lse_plus_infinity():
    out, lse = torch.zeros(2, 3, 4), torch.full((2, 3), float("inf"))
    assert selects_nothing(out, lse)
    for bad_out, bad_lse in ((out.index_fill(2, torch.tensor([1]), 1e-30), lse),
                             (out.index_fill(2, torch.tensor([1]), float("nan")), lse),
                             (out, lse.index_fill(1, torch.tensor([2]), float("-inf"))),
                             (out, lse.index_fill(1, torch.tensor([2]), 3.0))):
        assert not selects_nothing(bad_out, bad_lse)
