import math

import pytest
import torch

from dsv32ref import ModelConfig
from dsv32ref.reference.moe import MoE
from dsv32ref.reference.numerics import fp8_quantize, fp8_round_trip, hadamard_transform, ue8m0_scale
from dsv32ref.testing import assert_close


def route_one_token(s, bias, c):
    """DeepSeek-V3 noaux_tc routing of one token, with Python lists."""
    E, G = len(s), c.n_group
    choice = [s[e] + bias[e] for e in range(E)]
    per = E // G
    if G > 1:
        gscore = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
        keep = sorted(range(G), key=lambda g: -gscore[g])[: c.topk_group]
        allowed = [e for e in range(E) if e // per in keep]
    else:
        allowed = list(range(E))
    chosen = sorted(allowed, key=lambda e: -choice[e])[: c.num_experts_per_tok]
    total = sum(s[e] for e in chosen)
    return {e: s[e] / total * c.routed_scaling_factor for e in chosen}


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_moe_matches_per_token_routing(preset, seed):
    c = ModelConfig.preset(preset)
    moe = MoE(c).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(9, c.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        got = moe(x)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            s = torch.sigmoid(moe.gate.weight @ x[t]).tolist()
            for e, w in route_one_token(s, moe.gate.e_score_correction_bias.tolist(), c).items():
                want[t] += w * moe.experts[e](x[t: t + 1])[0]
            want[t] += moe.shared_experts(x[t: t + 1])[0]
    assert_close("moe", got, want, rtol=2**12, atol=2**12)


def test_group_limit_excludes_experts_outside_kept_groups(seed):
    c = ModelConfig.preset("tiny-deepseek-v3.2")  # 8 experts, 4 groups of 2, keep 2 groups, top-2
    moe = MoE(c).double()
    with torch.no_grad():
        moe.gate.weight.zero_()
        # bias makes groups 1 and 3 win, but expert 0 alone has the single highest choice
        moe.gate.e_score_correction_bias.copy_(torch.tensor([5.0, -9, 1, 1, -1, -1, 2, 2], dtype=torch.float64))
        ids, w = moe.gate(torch.randn(3, c.hidden_size, dtype=torch.float64))
    assert all(sorted(r) == [6, 7] for r in ids.tolist())
    assert torch.allclose(w.sum(-1), torch.full((3,), c.routed_scaling_factor, dtype=torch.float64))


def test_router_bias_stays_fp32_in_bf16_model():
    moe = MoE(ModelConfig.preset("tiny-deepseek-v3.2")).to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts[0].gate_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_engine_moe_routes_with_the_reference_router(preset, norm_topk_prob, seed):
    """The engine's dense MoE and the reference MoE compute the same function, norm_topk_prob either way;
    the engine's router weights stay fp32 in a model built under a bf16 default."""
    from dsv32ref.engine.model import EngineMoE

    c = ModelConfig.preset(preset).replace(norm_topk_prob=norm_topk_prob)
    ref = MoE(c).double()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    eng = EngineMoE(c).double()
    with torch.no_grad():
        eng.gate.load_state_dict(ref.gate.state_dict())
        eng.w13.copy_(torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in ref.experts]))
        eng.w2.copy_(torch.stack([e.down_proj.weight for e in ref.experts]))
        s = ref.shared_experts
        eng.shared.gate_up_proj.copy_(torch.cat((s.gate_proj.weight, s.up_proj.weight)))
        eng.shared.down_proj.copy_(s.down_proj.weight)
        x = torch.randn(7, c.hidden_size, dtype=torch.float64)
        assert_close("engine moe", eng(x), ref(x), rtol=2**12, atol=2**12, row_dims=1)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        built = EngineMoE(c)
    finally:
        torch.set_default_dtype(old)
    assert built.gate.weight.dtype == built.gate.e_score_correction_bias.dtype == torch.float32
    assert built.w13.dtype == torch.bfloat16


def test_hadamard_is_orthogonal_and_preserves_dots(seed):
    x, y = torch.randn(5, 128, dtype=torch.float64), torch.randn(5, 128, dtype=torch.float64)
    hx, hy = hadamard_transform(x), hadamard_transform(y)
    assert torch.allclose((hx * hy).sum(-1), (x * y).sum(-1), atol=1e-10)
    assert torch.allclose(hadamard_transform(hx), x, atol=1e-12)  # H is symmetric and orthonormal
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(torch.zeros(3, 96))


def test_fp8_ue8m0_round_trip(seed):
    x = torch.randn(6, 256) * torch.logspace(-3, 3, 6)[:, None]
    q, s = fp8_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 2)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two (ue8m0)
    amax = x.view(6, 2, 128).abs().amax(-1)
    assert (amax / s <= 448).all() and (amax / s > 224).all()  # the smallest power of two that fits
    err = (fp8_round_trip(x) - x).abs()
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself; subnormals by s * 2^-10
    bound = torch.maximum(x.abs() * 2.0 ** -4, s.repeat_interleave(128, 1) * 2.0 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert ue8m0_scale(torch.tensor([0.0])).item() == 2.0 ** math.ceil(math.log2(1e-4 / 448))
    with pytest.raises(ValueError, match="not a multiple of the block 128"):
        fp8_quantize(torch.zeros(2, 100))
    # given scales: its own reproduce it; twice them halve every value (exactly: powers of two, e4m3 normals)
    assert torch.equal(fp8_quantize(x, scale=s)[0].float(), q.float())
    y = x * (x.abs() > s.repeat_interleave(128, 1) * 2.0 ** -5)  # no subnormal at the doubled scale
    qy, sy = fp8_quantize(y)
    assert torch.equal(fp8_quantize(y, scale=2 * sy)[0].float() * 2, qy.float())
    with pytest.raises(ValueError, match=r"scale: expected shape \[6, 2\], got \[6, 1\]"):
        fp8_quantize(x, scale=s[:, :1])
