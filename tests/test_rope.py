import pytest
import torch

from dsv32ref import ModelConfig
from dsv32ref.reference.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from oracle import rope_complex, yarn_inv_freq


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "glm-5.2", "tiny-deepseek-v3.2"])
def test_inv_freq_matches_scalar_yarn(preset):
    c = ModelConfig.preset(preset)
    ref = yarn_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    assert torch.allclose(rope_inv_freq(c), ref, rtol=1e-14, atol=0)


def test_deepseek_yarn_ramp_endpoints():
    """The fastest frequencies are untouched, the slowest divided by the factor 40."""
    c = ModelConfig.preset("deepseek-v3.2")
    f, plain = rope_inv_freq(c), 1e4 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(f[:10], plain[:10]) and torch.allclose(f[-5:], plain[-5:] / 40)
    # low = floor(64 ln(4096/(32 2 pi)) / (2 ln 1e4)) = 10, high = ceil(same for beta 1) = 23
    assert f[10].item() == pytest.approx(plain[10].item(), rel=1e-14) and 1 < plain[16] / f[16] < 40


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_matches_complex_rotation(interleaved, seed):
    c = ModelConfig.preset("deepseek-v3.2")
    T, H = 9, 3
    x = torch.randn(T, H, 64, dtype=torch.float64)
    pos = torch.randint(0, 100_000, (T,))
    cos, sin = RotaryEmbedding(c)(pos, torch.float64)
    got = apply_rope(x, cos, sin, interleaved)
    assert torch.allclose(got, rope_complex(x, pos, rope_inv_freq(c), interleaved), atol=1e-12)


def test_rope_scores_depend_on_offset_only(seed):
    c = ModelConfig.preset("tiny-deepseek-v3.2")
    emb = RotaryEmbedding(c)
    q, k = torch.randn(1, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)

    def score(pq, pk):
        cq, sq = emb(torch.tensor([pq]), torch.float64)
        ck, sk = emb(torch.tensor([pk]), torch.float64)
        return (apply_rope(q, cq, sq, True) * apply_rope(k, ck, sk, True)).sum().item()

    assert score(10, 3) == pytest.approx(score(1007, 1000), abs=1e-9)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-6)


def test_apply_rope_bad_width():
    cos = sin = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="x has 6 rope dims but cos has 4"):
        apply_rope(torch.zeros(2, 6), cos, sin, True)


def test_rope_keeps_bf16_dtype():
    c = ModelConfig.preset("tiny-deepseek-v3.2")
    cos, sin = RotaryEmbedding(c)(torch.arange(4), torch.bfloat16)
    assert cos.dtype == torch.float32
    out = apply_rope(torch.randn(4, 2, 8).bfloat16(), cos, sin, True)
    assert out.dtype == torch.bfloat16
