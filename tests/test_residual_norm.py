"""add_rms_norm (the residual add and the next RMSNorm in one launch) against the reference's norm and against
float64: interpreted on CPU, compiled on a GPU. Outputs are poisoned before each launch."""

import pytest
import torch

from dsv32ref.kernels import add_rms_norm
from dsv32ref.reference import rms_norm
from dsv32ref.testing import assert_close

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on CPU-only machines")
CASES = [
    pytest.param("cpu", torch.float32, 4, id="cpu-fp32", marks=CPU),
    pytest.param("cpu", torch.bfloat16, 1, id="cpu-bf16", marks=CPU),
    pytest.param("cuda", torch.float32, 4, id="cuda-fp32", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, 1, id="cuda-bf16", marks=pytest.mark.gpu),
]


def _inputs(T, hidden, dtype, device, gen, row_pad=0):
    """x and residual [T, hidden] as views of rows `row_pad` values longer (strided rows), weight [hidden]."""
    def rows():
        return (torch.randn(T, hidden + row_pad, generator=gen) * 3).to(dtype).to(device)[:, :hidden]
    return rows(), rows(), (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype).to(device)


def _run(x, residual, weight, eps=1e-6):
    out = torch.full_like(x, float("nan"))
    residual_out = torch.full_like(x, float("nan"))
    add_rms_norm(x, residual, weight, eps, out, residual_out)
    return out, residual_out


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows", ["many", "few"])
def test_add_rms_norm_equals_the_reference(device, dtype, tol, with_residual, rows, seed):
    """residual_out is x + residual rounded as torch rounds it (bit for bit); out equals the reference's
    RMSNorm of it per element, and float64's within the dtype's rounding; rows strided, a token count that is
    not a multiple of a program's rows ("many"), and a few wide rows, one a program ("few": on a GPU the
    launcher's 16-warp programs)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"many": ((5, 48), (300, 6144)), "few": ((1, 40), (8, 7168))}[rows]
    T, hidden = shapes[0] if device == "cpu" else shapes[1]
    x, residual, weight = _inputs(T, hidden, dtype, device, gen, row_pad=16)
    out, residual_out = _run(x, residual if with_residual else None, weight)
    want_res = x + residual if with_residual else x
    assert torch.equal(residual_out, want_res), (residual_out - want_res).abs().max()
    assert_close("out", out, rms_norm(want_res, weight, 1e-6), dtype=dtype, row_dims=1, rtol=tol, atol=tol)
    h = want_res.double()
    exact = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert_close("out vs float64", out, exact, dtype=dtype, row_dims=1, rtol=4 * tol, atol=4 * tol)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_add_rms_norm_writes_only_its_rows_and_nothing_for_no_tokens(device, seed):
    """Outputs that are views into larger buffers: nothing outside the T x hidden views changes; T = 0 is
    accepted (no launch)."""
    gen = torch.Generator().manual_seed(seed)
    x, residual, weight = _inputs(3, 40, torch.float32, device, gen)
    big_out, big_res = (torch.full((5, 48), 7.0, device=device) for _ in range(2))
    add_rms_norm(x, residual, weight, 1e-6, big_out[1:4, :40], big_res[1:4, :40])
    for big in (big_out, big_res):
        mask = torch.ones_like(big, dtype=torch.bool)
        mask[1:4, :40] = False
        assert (big[mask] == 7.0).all()
    empty = torch.empty(0, 40, device=device)
    add_rms_norm(empty, empty.clone(), weight, 1e-6, empty.clone(), empty.clone())


def test_add_rms_norm_refuses_what_it_cannot_compute():
    """A ValueError naming the tensor or argument: mismatched shapes and dtypes, a weight in another dtype (the
    reference multiplies in the weight's dtype), rows not dense, a zero or NaN eps, outputs overlapping the
    inputs or each other, a row wider than a program holds."""
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    o, ro = torch.empty(3, 8), torch.empty(3, 8)
    cases = [
        ((x, r[:2], w, 1e-6, o, ro), r"residual: expected shape \[3, 8\], got \[2, 8\]"),
        ((x, r.double(), w, 1e-6, o, ro), "residual: expected dtype"),
        ((x, r, w.bfloat16(), 1e-6, o, ro), "weight: expected dtype"),
        ((x, r, w[:4], 1e-6, o, ro), r"weight: expected shape \[8\], got \[4\]"),
        ((x.t(), r, w, 1e-6, o, ro), r"x: "),
        ((x, r, w, 0.0, o, ro), r"eps: expected a finite number > 0, got 0.0"),
        ((x, r, w, float("nan"), o, ro), r"eps: expected a finite number > 0"),
        ((x, r, w, 1e-6, x, ro), "out overlaps x in memory"),
        ((x, r, w, 1e-6, o, o), "out overlaps residual_out in memory"),
        ((x, r, w, 1e-6, o, r[:, :8]), "residual_out overlaps residual in memory"),
        ((x.half(), r.half(), w.half(), 1e-6, o, ro.half()), "out: expected dtype"),
        ((x.double(), r.double(), w.double(), 1e-6, o.double(), ro.double()), "x: expected dtype"),
        ((torch.randn(2, 20000), None, torch.randn(20000), 1e-6, torch.empty(2, 20000), torch.empty(2, 20000)),
         r"x: expected a hidden size \(dim 1\) in \[1, 16384\]"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            add_rms_norm(*args)
