"""Checking a kernel against the reference: one strict comparator, and paged inputs that find the bugs.

The comparator (`compare`, `assert_close`) works the way FlashMLA's tests do, per element, never through a
global norm (one wrong (token, head) row of a 70-token, 128-head request moves ||a - b|| / ||b|| by about
0.01, which a 1e-2 check lets through):
  - shape and dtype must match (the reference may be computed in float64: say which dtype `got` must have);
  - NaN and +-inf must sit at exactly the same positions;
  - every finite element must satisfy |got - expected| <= eps * (rtol * |expected| + atol * row_scale), with
    eps the precision of got's dtype (2^-7 for bf16, 2^-10 fp16, 2^-23 fp32, 2^-52 fp64), rtol and atol in
    units of eps, and row_scale the largest finite |expected| in the element's row; a row is one index of the
    leading `row_dims` dims, e.g. (token, head) of an [T, H, D] output;
  - a failure names the worst element (index, got, expected, error in eps) and how many elements and rows fail.

The generators (`paged_sparse_mla_inputs`, `reference_sparse_mla_paged`) build what a kernel author needs
to test a sparse-attention kernel on the paged cache: several requests of different lengths, block tables
scrambled over the cache, top-k rows with -1 padding, out-of-range entries, empty rows and shuffled order,
and every cache slot that belongs to no sequence's visible tokens poisoned with NaN (a read outside the
selection shows up as a NaN at a position the reference has none).

    x = paged_sparse_mla_inputs(num_heads=128, topk=2048, context_lens=[0, 3000], query_lens=[70, 1], device="cuda")
    out_ref, lse_ref = reference_sparse_mla_paged(x)
    out, lse = my_kernel(x.q, x.latent_cache, x.block_table, x.req_indices, x.seq_lens, x.topk_indices, x.sm_scale)
    assert_close("out", out, out_ref, dtype=x.dtype, row_dims=2, rtol=8, atol=8)
    assert_close("lse", lse, lse_ref, dtype=torch.float32, row_dims=2, rtol=64, atol=64)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv32ref.cache import CACHE_DTYPES, gather_tokens
from dsv32ref.checks import (check_bool, check_device, check_int, check_scale, check_tensor, is_finite_number, is_int,
                             shown)
from dsv32ref.reference.fp8_cache import (LATENT_ROW_BYTES, dequantize_latent, indexer_scores_fp8,
                                          quantize_indexer_keys, quantize_latent, sparse_mla_fp8)
from dsv32ref.reference.numerics import fp8_quantize
from dsv32ref.reference.sparse_attention import sparse_mla

__all__ = ["Comparison", "compare", "assert_close", "eps", "PagedSparseMLAInputs", "paged_sparse_mla_inputs",
           "reference_sparse_mla_paged", "fp8_latent_rows", "FP8SparseDecodeInputs", "fp8_sparse_decode_inputs",
           "reference_sparse_decode_fp8", "FP8IndexerInputs", "fp8_indexer_inputs", "reference_indexer_scores_fp8"]

_EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7,
        torch.float8_e4m3fn: 2.0**-3, torch.float8_e5m2: 2.0**-2}


def eps(dtype: torch.dtype) -> float:
    """The precision unit of a float dtype: the spacing of its values just above 1."""
    if not isinstance(dtype, torch.dtype) or dtype not in _EPS:
        raise ValueError(f"eps: expected a float dtype ({', '.join(map(str, _EPS))}), got {dtype!r}")
    return _EPS[dtype]


@dataclass
class Comparison:
    """What `compare` found. `ok` is True when every element passes."""

    name: str
    ok: bool
    message: str
    max_err_eps: float  # the worst |got - expected| / (eps * allowed scale), over finite elements
    bad_elements: int
    bad_rows: int
    rows: int

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return self.message


def _compare_arguments(name, got, expected, dtype, rtol, atol, row_dims, precision) -> tuple[torch.dtype, torch.dtype]:
    """compare's arguments checked, each refusal naming compare's argument -> (got's dtype, the tolerance's)."""
    for n, t in (("got", got), ("expected", expected)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"compare({name!r}): {n}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type == "meta":
            raise ValueError(f"compare({name!r}): {n}: a meta tensor holds no values to compare")
        if t.layout != torch.strided:
            raise ValueError(f"compare({name!r}): {n}: expected a dense (strided) tensor, got {t.layout}")
    want_dtype = expected.dtype if dtype is None else dtype
    unit_dtype = want_dtype if precision is None else precision
    given = [("dtype", dtype), ("precision", precision)]
    for arg, d in given if dtype is not None or precision is not None else [("expected's dtype", expected.dtype)]:
        if d is not None and (not isinstance(d, torch.dtype) or d not in _EPS):
            raise ValueError(f"compare({name!r}): {arg}: expected a float dtype ({', '.join(map(str, _EPS))}), "
                             f"got {d!r}")
    for n, t in (("got", got), ("expected", expected)):
        if not t.dtype.is_floating_point:  # (in float64, complex loses its imaginary part, int64 rounds past 2^53)
            raise ValueError(f"compare({name!r}): {n}: expected a real float tensor, got {t.dtype} (compare "
                             f"integer tensors with torch.equal)")
    if not is_int(row_dims) or not 0 <= row_dims <= got.dim():
        raise ValueError(f"compare({name!r}): row_dims must lie in [0, {got.dim()}], got {row_dims!r}")
    for n, v in (("rtol", rtol), ("atol", atol)):
        if not is_finite_number(v) or v < 0:
            raise ValueError(f"compare({name!r}): {n}: expected a finite number >= 0 (units of eps), got {shown(v)}")
    return want_dtype, unit_dtype


def compare(name: str, got: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
            rtol: float = 2.0, atol: float = 2.0, row_dims: int = 1, precision: torch.dtype | None = None
            ) -> Comparison:
    """Compare `got` with `expected` element by element (see the module docstring). `dtype`: the dtype `got`
    must have (default: expected's). Tolerances are in units of eps(precision), precision defaulting to
    dtype (e.g. fp32 logits of a bf16 model: dtype=torch.float32, precision=torch.bfloat16)."""
    want_dtype, unit_dtype = _compare_arguments(name, got, expected, dtype, rtol, atol, row_dims, precision)
    unit = eps(unit_dtype)

    def fail(msg: str, **kw) -> Comparison:
        return Comparison(name, False, f"{name}: {msg}", kw.get("err", float("inf")), kw.get("elems", -1),
                          kw.get("rows", -1), kw.get("total", -1))

    if tuple(got.shape) != tuple(expected.shape):
        return fail(f"shape {list(got.shape)}, expected {list(expected.shape)}")
    if got.dtype != want_dtype:
        return fail(f"dtype {got.dtype}, expected {want_dtype}")
    g = got.detach().to(device="cpu", dtype=torch.float64)
    e = expected.detach().to(device="cpu", dtype=torch.float64)
    nrows, per_row = math.prod(g.shape[:row_dims]), math.prod(g.shape[row_dims:])
    g2, e2 = g.reshape(nrows, per_row), e.reshape(nrows, per_row)  # (rows, elements per row)
    for kind, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = test(g2) != test(e2)
        if diff.any():
            flat = int(diff.flatten().nonzero()[0])
            at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
            n_el = int(diff.sum())
            return fail(f"{kind} positions differ at {n_el} element(s) in {int(diff.any(1).sum())} row(s); first at "
                        f"{at}: got {g[at].item():.6g}, expected {e[at].item():.6g}", elems=n_el,
                        rows=int(diff.any(1).sum()), total=nrows)
    finite = torch.isfinite(e2)
    scale = torch.where(finite, e2.abs(), 0.0).amax(dim=1, keepdim=True) if e2.shape[1] else e2.new_zeros(nrows, 1)
    allowed = unit * rtol * e2.abs() + unit * atol * scale  # (rows, per row); scaled first: 2 x 1e308 is inf
    err = torch.where(finite, (g2 - e2).abs(), 0.0)
    ratio = torch.where(allowed > 0, err / allowed.clamp(min=1e-300), torch.where(err > 0, float("inf"), 0.0))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    bad = ratio > 1
    n_bad, rows_bad = int(bad.sum()), int(bad.any(dim=1).sum()) if bad.numel() else 0
    if ratio.numel():
        flat = int(ratio.flatten().argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        w = (f"worst at {at}: got {g[at].item():.6g}, expected {e[at].item():.6g}, |err| {err.flatten()[flat].item():.3g}"
             f" = {worst:.3g} x the allowed {allowed.flatten()[flat].item():.3g}")
    else:
        w = "no elements"
    tol = f"tolerance eps({unit_dtype}) x ({rtol:g} |expected| + {atol:g} row max)"
    if n_bad:
        return Comparison(name, False, f"{name}: {n_bad} element(s) in {rows_bad} of {nrows} row(s) out of {tol}; {w}",
                          worst, n_bad, rows_bad, nrows)
    return Comparison(name, True, f"{name}: all {g.numel()} elements within {tol}; {w}", worst, 0, 0, nrows)


def assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, **kw) -> Comparison:
    """`compare`, raising AssertionError with its message on a mismatch."""
    c = compare(name, got, expected, **kw)
    if not c.ok:
        raise AssertionError(c.message)
    return c


# ---- paged inputs ---------------------------------------------------------------------------------------

@dataclass
class PagedSparseMLAInputs:
    """The arguments of a sparse-MLA kernel on the paged latent cache (vLLM's names), and how they were made.

    q [T, H, d_lat + d_rope], latent_cache [num_blocks, block_size, d_lat + d_rope] (slots outside every
    sequence's visible tokens are NaN), block_table int32 [B, max_blocks] (-1 past a sequence's blocks),
    req_indices int32 [T], seq_lens int32 [B], topk_indices int32 [T, topk] (positions in the token's own
    sequence; -1 = none), positions int64 [T], query_start_loc int32 [B + 1]."""

    q: torch.Tensor
    latent_cache: torch.Tensor
    block_table: torch.Tensor
    req_indices: torch.Tensor
    seq_lens: torch.Tensor
    topk_indices: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    sm_scale: float
    d_lat: int

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype


def _distinct(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """min(k, n) distinct values of range(n) in a random order, uniformly: a permutation's prefix where n is within
    4k, else random draws until k distinct (O(k) for any n; a permutation is O(n) a row, and a generated input
    draws a row per query token)."""
    if n <= 4 * k:
        return torch.randperm(n, generator=g)[:k]
    picked = torch.empty(0, dtype=torch.long)
    while picked.numel() < k:  # 2k draws from more than 4k values: k distinct, most often at the first round
        picked = torch.cat((picked, torch.randint(n, (2 * k,), generator=g))).unique()
    return picked[torch.randperm(picked.numel(), generator=g)[:k]]


def _topk_row(p: int, seq_len: int, cap: int, topk: int, valid_first: bool, g: torch.Generator) -> torch.Tensor:
    """One token's top-k row: up to topk distinct positions of 0..p in a random order, -1 padded; about one row
    in eight empty; unless valid_first, a row that is not full carries out-of-range entries (>= seq_len, into
    the sequence's own NaN slots below `cap` or past them) and is shuffled."""
    row = torch.full((topk,), -1, dtype=torch.int32)
    if torch.rand((), generator=g) < 0.125:
        return row  # an empty row: out 0, lse +inf
    vis = _distinct(p + 1, topk, g)
    row[: len(vis)] = vis.to(torch.int32)
    if not valid_first and len(vis) < topk:
        n_bad = min(topk - len(vis), 2)
        row[len(vis): len(vis) + n_bad] = torch.randint(seq_len, max(cap, seq_len + 1) + 4, (n_bad,), generator=g,
                                                        dtype=torch.int32)
        row = row[torch.randperm(topk, generator=g)]
    return row


_MAX_GENERATED = 2 ** 24  # tokens (and top-k entries, heads, widths) a generator draws: a test's inputs, on the CPU


def _check_lens(who: str, context_lens, query_lens) -> tuple[list[int], list[int]]:
    """Per-request lengths: two equal, non-empty lists of ints, context >= 0, query >= 1."""
    lens = []
    for name, v, low in (("context_lens", context_lens, 0), ("query_lens", query_lens, 1)):
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError(f"{who}: {name}: expected a non-empty list of ints, got {v!r:.60}")
        lens.append([check_int(f"{who}: {name}[{i}]", n, low, _MAX_GENERATED) for i, n in enumerate(v)])
    if len(lens[0]) != len(lens[1]):
        raise ValueError(f"{who}: context_lens ({len(lens[0])}) and query_lens ({len(lens[1])}) must have one length")
    return lens[0], lens[1]


def _check_sizes(who: str, seed, **sizes) -> None:
    """The seed a torch.Generator takes, and each size an int in [its floor, _MAX_GENERATED]: name=(value, floor)."""
    check_int(f"{who}: seed", seed, 0, 2 ** 63 - 1)
    for name, (v, low) in sizes.items():
        check_int(f"{who}: {name}", v, low, _MAX_GENERATED)


def _check_inputs(who: str, x, kind: type, generator: str) -> None:
    if not isinstance(x, kind):
        raise ValueError(f"{who}: x: expected {kind.__name__} (what {generator} draws), got {type(x).__name__}")


_MAX_ELEMENTS = 2 ** 28  # elements of one drawn tensor (float64 on the CPU: 2 GiB)


def _check_elements(who: str, **tensors: int) -> None:
    """Each tensor a generator is about to draw (name=its element count) within _MAX_ELEMENTS."""
    for name, n in tensors.items():
        if n > _MAX_ELEMENTS:
            raise ValueError(f"{who}: {name} would hold {n} elements, at most {_MAX_ELEMENTS} are drawn (smaller sizes)")


def _check_paged_options(who: str, dtype, sm_scale, valid_first, kv_cache_dtype) -> None:
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"{who}: kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"{who}: dtype: expected one of {', '.join(map(str, CACHE_DTYPES))}, got {dtype}")
    if sm_scale is not None:
        check_scale(f"{who}: sm_scale", sm_scale)
    check_bool(f"{who}: valid_first", valid_first)


def paged_sparse_mla_inputs(num_heads: int = 16, d_lat: int = 512, d_rope: int = 64, topk: int = 64,
                            context_lens=(0, 40, 7), query_lens=(5, 1, 30), block_size: int = 16,
                            dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0,
                            sm_scale: float | None = None, valid_first: bool = False, extra_blocks: int = 3,
                            kv_cache_dtype: str = "auto") -> PagedSparseMLAInputs:
    """Random paged inputs with every corner a kernel must handle (see the module docstring).

    Request b has context_lens[b] cached tokens and query_lens[b] new ones (query token i at position
    context_lens[b] + i sees positions 0..that). Each top-k row selects up to `topk` distinct visible positions in a
    random order (valid first if `valid_first`), padded with -1; about one row in eight is empty, and rows
    that are not full carry out-of-range entries (>= seq_len, < the row's cache capacity, so they address real
    NaN slots) unless valid_first. Block ids are a random permutation over num_blocks = sum of blocks needed +
    extra_blocks. kv_cache_dtype "auto": the cache in `dtype`; "fp8": FlashMLA's rows, uint8 [num_blocks, block_size,
    656] (fp8_latent_rows: visible rows quantised, every other row NaN when read; d_lat 512, d_rope 64)."""
    who = "paged_sparse_mla_inputs"
    dev = check_device(f"{who}: device", device)  # before the inputs are drawn
    _check_paged_options(who, dtype, sm_scale, valid_first, kv_cache_dtype)
    context_lens, query_lens = _check_lens(who, context_lens, query_lens)
    _check_sizes(who, seed, num_heads=(num_heads, 1), d_lat=(d_lat, 1), d_rope=(d_rope, 0), topk=(topk, 1),
                 block_size=(block_size, 1), extra_blocks=(extra_blocks, 0))
    if kv_cache_dtype == "fp8" and (d_lat, d_rope) != (512, 64):
        raise ValueError(f"{who}: kv_cache_dtype 'fp8': FlashMLA's rows hold d_lat 512 and d_rope 64, got {d_lat} and "
                         f"{d_rope}")
    B = len(query_lens)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    T, D = sum(query_lens), d_lat + d_rope
    _check_elements(who, q=T * num_heads * D, latent_cache=num_blocks * block_size * D, topk_indices=T * topk)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need)
    block_table = torch.full((B, width), -1, dtype=torch.int32)
    cache = torch.full((num_blocks * block_size, D), float("nan"), dtype=torch.float64)
    nxt = 0
    for b in range(B):
        blocks = perm[nxt: nxt + need[b]]
        nxt += need[b]
        block_table[b, : need[b]] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(seq_lens[b])
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        cache[slots] = torch.randn(seq_lens[b], D, generator=g, dtype=torch.float64)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, query_lens)])
    req_indices = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, n in enumerate(query_lens)])
    caps = [n * block_size for n in need]
    topk_indices = torch.stack([_topk_row(int(positions[t]), seq_lens[int(req_indices[t])],
                                          caps[int(req_indices[t])], topk, valid_first, g) for t in range(T)])
    scale = sm_scale if sm_scale is not None else D ** -0.5
    q = torch.randn(T, num_heads, D, generator=g, dtype=torch.float64)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    cache = cache.view(num_blocks, block_size, D)
    cache = fp8_latent_rows(cache) if kv_cache_dtype == "fp8" else cache.to(dtype)
    return PagedSparseMLAInputs(
        q=q.to(device=dev, dtype=dtype), latent_cache=cache.to(dev),
        block_table=block_table.to(dev), req_indices=req_indices.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), topk_indices=topk_indices.to(dev),
        positions=positions.to(dev), query_start_loc=qsl.to(dev), sm_scale=scale, d_lat=d_lat)


