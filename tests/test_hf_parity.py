"""Parity with HF transformers: tiny `deepseek_v32` and `glm_moe_dsa` checkpoints written by transformers' own
save_pretrained load through dsv32ref.load_pretrained and give transformers' logits, per element, in fp32, at a
sequence longer than index_topk (so the indexer's selection matters), IndexShare included.

Exact ties in the indexer's scores would be broken differently (torch.topk against our position order): with
16 indexer heads and weights drawn at initializer_range 0.2 they do not occur for these fixed seeds."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dsv32ref import load_pretrained  # noqa: E402
from dsv32ref.testing import assert_close  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16,
              qk_nope_head_dim=16, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
              index_topk=8, index_head_dim=32, index_n_heads=16, first_k_dense_replace=1, tie_word_embeddings=False,
              initializer_range=0.2)


def _configs():
    return {
        "deepseek_v32": transformers.DeepseekV32Config(
            **COMMON, n_group=2, max_position_embeddings=64 * 40,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0}),
        "glm_moe_dsa": transformers.GlmMoeDsaConfig(
            **COMMON, n_group=1, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            indexer_types=["full", "shared", "full", "shared"]),
    }


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("seed_", [0, 1])
def test_logits_match_transformers(tmp_path, model_type, seed_):
    torch.manual_seed(seed_)
    cfg = _configs()[model_type]
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.model_type == model_type
    if model_type == "glm_moe_dsa":
        assert ours.config.layer_indexer_types == ("full", "shared", "full", "shared")
    ids = torch.randint(0, cfg.vocab_size, (3 * cfg.index_topk,))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]  # (T, vocab)
        got = ours(ids)
    assert_close(f"{model_type} logits", got, want, rtol=2**8, atol=2**8)
