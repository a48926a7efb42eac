"""dsv32ref.bench.fp8 on the CPU: what a decode row says bounds the bf16 decode (the timing itself needs the GPU)."""

import pytest

from dsv32ref.bench.fp8 import _fractions


def _row(bytes_bf16, ms_bf16_no_rows=None):
    row = {"bytes_bf16": bytes_bf16, "ms_bf16": 0.1, "bytes_fp8": bytes_bf16 // 2, "ms_fp8": 0.08}
    if ms_bf16_no_rows is not None:
        row["ms_bf16_no_rows"] = ms_bf16_no_rows
    return row


@pytest.mark.parametrize("bytes_bf16,no_rows_ms,bound", [
    (400_000_000, 0.05, "bytes"),  # 0.1 ms of bytes at 4000 GB/s against 0.05 ms without them
    (400_000_000, 0.1, "bytes"),  # as long: the bytes bound it
    (400_000_000, 0.2, "compute"),
    (4_000_000, 0.0009, "bytes"), (4_000_000, 0.0011, "compute")])
def test_a_decode_row_is_bound_by_its_bytes_where_they_take_as_long_as_the_call_without_them(bytes_bf16, no_rows_ms,
                                                                                            bound):
    r = _fractions(_row(bytes_bf16, no_rows_ms), 4000.0)
    assert r["ms_bf16_bytes_at_copy"] == pytest.approx(bytes_bf16 / 4e12 * 1e3)
    assert r["bf16_bound_by"] == bound
    assert r["fraction_of_copy_bf16"] == pytest.approx(bytes_bf16 / 0.1 / 1e6 / 4000.0)


def test_an_indexer_row_says_no_bound_and_the_copy_rate_a_run_settles_on_replaces_the_first():
    r = _fractions(_row(400_000_000), 4000.0)
    assert "bf16_bound_by" not in r and "ms_bf16_bytes_at_copy" not in r
    r = _fractions(_row(400_000_000, 0.09), 4000.0)
    assert r["bf16_bound_by"] == "bytes"
    assert _fractions(r, 3000.0)["bf16_bound_by"] == "bytes" and r["ms_bf16_bytes_at_copy"] == pytest.approx(0.4 / 3)
    assert _fractions(r, 5000.0)["bf16_bound_by"] == "compute"  # 0.08 ms of bytes against 0.09