def reference_sparse_mla_paged(x: PagedSparseMLAInputs, dtype: torch.dtype = torch.float64
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle on paged inputs: each request's visible rows read through its block-table row (FP8 rows
    dequantised: fp8_cache.dequantize_latent), then dsv32ref.reference.sparse_mla in `dtype` (float64 by default)
    -> (out [T, H, d_lat], lse [T, H]), on the CPU."""
    _check_inputs("reference_sparse_mla_paged", x, PagedSparseMLAInputs, "paged_sparse_mla_inputs")
    check_tensor("x.q", x.q, shape=(None, None, None))
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"reference_sparse_mla_paged: dtype: expected one of {', '.join(map(str, CACHE_DTYPES))} "
                         f"(torch.float64), got {dtype!r}")
    q = x.q.detach().cpu().to(dtype)
    cache = x.latent_cache.detach().cpu()
    cache = (dequantize_latent(cache) if cache.dtype == torch.uint8 else cache).to(dtype)
    qsl, lens = x.query_start_loc.cpu().tolist(), x.seq_lens.cpu().tolist()
    outs, lses = [], []
    for b in range(len(lens)):
        t0, t1 = qsl[b], qsl[b + 1]
        kv = gather_tokens(cache, x.block_table[b].cpu(), lens[b])  # (S_b, D)
        o, lse = sparse_mla(q[t0:t1], kv, x.topk_indices[t0:t1].cpu(), x.sm_scale, x.d_lat)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# ---- the FP8 caches as deployed (dsv32ref.reference.fp8_cache) ----------------------------------------------

def fp8_latent_rows(cache: torch.Tensor) -> torch.Tensor:
    """A float latent cache [..., 576] whose unused slots hold NaN -> FlashMLA's rows uint8 [..., 656]: every
    finite row quantised (fp8_cache.quantize_latent), every other row poisoned so that it reads as NaN
    everywhere (fp8 NaN 0x7F, a valid scale of 1, bf16 NaN k_pe)."""
    check_tensor("fp8_latent_rows: cache", cache, shape=(..., 576), dtype=CACHE_DTYPES)
    flat = cache.reshape(-1, cache.shape[-1])  # (slots, 576)
    poison = torch.cat((torch.full((512,), 0x7F, dtype=torch.uint8), torch.ones(4).view(torch.uint8),
                        torch.full((64,), float("nan"), dtype=torch.bfloat16).view(torch.uint8)))
    rows = poison.to(cache.device).expand(flat.shape[0], LATENT_ROW_BYTES).clone()
    finite = flat.isfinite().all(-1)
    rows[finite] = quantize_latent(flat[finite])
    return rows.view(*cache.shape[:-1], LATENT_ROW_BYTES)


@dataclass
class FP8SparseDecodeInputs:
    """FlashMLA's sparse decode over its FP8 latent cache: q [T, H, 576] bf16, kv_cache uint8 [num_blocks,
    block_size, 1, 656] (module dsv32ref.reference.fp8_cache; every row outside the sequences' visible tokens
    reads as NaN), indices int32 [T, topk] flat slots (block x block_size + offset; -1 none; entries past the
    cache, num_blocks x block_size and up, none too), the softmax scale; `paged` is what they were made from
    (float64: the cache before quantisation)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    paged: PagedSparseMLAInputs
    d_v: int = 512


