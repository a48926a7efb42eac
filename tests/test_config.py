import json

import pytest

from dsv32ref import PRESETS, ModelConfig
from dsv32ref.config import indexer_types_from_schedule
from dsv32ref.hf_config import to_hf
from dsv32ref.param_counts import layer_parameter_counts, model_parameter_count


def test_deepseek_v32_softmax_scale():
    c = ModelConfig.preset("deepseek-v3.2")
    assert abs(c.softmax_scale - 0.135234) <= 1e-6
    assert c.latent_dim == 576 and c.qk_head_dim == 192
    assert ModelConfig.preset("glm-5.2").softmax_scale == pytest.approx(256 ** -0.5)  # plain RoPE


def test_glm52_index_share_schedule():
    c = ModelConfig.preset("glm-5.2")
    full = [i for i in range(78) if c.runs_indexer(i)]
    assert full == [0, 1, 2] + list(range(6, 75, 4))
    assert len(full) == 21 and c.num_indexer_layers == 21
    assert c.indexer_source_layer(5) == 2 and c.indexer_source_layer(9) == 6 and c.indexer_source_layer(77) == 74
    assert ModelConfig.preset("deepseek-v3.2").num_indexer_layers == 61
    assert ModelConfig.preset("glm-5").num_indexer_layers == 78


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'gpt-4'.*deepseek-v3.2"):
        ModelConfig.preset("gpt-4")


@pytest.mark.parametrize("field,value,msg", [
    ("num_attention_heads", 0, "num_attention_heads: expected a positive int"),
    ("n_group", 3, "not divisible by n_group=3"),
    ("first_k_dense_replace", 99, "first_k_dense_replace"),
    ("indexer_types", ("shared",) + ("full",) * 60, "layer 0 must be 'full'"),
    ("indexer_types", ("full",) * 3, "expected 61 entries"),
    ("model_type", "llama", "model_type"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim"),
])
def test_validation(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig.preset("deepseek-v3.2").replace(**{field: value})


# ---- per-layer parameter counts against a hand count from the published sizes ----------------------

def _hand_counts(hidden, heads, q_lora, nope, rope, v, idx_heads, inter, vocab, experts=256, moe_inter=2048):
    lora = 512
    mla = (hidden * q_lora + q_lora  # q_a_proj + q_a_layernorm
           + q_lora * heads * (nope + rope)  # q_b_proj
           + hidden * (lora + rope) + lora  # kv_a_proj_with_mqa + kv_a_layernorm
           + lora * heads * (nope + v)  # kv_b_proj (W_UK ; W_UV)
           + heads * v * hidden)  # o_proj
    indexer = q_lora * idx_heads * 128 + hidden * 128 + 2 * 128 + hidden * idx_heads
    dense = 3 * hidden * inter
    moe = experts * hidden + experts + experts * 3 * hidden * moe_inter + 3 * hidden * moe_inter
    return mla, indexer, dense, moe, 2 * hidden


@pytest.mark.parametrize("preset,sizes", [
    ("deepseek-v3.2", dict(hidden=7168, heads=128, q_lora=1536, nope=128, rope=64, v=128, idx_heads=64,
                           inter=18432, vocab=129280)),
    ("glm-5", dict(hidden=6144, heads=64, q_lora=2048, nope=192, rope=64, v=256, idx_heads=32,
                   inter=12288, vocab=154880)),
    ("glm-5.2", dict(hidden=6144, heads=64, q_lora=2048, nope=192, rope=64, v=256, idx_heads=32,
                     inter=12288, vocab=154880)),
])
def test_layer_parameter_counts_match_hand_count(preset, sizes):
    c = ModelConfig.preset(preset)
    mla, indexer, dense, moe, norms = _hand_counts(**sizes)
    counts = layer_parameter_counts(c)
    for i, got in enumerate(counts):
        want_idx = indexer if c.runs_indexer(i) else 0
        want_mlp = dense if i < 3 else moe
        assert got == {"mla": mla, "indexer": want_idx, "mlp": want_mlp, "norms": norms,
                       "total": mla + want_idx + want_mlp + norms}, f"layer {i}"
    if preset == "deepseek-v3.2":
        # DeepSeek-V3's 671B main model (the 14B MTP module excluded) + 61 indexers of ~14.0M each.
        total = model_parameter_count(c)
        assert 671.0e9 < total < 672.5e9


# ---- config.json, both forms ------------------------------------------------------------------------

RELEASED_DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
    "use_cache": True, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def _current_glm52():
    raw = to_hf(ModelConfig.preset("glm-5.2"), form="current")
    del raw["indexer_types"]
    raw.update(index_topk_freq=4, index_skip_topk_offset=3, head_dim=64)
    return raw


def test_from_hf_released_deepseek(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_DSV32))
    c = ModelConfig.from_hf(tmp_path)
    assert c == ModelConfig.preset("deepseek-v3.2").replace(name=c.name, rope_scaling=c.rope_scaling)
    assert c.softmax_scale == pytest.approx(0.1352337788, abs=1e-9)
    assert c.indexer_rope_interleave is False and c.num_nextn_predict_layers == 1


def test_from_hf_current_glm52_schedule(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_current_glm52()))
    c = ModelConfig.from_hf(tmp_path / "config.json")
    assert c.layer_indexer_types == ModelConfig.preset("glm-5.2").layer_indexer_types
    assert c.rope_theta == 8e6 and c.rope_scaling is None and c.indexer_rope_interleave is True


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("form", ["released", "current"])
def test_to_hf_round_trip(preset, form):
    c = ModelConfig.preset(preset)
    back = ModelConfig.from_hf_dict(json.loads(json.dumps(to_hf(c, form))), name=c.name)
    assert back == c


@pytest.mark.parametrize("change,msg", [
    ({"model_type": "deepseek_v3"}, "model_type expected one of"),
    ({"fancy_new_field": 1}, r"unknown fields \['fancy_new_field'\]"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_key_value_heads": 1}, "num_key_value_heads=1 != num_attention_heads=128"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, "disagree"),
    ({"rope_scaling": {"type": "longrope", "factor": 4}}, "'longrope' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 40}}, "misses"),
    ({"mlp_layer_types": ["dense"] * 2 + ["sparse"] * 59}, "first_k_dense_replace=3"),
    ({"index_topk_pattern": "FSX"}, "letters other than F/S"),
    ({"indexer_types": ["full"] * 60 + ["partial"]}, "unknown entries"),
])
def test_from_hf_rejects(tmp_path, change, msg):
    raw = dict(RELEASED_DSV32, **change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=msg):
        ModelConfig.from_hf(tmp_path)


def test_from_hf_missing_and_broken(tmp_path):
    with pytest.raises(ValueError, match="config.json: no such file"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    raw = dict(RELEASED_DSV32)
    del raw["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"missing required fields \['kv_lora_rank'\]"):
        ModelConfig.from_hf(tmp_path)


def test_schedule_function():
    assert indexer_types_from_schedule(6, 1, 2) == ("full",) * 6
    assert indexer_types_from_schedule(8, 2, 2) == ("full", "full", "shared", "full", "shared", "full", "shared", "full")
