"""dsv32ref.kernels.fused_moe against the reference MoE (dsv32ref.reference.moe): the router kernel's experts
exactly and its weights to fp32 rounding, the layer per element (poisoned outputs; against float64 and against the
reference module in bf16, whose roundings it follows), expert parallelism, the engine's fused form against the
reference model, and what the launchers refuse."""

import copy

import pytest
import torch

from dsv32ref.config import ModelConfig
from dsv32ref.kernels.fused_moe import MAX_PAIRS, SELECT_BLOCK_T, Tiles, fused_moe, route_kernel, router_steps
from dsv32ref.kernels.launch import observing_launches
from dsv32ref.reference.moe import MoE, route
from dsv32ref.testing import assert_close

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on CPU-only machines")
# (device, preset): interpreted at tiny sizes; compiled at GLM-5.2's and DeepSeek-V3.2's routers (full expert counts)
PRESETS = [pytest.param("cpu", "tiny-deepseek-v3.2", marks=CPU, id="cpu-deepseek"),
           pytest.param("cpu", "tiny-glm-5.2", marks=CPU, id="cpu-glm"),
           pytest.param("cuda", "deepseek-v3.2", marks=pytest.mark.gpu, id="cuda-deepseek"),
           pytest.param("cuda", "glm-5.2", marks=pytest.mark.gpu, id="cuda-glm")]


def _moe(config: ModelConfig, device, dtype, seed: int) -> MoE:
    """The reference module with random weights, made and drawn on `device` (GLM-5.2's 256 experts at the GPU
    tests' width are a billion values, slow to draw on a CPU)."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        m = MoE(config)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.05)
        m.gate.e_score_correction_bias.copy_(torch.rand(config.n_routed_experts, generator=g, device=device) * 0.1)
    return m.to(dtype=dtype)


def _weights(m: MoE, experts=slice(None)):
    """The engine's layout of the reference module's experts: (w13, w2, shared)."""
    es = m.experts[experts]
    w13 = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in es]).contiguous()
    w2 = torch.stack([e.down_proj.weight for e in es]).contiguous()
    s = m.shared_experts
    return w13, w2, (torch.cat((s.gate_proj.weight, s.up_proj.weight)).contiguous(), s.down_proj.weight.contiguous())


def _small(config: ModelConfig, device) -> ModelConfig:
    """On the GPU the routers keep their full expert counts, the experts their full widths, fewer of them matter."""
    return config if device == "cpu" else config.replace(moe_intermediate_size=256)


@pytest.mark.parametrize("device,preset", PRESETS)
@pytest.mark.parametrize("T,hidden", [(1, None), (17, None), (40, None), (5, 1600)])
def test_router_kernel_picks_the_references_experts(device, preset, T, hidden, seed):
    """Group-limited top-k (DeepSeek-V3.2's 8 groups, top 4 of them; GLM's one group): the same experts in the same
    order as dsv32ref.reference.moe.route, the weights to fp32 rounding; outputs poisoned. hidden 1600: the
    logits' sum split over seven programs (not a power of two), the last one short."""
    c = _small(ModelConfig.preset(preset), device)
    c = c if hidden is None or device == "cuda" else c.replace(hidden_size=hidden)
    m = _moe(c, device, torch.bfloat16, seed)
    x = torch.randn(T, c.hidden_size, device=device).to(torch.bfloat16)
    ids = torch.full((T, c.num_experts_per_tok), -7, dtype=torch.int32, device=device)
    w = torch.full((T, c.num_experts_per_tok), float("nan"), device=device)
    route_kernel(c, x, m.gate.weight, m.gate.e_score_correction_bias, ids, w)
    ref_ids, ref_w = route(c, x.double(), m.gate.weight.double(), m.gate.e_score_correction_bias.double())
    assert torch.equal(ids.long(), ref_ids), (ids, ref_ids)
    assert_close("weights", w, ref_w, dtype=torch.float32, rtol=16, atol=16)