def fp8_sparse_decode_inputs(num_heads: int = 64, topk: int = 128, context_lens=(300, 64, 1000), block_size: int = 64,
                             device="cpu", seed: int = 0, sm_scale: float | None = None) -> FP8SparseDecodeInputs:
    """One decode token per request (its position context_lens[b]), the paged inputs of
    paged_sparse_mla_inputs (scrambled blocks, -1 padding, out-of-range entries, empty rows) in FlashMLA's
    FP8 format: visible rows quantised (fp8_cache.quantize_latent), every other row poisoned, positions turned
    into flat slots through the block table and out-of-range positions into slots past the cache."""
    who = "fp8_sparse_decode_inputs"
    dev = check_device(f"{who}: device", device)
    ones = [1] * len(context_lens) if isinstance(context_lens, (list, tuple)) else [1]  # a decode token a request
    context_lens, _ = _check_lens(who, context_lens, ones)
    _check_sizes(who, seed, num_heads=(num_heads, 1), topk=(topk, 1), block_size=(block_size, 1))
    x = paged_sparse_mla_inputs(num_heads, 512, 64, topk, context_lens=context_lens,
                                query_lens=[1] * len(context_lens), block_size=block_size, dtype=torch.float64,
                                seed=seed, sm_scale=sm_scale)
    nb, bs, _ = x.latent_cache.shape
    slots = torch.full_like(x.topk_indices, -1)
    for t in range(x.q.shape[0]):
        b, idx = int(x.req_indices[t]), x.topk_indices[t].long()
        ok = (idx >= 0) & (idx < int(x.seq_lens[b]))
        blocks = x.block_table[b].long()[idx.clamp(0, int(x.seq_lens[b]) - 1) // bs] if int(x.seq_lens[b]) else idx
        slots[t] = torch.where(ok, blocks * bs + idx % bs, torch.where(idx >= 0, nb * bs + idx, -1)).to(torch.int32)
    return FP8SparseDecodeInputs(q=x.q.to(device=dev, dtype=torch.bfloat16),
                                 kv_cache=fp8_latent_rows(x.latent_cache).view(nb, bs, 1, -1).to(dev),
                                 indices=slots.to(dev), sm_scale=x.sm_scale, paged=x)


def reference_sparse_decode_fp8(x: FP8SparseDecodeInputs, dtype: torch.dtype = torch.float64
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle on FlashMLA's FP8 format: fp8_cache.sparse_mla_fp8 in `dtype` (float32 or float64: it computes
    in one of those) on the CPU -> (out [T, H, 512], lse [T, H])."""
    _check_inputs("reference_sparse_decode_fp8", x, FP8SparseDecodeInputs, "fp8_sparse_decode_inputs")
    if dtype not in (torch.float32, torch.float64):  # (sparse_mla_fp8 computes fp16 in fp32)
        raise ValueError(f"reference_sparse_decode_fp8: dtype: expected torch.float32 or torch.float64, got {dtype!r}")
    return sparse_mla_fp8(x.q.detach().cpu().to(dtype), x.kv_cache.cpu(), x.indices.cpu(), x.sm_scale, x.d_v)


@dataclass
class FP8IndexerInputs:
    """DeepGEMM's paged logits over its FP8 key cache: q fp8 e4m3 [T, H_I, D], weights fp32 [T, H_I] (the query's
    scales folded in), k_cache uint8 [num_blocks, block_kv, 1, D + 4] (its block layout), block_table int32
    [B, max_blocks], seq_lens int32 [B], req_indices int32 [T], positions int64 [T], the softmax scale."""

    q: torch.Tensor
    weights: torch.Tensor
    k_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    req_indices: torch.Tensor
    positions: torch.Tensor
    softmax_scale: float


def fp8_indexer_inputs(num_heads: int = 32, head_dim: int = 128, context_lens=(0, 200, 1000), query_lens=(5, 1, 2),
                       block_kv: int = 64, device="cpu", seed: int = 0) -> FP8IndexerInputs:
    """Requests of different lengths on scrambled blocks of an FP8 key cache (fp8_cache.quantize_indexer_keys),
    extra blocks of keys that belong to no request, and fp8 queries with their per-head scales in the weights."""
    who = "fp8_indexer_inputs"
    dev = check_device(f"{who}: device", device)
    context_lens, query_lens = _check_lens(who, context_lens, query_lens)
    _check_sizes(who, seed, num_heads=(num_heads, 1), head_dim=(head_dim, 1), block_kv=(block_kv, 1))
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    need = [-(-s // block_kv) for s in seq_lens]
    nb = sum(need) + 2
    _check_elements(who, k_cache=nb * block_kv * head_dim, q=sum(query_lens) * num_heads * head_dim)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[start: start + n], dtype=torch.int32)
        start += n
    k_cache = quantize_indexer_keys(torch.randn(nb, block_kv, head_dim, generator=g))
    T = sum(query_lens)
    q, q_scale = fp8_quantize(torch.randn(T, num_heads, head_dim, generator=g) * 3, block=head_dim)
    w = torch.randn(T, num_heads, generator=g) * num_heads ** -0.5 * q_scale[..., 0]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, query_lens)])
    req = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, n in enumerate(query_lens)])
    return FP8IndexerInputs(q=q.to(dev), weights=w.to(dev), k_cache=k_cache.to(dev), block_table=table.to(dev),
                            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), req_indices=req.to(dev),
                            positions=positions.to(dev), softmax_scale=head_dim ** -0.5)


def reference_indexer_scores_fp8(x: FP8IndexerInputs) -> torch.Tensor:
    """The oracle of DeepGEMM's paged logits, float64 on the CPU: [T, max seq_len], -inf past each token's
    position (causal) and past its sequence."""
    _check_inputs("reference_indexer_scores_fp8", x, FP8IndexerInputs, "fp8_indexer_inputs")
    lens = x.seq_lens.cpu().tolist()
    out = torch.full((x.q.shape[0], max(lens)), float("-inf"), dtype=torch.float64)
    for t in range(x.q.shape[0]):
        b, p = int(x.req_indices[t]), int(x.positions[t])
        if not 0 <= b < len(lens):
            raise ValueError(f"reference_indexer_scores_fp8: x.req_indices[{t}]: expected 0..{len(lens) - 1}, got {b}")
        if not 0 <= p < lens[b]:
            raise ValueError(f"reference_indexer_scores_fp8: x.positions[{t}]: expected 0..{lens[b] - 1} (within "
                             f"request {b}'s {lens[b]} keys), got {p}")
        s = indexer_scores_fp8(x.q[t:t + 1].cpu(), x.weights[t:t + 1].cpu().double(), x.k_cache.cpu(),
                               x.block_table[b].cpu(), lens[b], x.softmax_scale)
        out[t, : p + 1] = s[0, : p + 1]
    return out
