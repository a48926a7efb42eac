import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv32ref import DeepseekV32ForCausalLM, init_dummy_weights, load_pretrained, save_pretrained
from dsv32ref.checkpoint import dequantize_fp8_blocks, quantize_fp8_blocks
from dsv32ref.testing import assert_close
from helpers import tiny_model


def test_fp8_block_quantisation_round_trip(seed):
    w = torch.randn(300, 200) * torch.rand(300, 1) * 10  # rows of different scales; partial edge blocks
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
    back = dequantize_fp8_blocks(q, s)
    # each element within half an e4m3 step of its block's scale: |err| <= 2^-4 |w| (normal) or s 2^-10
    bound = torch.maximum(w.abs() * 2.0 ** -4, s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] * 2.0 ** -9)
    assert ((back - w).abs() <= bound).all()
    with pytest.raises(ValueError, match=r"weight_scale_inv: expected shape \[3, 2\].*got \[2, 2\]"):
        dequantize_fp8_blocks(q, s[:2])


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_fp8_checkpoint_round_trips_within_fp8_error(tmp_path, preset, seed):
    # 128-wide blocks only make sense for real widths: widen the tiny model so blocks are full
    model = tiny_model(preset, dtype=torch.float32, seed=seed, hidden_size=256, q_lora_rank=128,
                       kv_lora_rank=128, qk_rope_head_dim=64, index_head_dim=128)
    save_pretrained(model, tmp_path, fp8=True)
    raw = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert raw["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert raw["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (1, 2)
    assert raw["lm_head.weight"].dtype == torch.float32  # not quantised, like the release
    if model.config.runs_indexer(1):
        assert raw["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        if name + "_scale_inv" in raw:  # e4m3 rounds to half a step: 2^-4 relative, per element
            assert_close(name, b, a, precision=torch.float8_e4m3fn, rtol=0.5, atol=0.5)
        else:
            assert torch.equal(b, a), name
    # (No whole-model comparison: in a random tiny MoE, fp8-sized weight changes flip expert choices.)


def test_sharded_checkpoint_loads_exactly(tmp_path, seed):
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32, seed=seed)
    save_pretrained(model, tmp_path, max_shard_bytes=100_000, config_form="current")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.config.layer_indexer_types == model.config.layer_indexer_types
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, model.config.vocab_size, (7,))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_bf16_load_and_mtp_layers_skipped(tmp_path, seed):
    model = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32, seed=seed)
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    n = model.config.num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer's tensor
    tensors[f"model.layers.{n}.self_attn.q_a_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"unexpected: model.layers.{n}.eh_proj.weight \(layer {n}: the config "
                                         rf"has {n} layers and 0 MTP layers\)"):
        load_pretrained(tmp_path)  # a layer past the config is not silently an MTP layer
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    loaded = load_pretrained(tmp_path)  # bf16 by default
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.model.layers[3].mlp.gate.e_score_correction_bias.dtype == torch.float32
    out = loaded(torch.tensor([1, 2, 3]))
    assert out.shape == (3, model.config.vocab_size) and out.dtype == torch.bfloat16
    # a config that counts the last decoder layer as an MTP layer: refused (the layer was dropped silently)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n - 1, "num_nextn_predict_layers": 2}))
    with pytest.raises(ValueError, match=rf"not an MTP layer: layer {n - 1} \(the config counts it as one, but it "
                                         rf"has no eh_proj"):
        load_pretrained(tmp_path)


def _broken(tmp_path, mutate):
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    save_pretrained(model, tmp_path, fp8=False)
    tensors = load_file(tmp_path / "model.safetensors")
    mutate(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_broken_checkpoint_names_every_problem(tmp_path):
    def mutate(t):
        del t["model.layers.0.self_attn.o_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
        t["model.layers.2.self_attn.indexer.wk.weight"] = torch.zeros(16, 64)  # layer 2 shares: no indexer
        t["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(7, 32)

    _broken(tmp_path, mutate)
    with pytest.raises(ValueError) as e:
        load_pretrained(tmp_path)
    msg = str(e.value)
    for part in ["missing: model.layers.0.self_attn.o_proj.weight", "missing: model.norm.weight",
                 "unexpected: model.layers.0.self_attn.extra_proj.weight",
                 "unexpected: model.layers.2.self_attn.indexer.wk.weight",
                 "mis-shaped: model.layers.1.self_attn.kv_b_proj.weight: expected [128, 32], got [7, 32]"]:
        assert part in msg


def test_fp8_weight_without_scale(tmp_path):
    def mutate(t):
        name = "model.layers.0.self_attn.q_a_proj.weight"
        t[name] = t[name].to(torch.float8_e4m3fn)

    _broken(tmp_path, mutate)
    with pytest.raises(ValueError, match="missing: model.layers.0.self_attn.q_a_proj.weight_scale_inv"):
        load_pretrained(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="config.json: no such file"):
        load_pretrained(tmp_path)
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    save_pretrained(model, tmp_path, max_shard_bytes=100_000)
    os.remove(tmp_path / "model-00002-of-{:05d}.safetensors".format(
        len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))))
    with pytest.raises(ValueError, match="shards listed but absent: \\['model-00002-of"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_pretrained(tmp_path)


def test_dummy_weights_reproducible():
    a = tiny_model("tiny-deepseek-v3.2", seed=3)
    b = DeepseekV32ForCausalLM(a.config).to(torch.float32)
    init_dummy_weights(b, 3)
    c = tiny_model("tiny-deepseek-v3.2", seed=4)
    for (name, x), (_, y), (_, z) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(x.float(), y), name  # same seed, other dtype: the same values
        if x.numel() > 8:
            assert not torch.equal(x, z), name


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_dummy_weights_not_degenerate(preset):
    """Attention is neither uniform nor one-hot, and the top-k is not simply the most recent keys."""
    from dsv32ref.diagnostics import attention_stats

    model = tiny_model(preset, dtype=torch.float32, seed=0)
    stats = attention_stats(model, torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)))
    for s in stats:
        assert 0.05 < s["entropy_ratio"] < 0.98, s  # entropy / log(#selected keys)
        assert s["max_prob"] < 0.95, s
        if s["runs_indexer"]:
            assert s["recent_overlap"] < 0.6, s  # overlap of top-k with the k most recent positions
            assert s["distinct_sets"] > 0.9, s  # fraction of queries with a top-k set of their own