@pytest.mark.parametrize("device,preset", PRESETS[:2] + [PRESETS[3]])
# up to 16 tokens the selection and the alignment share a launch, from 17 they take one each
@pytest.mark.parametrize("T", [1, 5, 16, 17, 40, 200])  # 200 tokens: 600 pairs over 9 experts, blocks of 64
def test_fused_moe_equals_the_reference(device, preset, T, seed):
    """The layer per element: fp32 against the reference module in float64; bf16 against the reference module in
    bf16 (the same roundings: 2 units of bf16), and against float64 within bf16's accumulated rounding."""
    c = _small(ModelConfig.preset(preset), device)
    for dtype, tol in ((torch.float32, 64), (torch.bfloat16, 2)):
        if device == "cuda" and dtype == torch.float32:
            continue  # fp32 tiles take tf32-free dots on a GPU too, but the bf16 case is what the engine runs
        m = _moe(c, device, dtype, seed)
        x = torch.randn(T, c.hidden_size, device=device).to(dtype)
        out = torch.full_like(x, float("nan"))
        fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, *_weights(m), out)
        exact = copy.deepcopy(m).double()  # the same (rounded) weights in float64
        exp = m(x) if dtype == torch.bfloat16 else exact(x.double())
        assert_close(f"out {dtype}", out, exp, dtype=dtype, row_dims=1, rtol=tol, atol=tol)
        if dtype == torch.bfloat16:
            assert_close("out vs float64", out, exact(x.double()), dtype=dtype, row_dims=1, rtol=8, atol=8)


def test_router_steps_spread_a_few_tokens_over_the_sms():
    """At 132 SMs the reduced MoE's router (4 experts) at a few tokens takes two steps a program, the full routers
    (256 experts) and 64 tokens the eight that keep a program's loads in flight together."""
    for hidden in (6144, 7168):  # GLM-5.2, DeepSeek-V3.2
        assert [router_steps(T, 4, hidden, 132) for T in (1, 8, 16, 64)] == [2, 2, 4, 8]
        assert router_steps(8, 256, hidden, 132) == 8
        assert router_steps(8, 4, hidden, 4) == 8  # the interpreter's SMs
    assert router_steps(64, 4, 64 * 1024, 132) == 64  # past 32 splits of eight steps: wider ones
    assert router_steps(1, 4, 12 * 1024, 264) == 3  # 12 steps halved to 6 and 3, not below ROUTER_MIN_STEPS


@CPU
@pytest.mark.parametrize("T", [5, 17])  # the one selection program that aligns too; the router kernel
def test_fused_moe_over_the_routers_short_steps(T, seed):
    """num_sms 4096: the router's logits at two steps a program (25 splits of hidden 1584, the last one 48
    columns), their partial sums added by the selection: the layer equals the reference module per element,
    outputs poisoned."""
    c = ModelConfig.preset("tiny-glm-5.2").replace(hidden_size=1584)
    assert router_steps(T, c.n_routed_experts, c.hidden_size, 4096) == 2
    m = _moe(c, "cpu", torch.bfloat16, seed)
    x = torch.randn(T, c.hidden_size).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, *_weights(m), out, num_sms=4096)
    assert_close("out", out, m(x), dtype=torch.bfloat16, row_dims=1, rtol=2, atol=2)


@pytest.mark.parametrize("T,launched", [
    (SELECT_BLOCK_T, ["_router_logits_kernel", "_select_align_kernel", "_gate_up_kernel", "_down_kernel",
                      "_combine_kernel"]),
    (SELECT_BLOCK_T + 1, ["_router_logits_kernel", "_router_kernel", "_align_kernel", "_gate_up_kernel",
                          "_down_kernel", "_combine_kernel"])])
@CPU
def test_fused_moe_launches(T, launched, seed):
    """Five launches while one program selects every token's experts (it aligns the pairs too), six past that."""
    c = ModelConfig.preset("tiny-glm-5.2")
    m = _moe(c, "cpu", torch.float32, seed)
    x = torch.randn(T, c.hidden_size)
    names = []
    with observing_launches(lambda name, run: (names.append(name), run())[1]):
        fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, *_weights(m), torch.empty_like(x))
    assert names == launched


@pytest.mark.parametrize("device,preset", [PRESETS[1], PRESETS[3]])
@pytest.mark.parametrize("tiles", [(Tiles(16, 128, 4, 3), Tiles(128, 16, 8, 4)),
                                   (Tiles(32, 256, 2, 1), Tiles(16, 256, 4, 6))], ids=["narrow-gate-up", "long-k-steps"])
