"""skinny_gemm (y = x Wᵀ for a few rows of x) against float64 and against F.linear / torch.bmm in the same dtype:
interpreted on CPU, compiled on a GPU at GLM-5.2's projection shapes. Outputs are views into poisoned buffers."""

import pytest
import torch
import torch.nn.functional as F
import triton

from dsv32ref.bench.linear import projections
from dsv32ref.checks import checking_device_values
from dsv32ref.kernels.skinny_gemm import (MAX_BATCH, MAX_ROWS, MAX_SPLITS, skinny_gemm, skinny_gemm_counters,
                                          skinny_plan)
from dsv32ref.testing import assert_close
from helpers import programs_in_random_order

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on CPU-only machines")
# (device, dtype, [(T, N, K)]): odd sizes interpreted; on the GPU the engine's projections at 8-token steps
CASES = [
    pytest.param("cpu", torch.bfloat16, [(1, 70, 200), (5, 33, 129), (16, 16, 64), (33, 40, 300)], id="cpu-bf16",
                 marks=CPU),
    pytest.param("cpu", torch.float32, [(3, 70, 200)], id="cpu-fp32", marks=CPU),
    pytest.param("cpu", torch.float16, [(7, 50, 130)], id="cpu-fp16", marks=CPU),
    pytest.param("cuda", torch.bfloat16, [(8, 6144, 16384), (8, 16384, 2048), (1, 2624, 6144), (16, 160, 6144),
                                          (64, 4096, 2048)], id="cuda-bf16", marks=pytest.mark.gpu),
]


def _poisoned_view(shape, dtype, device, pad=3):
    """A view of `shape` inside a NaN buffer `pad` larger along every dim (strided), and the buffer."""
    big = torch.full([s + pad for s in shape], float("nan"), dtype=dtype, device=device)
    return big[tuple(slice(1, 1 + s) for s in shape)], big


def _untouched_outside(view, big) -> bool:
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[tuple(slice(1, 1 + s) for s in view.shape)] = True
    return bool(big[~inside].isnan().all())


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("device,dtype,shapes", CASES)
def test_skinny_gemm_equals_linear(device, dtype, shapes, split, seed):
    """Per element: within a unit of the dtype of float64 (one rounding of an fp32 sum), within two of F.linear
    in the same dtype; x's rows strided; nothing outside out's view written. split-k: with counters, at the
    planned splits on the GPU, at up to three splits of 16-column steps on the CPU (whose 4 SMs the plan would
    leave unsplit); the counters are zero again after."""
    gen = torch.Generator().manual_seed(seed)
    counters = skinny_gemm_counters(device) if split else None
    tiles = dict(block_k=16, splits=3) if split and device == "cpu" else {}
    for T, N, K in shapes:
        x = torch.randn(T, K + 8, generator=gen).to(dtype).to(device)[:, :K]
        w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype).to(device)
        out, big = _poisoned_view((T, N), dtype, device)
        skinny_gemm(x, w, out, counters=counters, **tiles)
        assert counters is None or not counters.any()
        tol = 64 if dtype == torch.float32 else 1  # fp32 output: the fp32 sum's own rounding, in fp32 units
        assert_close(f"out {T}x{N}x{K} vs float64", out, x.double() @ w.double().T, dtype=dtype, rtol=tol, atol=tol)
        assert_close(f"out {T}x{N}x{K} vs F.linear", out, F.linear(x, w), dtype=dtype, rtol=2 * tol, atol=2 * tol)
        assert _untouched_outside(out, big)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_skinny_gemm_takes_the_per_head_absorptions(device, seed):
    """The batched form as the attention uses it: q_nope (T, H, nope) seen as (H, T, nope) times W_UK stored
    [H, nope, lora] (passed as its [H, lora, nope] view: K strided), into a (H, T, lora) view of a (T, H, lora)
    buffer; equal to torch.bmm per element and to float64 within a unit."""
    gen = torch.Generator().manual_seed(seed)
    T, H, nope, lora = (5, 3, 24, 40) if device == "cpu" else (8, 64, 192, 512)
    q = torch.randn(T, H, nope + 8, generator=gen).bfloat16().to(device)[..., :nope]
    W_UK = (torch.randn(H, nope, lora, generator=gen) * nope ** -0.5).bfloat16().to(device)
    buf = torch.full((T, H, lora + 2), float("nan"), dtype=torch.bfloat16, device=device)
    out = buf[..., :lora].transpose(0, 1)  # (H, T, lora), strided
    skinny_gemm(q.transpose(0, 1), W_UK.transpose(1, 2), out)
    exact = torch.bmm(q.transpose(0, 1).double(), W_UK.double())
    assert_close("q_lat vs float64", out, exact, dtype=torch.bfloat16, row_dims=2, rtol=1, atol=1)
    assert_close("q_lat vs bmm", out, torch.bmm(q.transpose(0, 1), W_UK), dtype=torch.bfloat16, row_dims=2, rtol=2,
                 atol=2)
    assert buf[..., lora:].isnan().all()