def test_fused_moe_tiles_compute_the_same_layer(device, preset, tiles, seed):
    """The grouped GEMMs under other tiles (columns narrower and wider than the default, K steps past the tiny
    model's hidden and inter, one pipeline stage and six): the layer still equals the reference module per element
    (outputs poisoned), as under the default tiles."""
    c = _small(ModelConfig.preset(preset), device)
    m = _moe(c, device, torch.bfloat16, seed)
    x = torch.randn(21, c.hidden_size, device=device).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, *_weights(m), out, tiles=tiles)
    assert_close("out", out, m(x), dtype=torch.bfloat16, row_dims=1, rtol=2, atol=2)


@CPU
@pytest.mark.parametrize("T", [9, 23])  # one selection program that aligns too, and separate launches
def test_fused_moe_expert_parallel_computes_this_ranks_experts_only(T, seed):
    """Experts 4..7 on this rank (expert0 4), no shared expert: the sum over the pairs routed to those experts,
    and zero for a token none of whose experts is here."""
    c = ModelConfig.preset("tiny-deepseek-v3.2")
    m = _moe(c, "cpu", torch.float32, seed)
    x = torch.randn(T, c.hidden_size)
    w13, w2, _ = _weights(m, slice(4, 8))
    out = torch.full_like(x, float("nan"))
    fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, w13, w2, None, out, expert0=4)
    md, xd = m.double(), x.double()
    ids, wts = md.gate(xd)
    exp = torch.zeros_like(xd)
    for e in range(4, 8):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        exp.index_add_(0, tok, md.experts[e](xd[tok]) * wts[tok, slot, None])
    assert_close("out", out, exp, dtype=torch.float32, row_dims=1, rtol=64, atol=64)
    assert ((ids >= 4).any(1) | (out == 0).all(1)).all()


@CPU
def test_engine_fused_moe_equals_the_reference_model(seed):
    """EngineConfig(moe="fused"): the engine's MoE layers through the fused kernels; its logits equal the
    reference model's and its dense form's over a prefill, eagerly and replayed from (emulated) FULL and
    PIECEWISE graphs: nothing on the host depends on the routing."""
    from dsv32ref.engine import EngineConfig, LLMEngine, StepInput, from_reference
    from dsv32ref.graphs.runner import CUDAGraphMode
    from helpers import tiny_model
    ref = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32, seed=seed, num_hidden_layers=2)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    logits = {}
    for moe, boundary, mode in (("dense", "none", CUDAGraphMode.NONE), ("fused", "none", CUDAGraphMode.NONE),
                                ("fused", "none", CUDAGraphMode.FULL), ("fused", "narrow", CUDAGraphMode.PIECEWISE)):
        ec = EngineConfig(boundary=boundary, mode=mode, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16,
                          block_size=4, capture_sizes=[8, 16], moe=moe)
        eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, boundary, moe))
        eng.capture()
        eng.step(StepInput([(r, p, 0) for r, p in enumerate(prompts)]))
        logits[f"{moe} {boundary} {mode.name}"] = eng.last_logits
    exact = copy.deepcopy(ref).double()  # the same weights in float64: the engines' error alone
    with torch.no_grad():
        expected = torch.stack([exact(torch.tensor(p, dtype=torch.long))[-1] for p in prompts])
    for moe, lg in logits.items():
        assert_close(f"{moe} logits", lg, expected, dtype=torch.float32, row_dims=1, rtol=2**10, atol=2**10)
    with pytest.raises(ValueError, match="moe"):
        LLMEngine(ref.config, EngineConfig(moe="fused", mode=CUDAGraphMode.NONE, max_model_len=32, max_num_seqs=4,
                                           max_num_batched_tokens=16, capture_sizes=[16]),
                  device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))


@CPU
def test_fused_moe_refuses_what_it_cannot_compute():
    """Wrong shapes, dtypes, an expert range past the router's, a malformed shared expert, too many pairs, an
    unknown MoE form, tiles that are not a pair or not a tile the kernels take: ValueErrors naming the argument."""
    from dsv32ref.engine import EngineConfig
    c = ModelConfig.preset("tiny-glm-5.2")
    m = _moe(c, "cpu", torch.float32, 0)
    x = torch.randn(3, c.hidden_size)
    w13, w2, shared = _weights(m)
    args = (m.gate.weight, m.gate.e_score_correction_bias)
    out = torch.empty_like(x)
    for bad, match in (((x.double(), *args, w13, w2, shared, out), "x"),
                       ((x, *args, w13[:, :-1], w2, shared, out), "w13"),
                       ((x, *args, w13, w2.transpose(1, 2), shared, out), "w2"),
                       ((x, *args, w13.bfloat16(), w2, shared, out), "w13"),
                       ((x, *args, w13, w2, (shared[0],), out), "shared"),
                       ((x, *args, w13, w2, (shared[0][:-1], shared[1]), out), "shared"),
                       ((x, *args, w13, w2, shared, out[:2]), "out"),
                       ((x, args[0].bfloat16(), args[1], w13, w2, shared, out), "weight")):
        with pytest.raises(ValueError, match=match):
            fused_moe(c, *bad)
    with pytest.raises(ValueError, match="expert0"):
        fused_moe(c, x, *args, w13[4:], w2[4:], shared, out, expert0=5)
    big = torch.zeros(MAX_PAIRS, c.hidden_size)
    with pytest.raises(ValueError, match="pairs"):
        fused_moe(c, big, *args, w13, w2, shared, torch.empty_like(big))
    with pytest.raises(ValueError, match="EngineConfig.moe"):
        EngineConfig(moe="sparse")
    with pytest.raises(ValueError, match="tiles"):
        fused_moe(c, x, *args, w13, w2, shared, out, tiles=Tiles())
    with pytest.raises(ValueError, match="fused_moe: config: expected a ModelConfig, got NoneType"):
        fused_moe(None, x, *args, w13, w2, shared, out)
    with pytest.raises(ValueError, match="w13: expected a torch.Tensor, got NoneType"):
        fused_moe(c, x, *args, None, w2, shared, out)
    for field, bad in (("block_n", 48), ("block_n", 8), ("block_k", 512), ("block_k", True), ("num_warps", 3),
                       ("num_stages", 0), ("num_stages", 2.0)):
        with pytest.raises(ValueError, match=f"Tiles.{field}"):
            Tiles(**{field: bad})


@CPU
def test_fused_moe_and_the_router_refuse_outputs_over_their_inputs_and_weights_that_are_not_tensors():
    """An out over the expert weights (the launch would overwrite them), an expanded out, the router's ids and
    weights over each other or over its weight; a router weight or bias that is a list or a numpy array, or junk at
    0 tokens (checked before the early return): ValueErrors naming them."""
    c = ModelConfig.preset("tiny-glm-5.2")
    m = _moe(c, "cpu", torch.float32, 0)
    x = torch.randn(3, c.hidden_size)
    w13, w2, shared = _weights(m)
    gate, bias = m.gate.weight, m.gate.e_score_correction_bias
    H = c.hidden_size
    with pytest.raises(ValueError, match="fused_moe: out overlaps w13 in memory"):
        fused_moe(c, x, gate, bias, w13, w2, shared, w13.view(-1)[:3 * H].view(3, H))
    with pytest.raises(ValueError, match="fused_moe: out has elements that share memory"):
        fused_moe(c, x, gate, bias, w13, w2, shared, torch.zeros(1, H).expand(3, H))
    ids = torch.zeros(3, c.num_experts_per_tok, dtype=torch.int32)
    with pytest.raises(ValueError, match="route_kernel: ids overlaps weights in memory"):
        route_kernel(c, x, gate, bias, ids, ids.view(torch.float32))
    with pytest.raises(ValueError, match="route_kernel: weights overlaps weight in memory"):
        route_kernel(c, x, gate, bias, ids, gate.view(-1)[:ids.numel()].view(ids.shape))
    for T in (3, 0):  # outputs that are not tensors, with tokens and without
        with pytest.raises(ValueError, match="ids: expected a torch.Tensor, got NoneType"):
            route_kernel(c, x[:T], gate, bias, None, None)
    for bad, match in ((gate.tolist(), "gate_weight: expected a torch.Tensor, got list"),
                       (gate.numpy(), "gate_weight: expected a torch.Tensor, got ndarray")):
        with pytest.raises(ValueError, match=match):
            fused_moe(c, x, bad, bias, w13, w2, shared, torch.empty_like(x))
    with pytest.raises(ValueError, match="gate_weight: expected a torch.Tensor, got str"):
        fused_moe(c, x[:0], "junk", bias, w13, w2, shared, torch.empty(0, H))
    with pytest.raises(ValueError, match="e_score_correction_bias: expected a torch.Tensor, got str"):
        fused_moe(c, x[:0], gate, "junk", w13, w2, shared, torch.empty(0, H))