@CPU
@pytest.mark.parametrize("tiles", [dict(block_n=16, block_k=16), dict(block_n=128, block_k=256, num_stages=1),
                                   dict(block_n=32, block_k=64, num_warps=8, num_stages=4)])
def test_skinny_gemm_tiles_compute_the_same_product(tiles, seed):
    """Other tiles (K steps shorter and longer than K, columns wider than N): the same product within a unit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 100, generator=gen).bfloat16()
    w = (torch.randn(90, 100, generator=gen) * 0.1).bfloat16()
    out = torch.full((6, 90), float("nan"), dtype=torch.bfloat16)
    skinny_gemm(x, w, out, **tiles)
    assert_close("out", out, x.double() @ w.double().T, dtype=torch.bfloat16, rtol=1, atol=1)


@CPU
@pytest.mark.parametrize("splits", [2, 3, 7, MAX_SPLITS])
def test_skinny_gemm_split_k_sums_every_split_once(splits, seed):
    """Split-K over a batch (strided x, W as a transposed view, out a view of a poisoned buffer), its programs in a
    random order, twice through one counters buffer (exactly batches x tiles of them, inside -7 sentinels) that
    another shape used before: within a unit of float64 each time, each split's columns counted once (a split that
    overran into the next one's, or a partial left out, is many units off), the tiles' and batches' counters and
    partials apart, the counters zero after every call and nothing outside them touched. K is 48 steps: every
    split count asked for launches."""
    gen = torch.Generator().manual_seed(seed)
    B, T, N, K = 3, 5, 40, 16 * 48
    tiles = B * triton.cdiv(N, 16)
    assert skinny_plan(N, K, B, torch.device("cpu"), block_n=16, block_k=16, splits=splits)[2] == splits
    fenced = skinny_gemm_counters("cpu", tiles + 8)
    fenced[:4], fenced[4 + tiles:] = -7, -7
    counters = fenced[4:4 + tiles]
    skinny_gemm(torch.randn(2, 40).bfloat16(), torch.randn(70, 40).bfloat16(), torch.empty(2, 70, dtype=torch.bfloat16),
                counters=counters, splits=2, block_k=16)
    x = torch.randn(B, T, K + 4, generator=gen).bfloat16()[..., :K]
    w_t = (torch.randn(B, K, N, generator=gen) * K ** -0.5).bfloat16()  # stored [B, K, N], passed as [B, N, K]
    exact = x.double() @ w_t.double()
    for call in range(2):
        out, big = _poisoned_view((B, T, N), torch.bfloat16, "cpu")
        with programs_in_random_order(seed + call):
            skinny_gemm(x, w_t.transpose(1, 2), out, counters=counters, splits=splits, block_n=16, block_k=16)
        assert_close(f"out, {splits} splits", out, exact, dtype=torch.bfloat16, row_dims=2, rtol=1, atol=1)
        assert _untouched_outside(out, big) and not counters.any()
        assert (fenced[:4] == -7).all() and (fenced[4 + tiles:] == -7).all()


@pytest.mark.gpu
def test_skinny_gemm_split_k_gives_the_same_bits_every_launch(seed):
    """Compiled, a tile's split programs race to its counter: over 200 launches at GLM-5.2's A-projection shape (6
    and 16 splits) and o_proj's (3), 8 tokens, every output equals the first one bit for bit (the partials are
    summed in split order whoever arrives last), that one is within a unit of float64, and the counters are zero
    after every launch."""
    gen = torch.Generator().manual_seed(seed)
    counters = skinny_gemm_counters("cuda")
    for N, K, splits in ((2784, 6144, 6), (2784, 6144, 16), (6144, 16384, 3)):
        x = torch.randn(8, K, generator=gen).bfloat16().cuda()
        w = (torch.randn(N, K, generator=gen) * K ** -0.5).bfloat16().cuda()
        first = skinny_gemm(x, w, torch.empty(8, N, dtype=torch.bfloat16, device="cuda"), counters=counters,
                            splits=splits)
        assert_close(f"{N}x{K}, {splits} splits", first, x.double() @ w.double().T, dtype=torch.bfloat16, rtol=1,
                     atol=1)
        for _ in range(200):
            out = torch.full_like(first, float("nan"))
            skinny_gemm(x, w, out, counters=counters, splits=splits)
            assert torch.equal(out, first) and not counters.any(), (N, K, splits)


def test_skinny_plan_splits_k_only_where_the_tiles_leave_sms_idle():
    """The plan at 132 SMs over the engine's projections at full width (tiles of 64 columns): the A-projections
    (44 and 36 tiles over 6-7k columns of K) and o_proj (96 tiles) split; q_b_proj (256, 384 tiles) and the
    per-head absorptions (64 and 128 heads x their tiles) do not; wq_b (64, 128 tiles) splits as far as its short K
    allows (2048 columns: two splits, 1536: one); without counters nothing splits."""
    cpu, plan = torch.device("cpu"), {}
    for model in ("glm-5.2", "deepseek-v3.2"):
        for p in projections(model, device="cpu"):
            bn, _, splits = skinny_plan(p.N, p.K, p.batch or 1, cpu, sms=132)
            plan[model[:3], p.name] = bn, splits
    assert plan["glm", "fused_qkv_a_proj"] == (64, 6) and plan["dee", "fused_qkv_a_proj"] == (64, 7), plan
    assert plan["glm", "o_proj"] == (64, 3) == plan["dee", "o_proj"], plan
    assert plan["glm", "wq_b"] == (64, 2) and plan["dee", "wq_b"] == (64, 1), plan
    for name in ("q_b_proj", "W_UK", "W_UV", "lm_head"):
        assert plan["glm", name][1] == 1 == plan["dee", name][1], (name, plan)
    assert skinny_plan(2784, 6144, 1, cpu, split=False, sms=132) == (64, 6144, 1)
    assert skinny_plan(40, 6144, 1, cpu, sms=132) == (64, 1024, 6)
    assert skinny_plan(40, 32768, 1, cpu, sms=132) == (64, 2048, 16) and skinny_plan(8, 64, 1, cpu)[0] == 16
    assert skinny_plan(40, 128 * 25, 1, cpu, splits=3) == (64, 128 * 9, 3)  # 9, 9 and 7 steps
    assert skinny_plan(40, 128 * 81, 1, cpu, splits=10) == (64, 128 * 9, 9)  # asked for 10: 9 of 9 steps launch
    assert skinny_plan(0, 6144, 1, cpu, sms=132)[2] == skinny_plan(64, 6144, 0, cpu, sms=132)[2] == 1  # nothing to do


@CPU
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
def test_skinny_gemm_empty_sizes(split):
    """No rows, no columns, no batches: nothing to do; K = 0: zeros (the empty sum), as F.linear gives; with
    counters or without."""
    kw = dict(counters=skinny_gemm_counters("cpu", 8)) if split else {}
    x, w = torch.randn(0, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    skinny_gemm(x, w, torch.empty(0, 4, dtype=torch.bfloat16), **kw)
    skinny_gemm(torch.randn(3, 8).bfloat16(), torch.randn(0, 8).bfloat16(), torch.empty(3, 0, dtype=torch.bfloat16),
                **kw)
    none = torch.empty(0, 3, 8, dtype=torch.bfloat16)
    skinny_gemm(none, torch.empty(0, 4, 8, dtype=torch.bfloat16), torch.empty(0, 3, 4, dtype=torch.bfloat16), **kw)
    out = torch.full((3, 4), float("nan"), dtype=torch.bfloat16)
    assert (skinny_gemm(torch.randn(3, 0).bfloat16(), torch.randn(4, 0).bfloat16(), out, **kw) == 0).all()


@CPU
def test_skinny_gemm_refuses_what_it_cannot_compute():
    """Shapes that do not chain, mixed dtypes or ranks, too many rows or batches, bad tiles, and in the debug mode
    an out that overlaps an input or itself: ValueErrors naming the argument."""
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    tall = torch.randn(MAX_ROWS + 1, 32).bfloat16()
    for args, kw, match in (((x, w[:, :31], out), {}, "w: expected shape"),
                            ((x, w.float(), out), {}, "w: expected dtype"),
                            ((x, w, out[:, :15]), {}, "out: expected shape"),
                            ((x, w, out.float()), {}, "out: expected dtype"),
                            ((x.int(), w.int(), out.int()), {}, "x: expected dtype"),
                            ((x[0], w, out), {}, "x: expected a 2-D"),
                            ((x, w.unsqueeze(0), out), {}, "all be 2-D or all 3-D"),
                            ((x.unsqueeze(0), w.expand(2, 16, 32), out.unsqueeze(0)), {}, "w: expected shape"),
                            ((tall, w, torch.empty(MAX_ROWS + 1, 16, dtype=torch.bfloat16)), {}, "at most"),
                            ((x, w, out), {"block_n": 24}, "block_n"),
                            ((x, w, out), {"block_k": 512}, "block_k"),
                            ((x, w, out), {"num_warps": 3}, "num_warps"),
                            ((x, w, out), {"num_stages": 0}, "num_stages"),
                            (("x", w, out), {}, "x: expected"),
                            ((x, w, out), {"splits": 2}, "splits 2 needs counters"),
                            ((x, w, out), {"splits": 0, "counters": torch.zeros(8, dtype=torch.int32)}, "splits"),
                            ((x, w, out), {"splits": MAX_SPLITS + 1, "counters": torch.zeros(8, dtype=torch.int32)},
                             "splits expected"),
                            ((x, w, out), {"splits": 2.0, "counters": torch.zeros(8, dtype=torch.int32)}, "splits"),
                            ((x, w, out), {"counters": torch.zeros(8)}, "counters: expected dtype"),
                            ((x, w, out), {"counters": torch.zeros(2, 4, dtype=torch.int32)}, "counters: expected"),
                            ((x, w, out), {"counters": torch.zeros(0, dtype=torch.int32)}, "counters: expected at "
                                                                                           "least 1"),
                            ((x, w, out), {"counters": "zeros"}, "counters: expected"),
                            ((x, w, out), {"counters": torch.zeros(8, dtype=torch.int32), "num_sms": 0}, "num_sms"),
                            ((x.expand(3, 4, 32), w.expand(3, 16, 32), out.expand(3, 4, 16).clone()),
                             {"counters": torch.zeros(2, dtype=torch.int32)}, "counters: expected at least 3"),
                            ((x, torch.randn(64, 32).bfloat16(), torch.empty(4, 64, dtype=torch.bfloat16)),
                             {"counters": torch.zeros(2, dtype=torch.int32), "block_n": 16},
                             "counters: expected at least 4 .batches x tiles of 16 columns")):
        with pytest.raises(ValueError, match=match):
            skinny_gemm(*args, **kw)
    many = torch.zeros(MAX_BATCH + 1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected at most 65535 batches"):
        skinny_gemm(many, torch.zeros(1, 16, 16, dtype=torch.bfloat16).expand(MAX_BATCH + 1, 16, 16), many.clone())
    square = torch.randn(16, 16).bfloat16()
    with checking_device_values(), pytest.raises(ValueError, match="overlaps"):  # debug mode: host time every call
        skinny_gemm(square, torch.randn(16, 16).bfloat16(), square)
    with checking_device_values(), pytest.raises(ValueError, match="out has elements that share memory"):
        skinny_gemm(x, w, torch.empty(1, 16, dtype=torch.bfloat16).expand(4, 16))
    # counters made elsewhere, zero or not (7s: no program of a tile counted to its last, out was left unwritten)
    for made in (torch.zeros(8, dtype=torch.int32), torch.full((8, ), 7, dtype=torch.int32)):
        with pytest.raises(ValueError, match="counters: expected a buffer of skinny_gemm_counters' .* got one made"):
            skinny_gemm(x, w, out, counters=made, splits=2)
    dirty = skinny_gemm_counters("cpu", 8)
    dirty[3] = 1
    with checking_device_values(), pytest.raises(ValueError, match="counters: expected all zeros"):
        skinny_gemm(x, w, out, counters=dirty)


@CPU
def test_projection_benchmark_checks_what_it_times(seed):
    """dsv32ref.bench.linear on the CPU (a stand-in timer, a tiny model's projections): skinny_gemm and torch's
    GEMM agree (ok), the bytes are the weight's, and a wrong product is reported as not ok."""
    from dsv32ref.bench.linear import Projection, bench_projection
    timer = lambda fn, n_inner=10: (fn(), {"ms": 1.0, "ms_eager": 1.0})[1]  # noqa: E731
    for p in projections("tiny-glm-5.2", device="cpu"):
        r = bench_projection("tiny-glm-5.2", p, 3, timer)
        assert r["ok"] and r["bytes"] == (p.batch or 1) * p.N * p.K * 2, r
        assert r["launch"]["splits"] >= 1 and r["launch"]["block_n"] in (16, 32, 64), r
    broken = Projection("broken", 24, 40, device="cpu")
    broken.skinny = lambda x, w, out, counters=None, **tiles: out.zero_()
    assert not bench_projection("tiny-glm-5.2", broken, 3, timer)["ok"]


@CPU
def test_engine_projections_through_skinny_gemm_equal_the_reference_model(monkeypatch, seed):
    """EngineConfig(gemm="skinny"): an 8-token prefill's projections (the attention's, W_UK and W_UV per head, the
    dense MLP's and the shared expert's) run through skinny_gemm, eagerly and replayed from (emulated) FULL and
    PIECEWISE graphs, and once with K split in two (16-column steps: the tiny model's K is a few steps) over the
    step's counters; the logits equal the reference model's in float64 as the torch GEMMs' do."""
    import copy
    import functools

    import dsv32ref.engine.model as engine_model
    from dsv32ref.engine import EngineConfig, LLMEngine, StepInput, from_reference
    from dsv32ref.graphs.runner import CUDAGraphMode
    from dsv32ref.kernels.launch import observing_launches
    from helpers import tiny_model
    ref = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32, seed=seed, num_hidden_layers=2)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    logits, launched = {}, {}
    for gemm, boundary, mode, split in (("torch", "none", CUDAGraphMode.NONE, False),
                                        ("skinny", "none", CUDAGraphMode.NONE, False),
                                        ("skinny", "none", CUDAGraphMode.FULL, False),
                                        ("skinny", "narrow", CUDAGraphMode.PIECEWISE, False),
                                        ("skinny", "none", CUDAGraphMode.FULL, True)):
        ec = EngineConfig(boundary=boundary, mode=mode, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16,
                          block_size=4, capture_sizes=[8, 16], gemm=gemm)
        if split:
            monkeypatch.setattr(engine_model, "skinny_gemm", functools.partial(skinny_gemm, splits=2, block_k=16))
        eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, boundary))
        eng.capture()
        names = []
        with observing_launches(lambda name, run: (names.append(name), run())[1]):
            eng.step(StepInput([(r, p, 0) for r, p in enumerate(prompts)]))
        key = f"{gemm} {boundary} {mode.name}" + (" split" if split else "")
        logits[key], launched[key] = eng.last_logits, names.count("_skinny_gemm_kernel")
        counters = eng.runner.batch.gemm_counters
        assert counters is None if gemm == "torch" else not counters.any()
    exact = copy.deepcopy(ref).double()
    with torch.no_grad():
        expected = torch.stack([exact(torch.tensor(p, dtype=torch.long))[-1] for p in prompts])
    for key, lg in logits.items():
        assert_close(f"{key} logits", lg, expected, dtype=torch.float32, row_dims=1, rtol=2**10, atol=2**10)
    assert launched["torch none NONE"] == 0 and launched["skinny none NONE"] > 0, launched
    with pytest.raises(ValueError, match="EngineConfig.gemm"):
        EngineConfig(gemm="cutlass")