@CPU
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("BLOCK_M", [16, 32])
def test_align_pairs_places_every_local_pair_once_in_its_experts_run(shared, BLOCK_M, seed):
    """Random routings (experts of other ranks among them): every pair of a local expert in exactly one slot,
    inside its expert's run (runs in expert order, each padded to whole blocks), every block of a run owned by its
    expert and holding >= 1 pair, -1 everywhere else; no pair of another rank's expert anywhere."""
    from dsv32ref.kernels.fused_moe import align_pairs
    T, k, n_local, expert0 = 37, 3, 5, 2
    ids = torch.stack([torch.randperm(12)[:k] for _ in range(T)]).int()  # experts 0..11; 2..6 are local
    sorted_pair, block_expert = align_pairs(ids, n_local, expert0, shared, BLOCK_M)
    ks = k + shared
    local = {t * ks + j: int(ids[t, j]) - expert0 for t in range(T) for j in range(k)
             if 0 <= int(ids[t, j]) - expert0 < n_local}
    if shared:
        local.update({t * ks + k: n_local for t in range(T)})  # the shared expert: number n_local
    placed = [(s, int(p)) for s, p in enumerate(sorted_pair.tolist()) if p >= 0]
    assert sorted(p for _, p in placed) == sorted(local), "each local pair exactly once"
    start = 0
    for e in range(n_local + shared):
        mine = sorted(p for p, pe in local.items() if pe == e)
        run = -(-len(mine) // BLOCK_M) * BLOCK_M
        assert sorted_pair[start:start + len(mine)].tolist() == mine, f"expert {e}'s run, in pair order"
        assert (sorted_pair[start + len(mine):start + run] == -1).all(), f"expert {e}'s padding"
        assert (block_expert[start // BLOCK_M:(start + run) // BLOCK_M] == e).all(), f"expert {e}'s blocks"
        start += run
    assert (sorted_pair[start:] == -1).all() and (block_expert[start // BLOCK_M:] == -1).all()


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN (floats) or 2^30 (ints) while the test runs: a kernel that reads a workspace
    entry no kernel wrote shows it."""
    empty = torch.empty

    def poisoned(*shape, **kw):
        t = empty(*shape, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else 2 ** 30 if t.dtype != torch.bool else True)
    monkeypatch.setattr(torch, "empty", poisoned)


@CPU
@pytest.mark.parametrize("T", [11, 19])
def test_fused_moe_reads_only_what_it_wrote(poisoned_empty, T, seed):
    """Every workspace poisoned (the routing, the alignment, h, the pairs' outputs), expert parallel with
    tokens whose experts are all on other ranks: the output is still exact."""
    c = ModelConfig.preset("tiny-deepseek-v3.2")
    m = _moe(c, "cpu", torch.float32, seed)
    md = _moe(c, "cpu", torch.float64, seed)  # the same weights in float64
    x = torch.randn(T, c.hidden_size)
    for sl, e0, with_shared in ((slice(None), 0, True), (slice(6, 8), 6, False), (slice(0, 3), 0, True)):
        w13, w2, shared = _weights(m, sl)
        out = torch.full_like(x, float("nan"))
        fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, w13, w2, shared if with_shared else None,
                  out, expert0=e0)
        xd = x.double()
        ids, wts = md.gate(xd)
        exp = md.shared_experts(xd) if with_shared else torch.zeros_like(xd)
        routed = torch.zeros_like(xd)
        for e in range(e0, e0 + w13.shape[0]):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            routed.index_add_(0, tok, md.experts[e](xd[tok]) * wts[tok, slot, None])
        assert_close(f"out, experts {sl}", out, routed + exp, dtype=torch.float32, row_dims=1, rtol=64, atol=64)


@pytest.mark.gpu
def test_fused_moe_replays_from_a_cuda_graph(seed):
    """Graph-safe: captured once (GLM-5.2's router and experts at a reduced width), replayed over new tokens in
    the same input buffer, the output equals the reference's for those tokens."""
    c = _small(ModelConfig.preset("glm-5.2"), "cuda").replace(n_routed_experts=16, num_experts_per_tok=4)
    m = _moe(c, "cuda", torch.bfloat16, seed)
    w13, w2, shared = _weights(m)
    x = torch.randn(8, c.hidden_size, device="cuda").to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    call = lambda: fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, w13, w2, shared, out)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for _ in range(3):
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
        out.fill_(float("nan"))
        g.replay()
        assert_close("replayed out", out, m(x), dtype=torch.bfloat16, row_dims=1, rtol=2, atol=2)


@CPU
def test_router_kernel_one_expert_unnormalised_and_ties(seed):
    """num_experts_per_tok 1 with norm_topk_prob off and a scaling factor: the reference's experts and weights.
    Exact ties (x = 0: every expert scores sigmoid(0) + its bias, the bias 0): the lower indices, in order."""
    c = ModelConfig.preset("tiny-glm-5.2").replace(num_experts_per_tok=1, norm_topk_prob=False,
                                                   routed_scaling_factor=1.7)
    m = _moe(c, "cpu", torch.float32, seed)
    x = torch.randn(21, c.hidden_size)
    ids = torch.full((21, 1), -7, dtype=torch.int32)
    w = torch.full((21, 1), float("nan"))
    route_kernel(c, x, m.gate.weight, m.gate.e_score_correction_bias, ids, w)
    ref_ids, ref_w = route(c, x.double(), m.gate.weight.double(), m.gate.e_score_correction_bias.double())
    assert torch.equal(ids.long(), ref_ids)
    assert_close("weights", w, ref_w, dtype=torch.float32, rtol=16, atol=16)
    c2 = ModelConfig.preset("tiny-deepseek-v3.2")
    ids2 = torch.empty(3, c2.num_experts_per_tok, dtype=torch.int32)
    w2 = torch.empty(3, c2.num_experts_per_tok)
    route_kernel(c2, torch.zeros(3, c2.hidden_size), torch.randn(c2.n_routed_experts, c2.hidden_size),
                 torch.zeros(c2.n_routed_experts), ids2, w2)
    assert ids2.tolist() == [list(range(c2.num_experts_per_tok))] * 3  # groups 0 and 1 kept, experts 0, 1 first
    assert torch.allclose(w2, torch.full_like(w2, c2.routed_scaling_factor / c2.num_experts_per_tok))


@CPU
def test_fused_moe_takes_strided_rows(seed):
    """x and out with a row stride past their width (a view of wider buffers): the same output as contiguous."""
    c = ModelConfig.preset("tiny-deepseek-v3.2")
    m = _moe(c, "cpu", torch.float32, seed)
    wide = torch.randn(9, 3 * c.hidden_size)
    x = wide[:, c.hidden_size: 2 * c.hidden_size]
    out_wide = torch.full((9, 2 * c.hidden_size), float("nan"))
    out = out_wide[:, :c.hidden_size]
    fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, *_weights(m), out)
    dense = torch.empty_like(x.contiguous())
    fused_moe(c, x.contiguous(), m.gate.weight, m.gate.e_score_correction_bias, *_weights(m), dense)
    assert torch.equal(out, dense) and out_wide[:, c.hidden_size:].isnan().all()


@CPU
def test_a_group_layout_the_router_kernel_cannot_hold_is_refused_by_name():
    """12 experts in 2 groups of 6 (not a power of two): fused_moe says so on either side of SELECT_BLOCK_T, before
    any launch, and route_kernel names itself, at 0 tokens too."""
    c = ModelConfig.preset("tiny-deepseek-v3.2").replace(n_routed_experts=12, n_group=2, topk_group=1)
    m = _moe(c, "cpu", torch.float32, 0)
    launched = []
    for T in (1, SELECT_BLOCK_T + 1):
        x = torch.randn(T, c.hidden_size)
        with observing_launches(lambda name, run: launched.append(name)), pytest.raises(
                ValueError, match="fused_moe: n_routed_experts 12 must split into n_group 2 groups of a power of two"):
            fused_moe(c, x, m.gate.weight, m.gate.e_score_correction_bias, *_weights(m), torch.empty_like(x))
    assert launched == []
    k = c.num_experts_per_tok
    with pytest.raises(ValueError, match="route_kernel: n_routed_experts 12 must split into n_group 2"):
        route_kernel(c, torch.zeros(0, c.hidden_size), m.gate.weight, m.gate.e_score_correction_bias,
                     torch.empty(0, k, dtype=torch.int32), torch.empty(0, k))


@CPU
def test_align_pairs_refuses_what_its_keys_cannot_hold():
    """More local experts than the int32 sort keys hold beside the pairs, a block size it has no tile for, ids of
    the wrong dtype: ValueErrors naming them."""
    from dsv32ref.kernels.fused_moe import MAX_EXPERTS, align_pairs
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="n_local"):
        align_pairs(ids, MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match="bm"):
        align_pairs(ids, 4, bm=24)
    with pytest.raises(ValueError, match="align_pairs: bm expected 16, 32, 64 or 128, got 16.0"):
        align_pairs(ids, 4, bm=16.0)
    with pytest.raises(ValueError, match="ids"):
        align_pairs(ids.long(), 4)
    with pytest.raises(ValueError, match="align_pairs: shared: expected a bool, got 'yes'"):
        align_pairs(ids, 4, shared="yes")


@CPU
def test_the_ttft_run_keeps_the_fused_arms_tokens_beside_the_margins(tmp_path):
    """The TTFT experiment with '+fused' arms, a '+skinny' one and a '+fused+skinny' one, on the CPU without graphs:
    each runs its engine with moe "fused" (gemm "skinny", both), each numerics' arms' tokens are compared among
    themselves (`same_tokens_within`) and to the first arm's, and the first arm's margins are kept for the requests
    where they differ."""
    from dsv32ref.experiments.ttft import TTFTProtocol, run
    from helpers import tiny_model
    cfg = tiny_model("tiny-glm-5.2").config.replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                                    n_routed_experts=4, num_experts_per_tok=2)
    p = TTFTProtocol(variants=("none",), fused_moe=("narrow", "none"), skinny_gemm=("none",), fused_skinny=("none",),
                     requests=2, warmup=0, mode="none", anatomy_requests=0)
    assert p.arms()[-1] == ("none+fused+skinny", "none", {"moe": "fused", "gemm": "skinny"})
    res = run(p, device="cpu", config=cfg, out=str(tmp_path / "t.json"))
    assert set(res["variants"]) == {"none", "narrow+fused", "none+fused", "none+skinny", "none+fused+skinny"}
    assert set(res["same_tokens_within"]) == {"+fused", "+skinny", "+fused+skinny"}
    assert res["same_tokens_within"]["+fused"]
    assert set(res["skinny_first_tokens"]) == {"none+skinny"}
    assert set(res["fused+skinny_first_tokens"]) == {"none+fused+skinny"}
    assert len(res["first_token_margins"]) == len(res["first_tokens"]) == 2
    assert set(res["tokens_equal_to_first_arm"]) == set(res["variants"]) and res["same_tokens_across_variants"]
    fused = res["fused_first_tokens"]
    assert set(fused) == {"narrow+fused", "none+fused"} and all(len(t) == 2 for t in fused.values())
    assert res["tokens_equal_to_first_arm"]["none+fused"] == sum(
        a == b for a, b in zip(fused["none+fused"], res["first_tokens"])) / 2


@CPU
def test_moe_benchmark_checks_the_layer_it_times(seed):
    """dsv32ref.bench.moe on the CPU (a stand-in timer): its PyTorch formulation agrees with the fused layer (ok),
    counts the selected experts' bytes, and a layer whose output is wrong is reported as not ok."""
    from dsv32ref.bench.moe import MoELayer, bench_moe
    layer = MoELayer("tiny-glm-5.2", "reduced", seed=seed, device="cpu")
    timer = lambda fn: (fn(), {"ms": 1.0})[1]  # noqa: E731
    r = bench_moe(layer, 6, timer, (Tiles(16, 32), Tiles(32, 16)))
    per_expert = 3 * layer.config.hidden_size * layer.config.moe_intermediate_size * 2
    assert r["ok"] and r["rel_err"] < 1e-2, r
    assert r["bytes"] == (r["distinct_experts"] + 1) * per_expert + layer.gate.numel() * 4
    broken = MoELayer("tiny-glm-5.2", "reduced", seed=seed, device="cpu")
    broken.__class__ = type("Broken", (MoELayer,), {"__call__": lambda self, x, out, tiles=None: out.zero_()})
    assert not bench_moe(broken, 6, timer)["ok"]
