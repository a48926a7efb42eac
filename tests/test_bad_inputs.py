"""Inputs a careless or hostile user passes: each gets a ValueError whose message names the culprit, or a
documented result. Kernel cases with out-of-range values on the device run in a subprocess (a crash there
would be an out-of-bounds access)."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv32ref import checks
from dsv32ref import (AttentionMetadata, BlockAllocator, DeepseekV32ForCausalLM, ModelConfig, PagedKVCache,
                      init_dummy_weights, load_pretrained, save_pretrained)
from dsv32ref.cache import StepPlan, check_cache_fits, gather_tokens, indexer_key_bytes, token_bytes, write_tokens
from dsv32ref.checkpoint import dequantize_fp8_blocks, quantize_fp8_blocks
from dsv32ref.engine import EngineConfig, EngineModel, LLMEngine, StepInput, build_model, from_reference, share_weights
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.kernels import (add_rms_norm, fused_norm_rope, fused_q, indexer_scores_paged, sparse_mla_paged,
                              topk_from_scores)
from dsv32ref.kernels.skinny_gemm import skinny_gemm_counters
from dsv32ref.reference import (apply_rope, fp8_quantize, hadamard_transform, indexer_scores, rms_norm, sparse_mla,
                                topk_indices)
from dsv32ref.reference.fp8_cache import indexer_scores_fp8, latent_scale, quantize_latent, sparse_mla_fp8, write_latent
from dsv32ref.reference.numerics import fp8_dequantize, pow2_scale, ue8m0_scale
from dsv32ref.reference.rope import RotaryEmbedding, rope_inv_freq
from dsv32ref.reference.sparse_attention import dense_mla
from dsv32ref.reference.norms import LayerNorm, RMSNorm, layer_norm
from dsv32ref.testing import compare, eps
from helpers import tiny_model

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on CPU-only machines")
TINY = ModelConfig.preset("tiny-deepseek-v3.2")


# ---- config ------------------------------------------------------------------------------------------

CONFIG_CASES = [
    (dict(vocab_size=0), r"ModelConfig.vocab_size: expected a positive int, got 0"),
    (dict(vocab_size=-5), r"ModelConfig.vocab_size: expected a positive int, got -5"),
    (dict(vocab_size="128"), r"ModelConfig.vocab_size: expected a positive int, got '128'"),
    (dict(vocab_size=128.0), r"ModelConfig.vocab_size: expected a positive int, got 128.0"),
    (dict(hidden_size=True), r"ModelConfig.hidden_size: expected a positive int, got True"),
    (dict(num_hidden_layers=0), r"ModelConfig.num_hidden_layers: expected a positive int, got 0"),
    (dict(num_hidden_layers=2 ** 17), r"ModelConfig.num_hidden_layers: expected at most 65536, got 131072"),
    (dict(num_attention_heads=-1), r"ModelConfig.num_attention_heads: expected a positive int"),
    (dict(index_topk=0), r"ModelConfig.index_topk: expected a positive int, got 0"),
    (dict(first_k_dense_replace=-1), r"ModelConfig.first_k_dense_replace: expected 0..num_hidden_layers"),
    (dict(first_k_dense_replace=99), r"ModelConfig.first_k_dense_replace: expected 0..num_hidden_layers"),
    (dict(n_shared_experts=-1), r"ModelConfig.n_shared_experts: expected an int >= 0, got -1"),
    (dict(qk_rope_head_dim=7), r"ModelConfig.qk_rope_head_dim: expected an even size"),
    (dict(qk_rope_head_dim=64), r"ModelConfig.qk_rope_head_dim: expected an even size <= index_head_dim"),
    (dict(n_group=3), r"ModelConfig.n_group: n_routed_experts=8 is not divisible by n_group=3"),
    (dict(topk_group=5), r"ModelConfig.topk_group: 5 > n_group=4"),
    (dict(num_experts_per_tok=5), r"ModelConfig.num_experts_per_tok: 5 experts cannot be chosen"),
    (dict(rope_theta=0.0), r"ModelConfig.rope_theta: expected a finite number > 0, got 0.0"),
    (dict(rope_theta=math.inf), r"ModelConfig.rope_theta: expected a finite number > 0, got inf"),
    (dict(rope_theta="1e4"), r"ModelConfig.rope_theta: expected a finite number > 0, got '1e4'"),
    (dict(rope_theta=1.0), r"ModelConfig.rope_theta: expected a base > 1, got 1.0"),
    (dict(rope_theta=0.5), r"ModelConfig.rope_theta: expected a base > 1, got 0.5"),
    (dict(routed_scaling_factor=math.nan), r"ModelConfig.routed_scaling_factor: expected a finite number > 0"),
    # inf in float32, where the MoE scales its weights: every logit NaN
    (dict(routed_scaling_factor=1e39), r"ModelConfig.routed_scaling_factor: expected a value within float32's range"),
    (dict(rms_norm_eps=0.0), r"ModelConfig.rms_norm_eps: expected a finite number > 0, got 0.0"),
    (dict(rms_norm_eps=-1e-6), r"ModelConfig.rms_norm_eps: expected a finite number > 0"),
    (dict(rms_norm_eps=1e-50), r"ModelConfig.rms_norm_eps: expected a value > 0 in float32 .*got 1e-50"),
    (dict(max_position_embeddings=0), r"ModelConfig.max_position_embeddings: expected a positive int, got 0"),
    (dict(index_topk=2 ** 31 - 1), r"ModelConfig.index_topk: expected at most max_position_embeddings=4096 .* or "
                                   r"the released models' 2048, got 2147483647"),
    (dict(num_nextn_predict_layers=-1), r"ModelConfig.num_nextn_predict_layers: expected an int >= 0, got -1"),
    (dict(norm_topk_prob="yes"), r"ModelConfig.norm_topk_prob: expected a bool, got 'yes'"),
    (dict(indexer_rope_interleave=1), r"ModelConfig.indexer_rope_interleave: expected a bool, got 1"),
    (dict(model_type="llama"), r"ModelConfig.model_type: expected 'deepseek_v32' or 'glm_moe_dsa', got 'llama'"),
    (dict(name=None), r"ModelConfig.name: expected a str, got NoneType None"),
    (dict(extra=None), r"ModelConfig.extra: expected a dict, got NoneType"),
    (dict(indexer_types=("full",)), r"ModelConfig.indexer_types: expected 4 entries, got 1"),
    (dict(indexer_types="full"), r"ModelConfig.indexer_types: expected a tuple of 'full' / 'shared', got 'full'"),
    (dict(indexer_types=("full", "shard", "full", "full")), r"ModelConfig.indexer_types: unknown entries \['shard'\]"),
    (dict(indexer_types=("shared", "full", "full", "full")), r"ModelConfig.indexer_types: layer 0 must be 'full'"),
    (dict(vocab_size=2 ** 70), r"ModelConfig.vocab_size: expected at most 2147483647 \(int32 indices\), got"),
    (dict(num_attention_heads=10 ** 10), r"ModelConfig.num_attention_heads: expected at most 2147483647"),
]

_YARN = dict(TINY.rope_scaling)
ROPE_CASES = [
    ({**_YARN, "type": "linear"}, r"ModelConfig.rope_scaling.type: expected 'yarn' \(or no rope_scaling\), got 'linear'"),
    ({**_YARN, "beta_fast": 1, "beta_slow": 32}, r"beta_fast \(1\) must be >= beta_slow \(32\)"),
    ({**_YARN, "factor": 0.5}, r"ModelConfig.rope_scaling.factor: expected >= 1"),
    ({**_YARN, "factor": "40"}, r"ModelConfig.rope_scaling.factor: expected a finite number > 0, got '40'"),
    ({**_YARN, "factor": math.nan}, r"ModelConfig.rope_scaling.factor: expected a finite number > 0, got nan"),
    ({**_YARN, "factor": 10 ** 400}, r"ModelConfig.rope_scaling.factor: expected a finite number > 0, got 1000"),
    ({**_YARN, "mscale": -1.0}, r"ModelConfig.rope_scaling.mscale: expected a finite number >= 0, got -1.0"),
    ({k: v for k, v in _YARN.items() if k not in ("mscale", "mscale_all_dim")}, r"needs mscale and mscale_all_dim"),
    ({**_YARN, "mscale": 0.0, "mscale_all_dim": 0.0}, r"needs mscale and mscale_all_dim"),
    ({k: v for k, v in _YARN.items() if k != "mscale_all_dim"}, r"needs mscale and mscale_all_dim"),
    ({k: v for k, v in _YARN.items() if k != "original_max_position_embeddings"},
     r"YaRN needs \['original_max_position_embeddings'\]"),
    ("yarn", r"ModelConfig.rope_scaling: expected None or a dict, got 'yarn'"),
    ({**_YARN, "factr": 2}, r"ModelConfig.rope_scaling: keys \['factr'\] are not implemented"),
    ({**_YARN, "attention_factor": 0.5}, r"ModelConfig.rope_scaling: keys \['attention_factor'\] are not implemented"),
    ({**_YARN, "rope_type": "linear"}, r"ModelConfig.rope_scaling.rope_type: expected 'yarn' .*, got 'linear'"),
    ({**_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}, r"ModelConfig.rope_scaling: mscale != mscale_all_dim is not implemented"),
    ({**_YARN, "mscale": 1.0, "mscale_all_dim": 0.0}, r"needs mscale and mscale_all_dim"),
    ({**_YARN, "original_max_position_embeddings": 64.5},
     r"ModelConfig.rope_scaling.original_max_position_embeddings: expected an int, got 64.5"),
    ({**_YARN, "mscale": 2 ** 2000, "mscale_all_dim": 2 ** 2000},  # past float's range: not an OverflowError
     r"ModelConfig.rope_scaling.mscale: expected a finite number >= 0, got \d{24}\.\.\. \(603 characters\)"),
    ({**_YARN, 1: 2, None: 3}, r"ModelConfig.rope_scaling: expected str keys, got \[1, None\]"),
]


@pytest.mark.parametrize("changes,match", CONFIG_CASES, ids=[next(iter(c)) + f"={next(iter(c.values()))!r}"[:30]
                                                             for c, _ in CONFIG_CASES])
def test_config_field(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


@pytest.mark.parametrize("rope_scaling,match", ROPE_CASES)
def test_config_rope_scaling(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(rope_scaling=rope_scaling)


def _hf_dir(tmp_path, **edits):
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    save_pretrained(model, tmp_path, config_form="current")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(edits)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("edits,match", [
    (dict(index_topk_freq=0), r"index_topk_freq must be an int >= 1, got 0"),
    (dict(index_topk_freq=-4), r"index_topk_freq must be an int >= 1, got -4"),
    (dict(index_topk_freq=4, index_skip_topk_offset=-1), r"index_skip_topk_offset must be an int >= 0, got -1"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), r"rope type 'dynamic' is not supported"),
    (dict(hidden_size="64"), r"hidden_size"),
    (dict(rms_norm_eps=0), r"rms_norm_eps: expected a finite number > 0"),
    # keys that change the math at other values than the reference implements
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5 is not implemented; expected 1.0"),
    (dict(use_sliding_window=True, sliding_window=4), r"use_sliding_window=True is not implemented"),
    (dict(layer_types=["sliding_attention"] * 4), r"layer_types must list only \['full_attention', 'indexed_attention'\]"),
    (dict(qk_head_dim=5), r"qk_head_dim=5 is not implemented; expected 24"),
    (dict(head_dim=999), r"head_dim=999 is not implemented; expected 8"),
    (dict(rope_interleave=False), r"rope_interleave=False is not implemented; expected True"),
    # rope: a theta that is not a number, YaRN keys under another type, YaRN keys the reference does not implement
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "10000"}), r"rope_theta must be a number, got '10000'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": True}), r"rope_theta must be a number, got True"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 8}),
     r"keys \['factor'\] have no effect on rope type 'default'"),
    (dict(rope_parameters={"type": None, "rope_theta": 1e4, "factor": 40, "original_max_position_embeddings": 64,
                           "beta_fast": 32, "beta_slow": 1}), r"have no effect on rope type 'default'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40, "original_max_position_embeddings": 64,
                           "beta_fast": 32, "beta_slow": 1, "attention_factor": 0.7}),
     r"YaRN keys \['attention_factor'\] are not implemented at these values"),
    (dict(rope_parameters={"rope_type": "yarn", "type": "linear", "rope_theta": 1e4}), r"rope_type and type disagree"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": None}), r"rope_theta must be a number, got None"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling=_YARN),
     r"rope_parameters and rope_theta/rope_scaling disagree"),
    (dict(indexer_types=3), r"config.json: indexer_types must be a list, got 3"),
    (dict(indexer_types=None, index_topk_pattern=5), r"config.json: index_topk_pattern must be a list, got 5"),
    (dict(mlp_layer_types=5), r"config.json: mlp_layer_types must be a list, got 5"),
    (dict(quantization_config="fp8"), r"config.json: quantization_config must be an object, got 'fp8'"),
    (dict(index_topk_pattern="FFFF"), r"config.json: indexer_types disagrees with index_topk_pattern"),
    # lists where strings belong: refused as values, not as unhashable types
    (dict(rope_parameters={"rope_type": ["yarn"], "rope_theta": 1e4}), r"rope_type / type must be a string"),
    (dict(layer_types=[["full_attention"]] * 8), r"layer_types must list only"),
    (dict(mlp_layer_types=[["dense"]] * 8), r"mlp_layer_types must be 8 entries of 'dense'/'sparse'"),
    (dict(indexer_types=[["full"]] * 8), r"ModelConfig.indexer_types: unknown entries \[\['full'\]"),
    (dict(qk_nope_head_dim="16"), r"ModelConfig.qk_nope_head_dim: expected a positive int, got '16'"),
    (dict(num_hidden_layers="8", index_topk_freq=4, mlp_layer_types=None, indexer_types=None),
     r"config: num_hidden_layers must be an int >= 1, got .8."),
    (dict(index_topk_pattern=5), r"config.json: index_topk_pattern must be a list, got 5"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10 ** 400}), r"rope_theta must be a finite number"),
    (dict(indexer_types=None, index_topk_pattern="FSFSFSFS", index_topk_freq=4),
     r"config.json: index_topk_pattern disagrees with index_topk_freq/index_skip_topk_offset"),
    (dict(layer_types=["full_attention"] * 99), r"config.json: layer_types: expected 8 entries \(num_hidden_layers\), got 99"),
    # a schedule of 2^40 layers was built (memory) before any size was checked
    (dict(num_hidden_layers=2 ** 40, index_topk_freq=4, mlp_layer_types=None, indexer_types=None),
     r"config: num_hidden_layers must be at most 65536, got 1099511627776"),
    (dict(num_key_value_heads="4"), r"config.json: num_key_value_heads='4' != num_attention_heads=4"),
], ids=["freq0", "freq-4", "offset-1", "rope-dynamic", "hidden-str", "eps0", "partial-rotary", "sliding", "layer-types",
        "qk-head-dim", "head-dim", "rope-interleave", "theta-str", "theta-bool", "default-with-factor",
        "type-none-with-yarn", "yarn-attention-factor", "types-disagree", "theta-none", "yarn-beside-parameters",
        "indexer-types-int", "pattern-int",
        "mlp-types-int",
        "quant-config-str", "pattern-disagrees", "rope-type-list", "layer-types-lists", "mlp-types-lists",
        "indexer-types-lists", "nope-str", "layers-str-with-freq", "pattern-int-beside-types", "theta-huge",
        "pattern-disagrees-with-freq", "layer-types-99", "layers-2**40", "kv-heads-str"])
def test_config_json(tmp_path, edits, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(_hf_dir(tmp_path, **edits))


def test_a_config_cannot_change_under_its_checks():
    """A preset is a copy, and a config's rope_scaling is its own and read-only: writing into one (the preset's
    dict was shared by every preset() call) changed every later config past its checks, silently. Layer indices
    outside the model are refused, not read from the end."""
    import pickle

    from dsv32ref.hf_config import to_hf

    c = ModelConfig.preset("tiny-deepseek-v3.2")
    with pytest.raises(TypeError, match=r"ModelConfig.rope_scaling is read-only"):
        c.rope_scaling["factor"] = -5.0
    with pytest.raises(TypeError, match=r"read-only"):
        c.rope_scaling.update(factor=-5.0)
    raw = dict(c.rope_scaling)
    d = c.replace(rope_scaling=raw)
    raw["factor"] = -5.0  # the caller's dict: not the config's
    assert d.rope_scaling == ModelConfig.preset("tiny-deepseek-v3.2").rope_scaling == c.rope_scaling
    assert d.softmax_scale == c.softmax_scale and hash(d) == hash(c)
    assert pickle.loads(pickle.dumps(c)) == c and json.loads(json.dumps(to_hf(c)))["rope_scaling"] == dict(c.rope_scaling)
    n = c.num_hidden_layers
    for call, arg in ((c.runs_indexer, -1), (c.indexer_source_layer, n), (c.is_moe_layer, 1.0), (c.runs_indexer, "0")):
        with pytest.raises(ValueError, match=rf"layer: expected an int in \[0, {n}\), got"):
            call(arg)


def test_unknown_preset():  # a missing or broken config.json: tests/test_config.py
    with pytest.raises(ValueError, match="unknown preset 'tiny'"):
        ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match=r"unknown preset \['x'\]"):
        ModelConfig.preset(["x"])


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_configs_transformers_writes_load(tmp_path, model_type):
    """What the held-to-one-value checks must still accept: a config transformers saves itself, which puts
    partial_rotary_factor (1.0) into rope_parameters; another factor there is refused."""
    from transformers import AutoConfig
    AutoConfig.for_model(model_type, partial_rotary_factor=1.0, num_hidden_layers=4).save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path).rope_theta == 10000.0
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"rope_parameters: partial_rotary_factor=0.5 is not implemented"):
        ModelConfig.from_hf(tmp_path)


def test_what_is_not_a_checkpoint_or_a_config(tmp_path):
    """A file where a checkpoint directory belongs, a config.json that is a folder or binary, None: ValueErrors."""
    save_pretrained(tiny_model("tiny-glm-5.2", dtype=torch.float32), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"path: expected a checkpoint directory \(config.json and safetensors\), got"):
        load_pretrained(tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ValueError, match=r"path: expected a checkpoint directory"):
        load_pretrained(None)
    with pytest.raises(ValueError, match=r"load_pretrained: device: cuda:7 is not available here"):
        load_pretrained(tmp_path / "ckpt", device="cuda:7")
    with pytest.raises(ValueError, match=r"config.json: .*model.safetensors' is not valid JSON \(UnicodeDecodeError"):
        ModelConfig.from_hf(tmp_path / "ckpt" / "model.safetensors")
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"config.json: no such file .*config.json/config.json'"):  # a folder: a checkpoint's
        ModelConfig.from_hf(tmp_path / "dir" / "config.json")
    with pytest.raises(ValueError, match=r"path: expected a checkpoint directory or a config.json path, got NoneType"):
        ModelConfig.from_hf(None)


# ---- checkpoint --------------------------------------------------------------------------------------

def _ckpt(tmp_path, edit):
    model = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32)
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


W = "model.layers.0.self_attn.q_a_proj.weight"


def _poison(name, value, fp8=False):
    def edit(t):
        if fp8:  # the weight in fp8 with its one 128 x 128 block's scale
            t[W], t[W + "_scale_inv"] = t[W].to(torch.float8_e4m3fn), torch.ones(1, 1)
        t[name] = t[name].clone()
        t[name].view(-1)[-1] = value
    return edit


def _cast(dtype):
    def edit(t):
        t[W] = t[W].to(dtype) if dtype != torch.bool else t[W] > 0
    return edit


@pytest.mark.parametrize("edit,match", [
    (_cast(torch.int8), rf"wrong dtype: {W}: torch.int8"),
    (_cast(torch.bool), rf"wrong dtype: {W}: torch.bool"),
    (_cast(torch.float8_e5m2), rf"wrong dtype: {W}: torch.float8_e5m2"),
    (lambda t: t.update({W + "_scale_inv": torch.ones(1, 1)}), rf"unexpected: {W}_scale_inv beside a torch.float32 weight"),
    (lambda t: t.update({"model.layers.0.self_attn.nothing_scale_inv": torch.ones(1)}),
     r"unexpected: model.layers.0.self_attn.nothing_scale_inv \(no weight"),
    (lambda t: t.update({W: t[W].to(torch.float8_e4m3fn)}), rf"missing: {W}_scale_inv \(for fp8 tensor"),
    (lambda t: t.update({W: t[W].to(torch.float8_e4m3fn), W + "_scale_inv": torch.ones(3, 3)}),
     rf"mis-shaped: {W}_scale_inv"),
    (lambda t: t.update({W: t[W].to(torch.float8_e4m3fn), W + "_scale_inv": torch.ones(1, 2, dtype=torch.int32)}),
     rf"wrong dtype: {W}_scale_inv: torch.int32"),
    (lambda t: t.pop("lm_head.weight"), r"missing: lm_head.weight"),
    (lambda t: t.update({"model.extra.weight": torch.ones(2)}), r"unexpected: model.extra.weight"),
    (lambda t: t.update({W: t[W][:, :-1].contiguous()}), rf"mis-shaped: {W}"),
    (lambda t: t.update({"model.layers.4.self_attn.q_a_proj.weight": torch.ones(2, 2)}),
     r"unexpected: model.layers.4.self_attn.q_a_proj.weight \(layer 4: the config has 4 layers and 0 MTP"),
    # a zero scale zeroes its block, a negative one flips its sign
    (_poison(W + "_scale_inv", 0.0, fp8=True), rf"non-positive: {W}_scale_inv \(1 of 1 scales <= 0\)"),
    (_poison(W + "_scale_inv", -1.0, fp8=True), rf"non-positive: {W}_scale_inv \(1 of 1 scales <= 0\)"),
], ids=["int8", "bool", "e5m2", "scale-beside-fp32", "stray-scale", "fp8-no-scale", "scale-shape", "scale-int",
        "missing", "unexpected", "mis-shaped", "layer-past-config", "zero-scale", "negative-scale"])
def test_checkpoint_tensors(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_pretrained(_ckpt(tmp_path, edit), dtype=torch.float32)


@pytest.mark.parametrize("edit,match", [
    (_poison(W, float("nan")), rf"non-finite: {W} \(1 NaN, 0 inf of "),
    (_poison("lm_head.weight", float("-inf")), r"non-finite: lm_head.weight \(0 NaN, 1 inf of "),
    (_poison(W + "_scale_inv", float("inf"), fp8=True), rf"non-finite: {W}_scale_inv \(0 NaN, 1 inf of 1\)"),
], ids=["nan-weight", "inf-weight", "inf-scale"])
def test_checkpoint_with_nan_or_inf_is_refused_or_loaded_with_a_warning(tmp_path, edit, match):
    path = _ckpt(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        load_pretrained(path, dtype=torch.float32)
    with pytest.warns(UserWarning, match=match):
        load_pretrained(path, dtype=torch.float32, nonfinite="warn")
    with pytest.raises(ValueError, match=r"nonfinite: expected 'raise' or 'warn', got 'ignore'"):
        load_pretrained(path, nonfinite="ignore")


def test_a_config_whose_model_cannot_fit_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    """A config.json that says vocab_size 2^31 - 1 beside shards of a tiny model: the model it describes is
    refused by its size before any of it is allocated (its embedding and head alone take hundreds of GiB; this
    machine is taken to hold 16 GiB)."""
    monkeypatch.setattr(checks, "device_memory_bytes", lambda device: 16 * 2 ** 30)
    save_pretrained(tiny_model("tiny-deepseek-v3.2", dtype=torch.float32), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 2 ** 31 - 1}))
    with pytest.raises(ValueError, match=r"load_pretrained: the model of .*config.json in torch.bfloat16: needs "
                                         r"\d+\.\d GiB, more than cpu holds in all"):
        load_pretrained(tmp_path)


def test_checkpoint_files(tmp_path):
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    single = tmp_path / "single"
    save_pretrained(model, single)
    (single / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        load_pretrained(single)
    sharded = tmp_path / "sharded"
    save_pretrained(model, sharded, max_shard_bytes=100_000)
    index = sharded / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    shard = next(iter(good["weight_map"].values()))
    (sharded / shard).write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match=rf"{shard}: not a readable safetensors file"):
        load_pretrained(sharded)
    for bad, match in (({"weight_map": ["a"]}, "weight_map must map tensor names"),
                       ({"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}, "weight_map must map tensor"),
                       ({"weight_map": {"lm_head.weight": 3}}, "weight_map must map tensor names"),
                       ({"metadata": {}}, "no readable weight_map"),
                       ({"weight_map": {"lm_head.weight": "absent.safetensors"}}, r"shards listed but absent")):
        index.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_pretrained(sharded)
    index.write_text("[")
    with pytest.raises(ValueError, match="no readable weight_map"):
        load_pretrained(sharded)
    index.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="no readable weight_map .*UnicodeDecodeError"):
        load_pretrained(sharded)
    index.unlink()
    index.mkdir()
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: '.*' is not a regular file"):
        load_pretrained(sharded)
    index.rmdir()
    with pytest.raises(ValueError, match=r"neither model.safetensors nor model.safetensors.index.json"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((single / "config.json").read_text())
        load_pretrained(tmp_path / "empty")


@pytest.mark.parametrize("block,match", [([128], r"weight_block_size must be two ints in \[1, 2\^31\)"),
                                         ("128", r"weight_block_size must be two ints in \[1, 2\^31\)"),
                                         ([0, 128], r"weight_block_size must be two ints in \[1, 2\^31\), got \[0, 128\]"),
                                         ([2 ** 70, 128], r"weight_block_size must be two ints in \[1, 2\^31\)")])
def test_checkpoint_block_size(tmp_path, block, match):
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    save_pretrained(model, tmp_path, fp8=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = block
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path)


def test_a_one_dimensional_fp8_weight_is_named_as_such(tmp_path):
    """An fp8 norm weight (1-D) with a scale beside it: named as a 1-D fp8 weight (the message spoke of 'q')."""
    save_pretrained(tiny_model("tiny-glm-5.2", dtype=torch.float32), tmp_path, fp8=True)
    t = load_file(tmp_path / "model.safetensors")
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.float8_e4m3fn)
    t["model.norm.weight_scale_inv"] = torch.ones(1, 1)
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"mis-shaped: model.norm.weight: fp8 weights are 2-D .*got \[\d+\]"):
        load_pretrained(tmp_path)


def test_a_mis_shaped_fp8_weight_is_refused_before_it_is_dequantised(tmp_path, monkeypatch):
    """An fp8 weight of the wrong shape: refused by its shape, never expanded to fp32 first (from a sparse file of
    no size on disk, that had asked for 64 GiB, or filled half the machine before the refusal)."""
    from dsv32ref import checkpoint

    save_pretrained(tiny_model("tiny-glm-5.2", dtype=torch.float32), tmp_path, fp8=True)
    t = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_a_proj.weight"
    want = list(t[name].shape)
    t[name] = torch.zeros(1024, 1024).to(torch.float8_e4m3fn)
    t[name + "_scale_inv"] = torch.ones(8, 8)
    save_file(t, tmp_path / "model.safetensors")
    plain = checkpoint._dequantize

    def dequantize(w, scale, block):
        assert w.shape != (1024, 1024), "dequantised before its shape was checked"
        return plain(w, scale, block)

    monkeypatch.setattr(checkpoint, "_dequantize", dequantize)
    with pytest.raises(ValueError, match=rf"mis-shaped: {name}: expected {re.escape(str(want))}, got \[1024, 1024\]"):
        load_pretrained(tmp_path)


def test_checkpoint_arguments(tmp_path):
    from dsv32ref.hf_config import to_hf

    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"max_shard_bytes: expected None or an int >= 1, got 0"):
        save_pretrained(model, tmp_path, max_shard_bytes=0)
    with pytest.raises(ValueError, match=r"path: a path cannot hold a NUL character"):
        save_pretrained(model, str(tmp_path / "x\0y"))
    with pytest.raises(ValueError, match=r"to_hf: config: expected a ModelConfig, got NoneType"):
        to_hf(None)
    with pytest.raises(ValueError, match=r"DeepseekV32ForCausalLM: config: expected a ModelConfig, got NoneType"):
        DeepseekV32ForCausalLM(None)
    save_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match=r"load_pretrained: device: expected a cpu or cuda device, got meta"):
        load_pretrained(tmp_path, device="meta")  # (a model with no weights)
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"config.json: .* nests its values too deeply to be a config"):
        ModelConfig.from_hf(deep)
    # an integer past Python's digit limit (a ValueError that named no file), a FIFO (read forever), a file too
    # large to be a config (/dev/zero read until memory ran out)
    (deep / "config.json").write_text('{"vocab_size": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match=r"config.json: .*deep/config.json' is not valid JSON \(ValueError: Exceeds"):
        ModelConfig.from_hf(deep)
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(ValueError, match=r"config.json: .*fifo.json' is not a regular file"):
        ModelConfig.from_hf(tmp_path / "fifo.json")
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate((1 << 24) + 1)
    with pytest.raises(ValueError, match=r"config.json: .*huge.json' holds 16777217 bytes, a config at most 16777216"):
        ModelConfig.from_hf(tmp_path / "huge.json")
    # YaRN's mscale past float's range: the softmax scale inf, refused at the first forward without naming the config
    yarn = dict(ModelConfig.preset("tiny-deepseek-v3.2").rope_scaling or {}, type="yarn", factor=2,
                original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1e200, mscale_all_dim=1e200)
    with pytest.raises(ValueError, match=r"ModelConfig.rope_scaling: mscale_all_dim 1e\+200 and factor 2 give the "
                                         r"softmax scale tau = inf, not a finite number"):
        ModelConfig.preset("tiny-deepseek-v3.2").replace(rope_scaling=yarn)
    with pytest.raises(ValueError, match=r"dtype: expected a float dtype for the model, got torch.int8"):
        load_pretrained(tmp_path, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"deployed_numerics: expected a bool, got str 'no'"):
        load_pretrained(tmp_path, dtype=torch.float32, deployed_numerics="no")
    with pytest.raises(ValueError, match=r"fp8: expected a bool, got str 'no'"):
        save_pretrained(model, tmp_path, fp8="no")
    with pytest.raises(ValueError, match=r"model: expected a DeepseekV32ForCausalLM, got NoneType"):
        save_pretrained(None, tmp_path)
    with pytest.raises(ValueError, match=r"path: expected a directory to write the checkpoint into, got the file"):
        save_pretrained(model, tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"path: expected a directory path, got NoneType"):
        save_pretrained(model, None)
    with pytest.raises(ValueError, match=r"path: cannot create a checkpoint directory at"):
        save_pretrained(model, tmp_path / "config.json" / "sub")
    (tmp_path / "dir_cfg").mkdir()
    (tmp_path / "dir_cfg" / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"config.json: '.*' is not a regular file"):
        ModelConfig.from_hf(tmp_path / "dir_cfg")
    with pytest.raises(ValueError, match=r"path: a file path cannot hold a NUL character"):
        ModelConfig.from_hf("a\0b")
    # a weight fp16 cannot hold: finite in the file, inf in the model
    big = _ckpt(tmp_path / "big", lambda t: t[W].view(-1).__setitem__(-1, 1e6))
    with pytest.raises(ValueError, match=rf"non-finite: {W} \(in torch.float16\) \(0 NaN, 1 inf of "):
        load_pretrained(big, dtype=torch.float16)
    # a model with a NaN weight is not saved: load_pretrained would refuse what it wrote
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"save_pretrained: the model holds non-finite weights:\n  non-finite: "
                                         r"lm_head.weight \(1 NaN, 0 inf of "):
        save_pretrained(model, tmp_path / "nan")


def test_interrupted_save_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    import safetensors.torch as st

    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    save_pretrained(model, tmp_path, max_shard_bytes=100_000)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    calls = []
    real = st.save_file

    def dying(tensors, filename, *a, **k):
        calls.append(filename)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(st, "save_file", dying)
    other = tiny_model("tiny-glm-5.2", dtype=torch.float32, seed=1)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(other, tmp_path, max_shard_bytes=100_000)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before  # nothing replaced, no staging folder left
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# ---- reference ---------------------------------------------------------------------------------------

def _q_kv(n=2, H=3, d=24, S=5):
    return torch.randn(n, H, d), torch.randn(S, d)


REFERENCE_CASES = [
    (lambda: sparse_mla(torch.randn(2, 24), torch.randn(5, 24), torch.zeros(2, 4, dtype=torch.int32), 0.1, 16),
     r"q: expected shape \[\*, \*, \*\], got \[2, 24\]"),
    (lambda: sparse_mla(*_q_kv(), torch.zeros(2, 4, dtype=torch.int64), 0.1, 16),
     r"indices: expected dtype torch.int32, got torch.int64"),
    (lambda: sparse_mla(*_q_kv(), torch.zeros(3, 4, dtype=torch.int32), 0.1, 16),
     r"indices: expected shape \[2, \*\], got \[3, 4\]"),
    (lambda: sparse_mla(torch.randn(2, 3, 24), torch.randn(5, 25), torch.zeros(2, 4, dtype=torch.int32), 0.1, 16),
     r"kv: expected shape \[\*, 24\], got \[5, 25\]"),
    (lambda: sparse_mla(torch.randn(2, 3, 24), torch.randn(5, 24).double(), torch.zeros(2, 4, dtype=torch.int32), 0.1, 16),
     r"kv: expected dtype torch.float32, got torch.float64"),
    (lambda: sparse_mla(*_q_kv(), torch.zeros(2, 4, dtype=torch.int32), 0.1, 0), r"d_v: expected an int in 1..24, got 0"),
    (lambda: sparse_mla(*_q_kv(), torch.zeros(2, 4, dtype=torch.int32), 0.1, 16.0),
     r"d_v: expected an int in 1..24, got 16.0"),
    (lambda: sparse_mla(*_q_kv(), torch.zeros(2, 4, dtype=torch.int32), math.nan, 16),
     r"sm_scale: expected a finite number > 0, got nan"),
    (lambda: sparse_mla(*_q_kv(), torch.zeros(2, 4, dtype=torch.int32), -0.1, 16),
     r"sm_scale: expected a finite number > 0, got -0.1"),
    (lambda: sparse_mla(torch.randn(2, 3, 24).int(), torch.randn(5, 24).int(), torch.zeros(2, 4, dtype=torch.int32), 0.1, 16),
     r"q: expected dtype"),
    (lambda: dense_mla(*_q_kv(), torch.ones(2, 4, dtype=torch.bool), 0.1, 16), r"mask: expected shape \[2, 5\], got \[2, 4\]"),
    (lambda: dense_mla(*_q_kv(), torch.ones(2, 5), 0.1, 16), r"mask: expected dtype torch.bool, got torch.float32"),
    (lambda: indexer_scores(torch.randn(2, 4, 8), torch.randn(5, 9), torch.randn(2, 4), 0.3),
     r"k_idx: expected shape \[\*, 8\], got \[5, 9\]"),
    (lambda: indexer_scores(torch.randn(2, 4, 8), torch.randn(5, 8), torch.randn(2, 3), 0.3),
     r"weights: expected shape \[2, 4\], got \[2, 3\]"),
    (lambda: indexer_scores(torch.randn(2, 4, 8), torch.randn(5, 8), torch.randn(2, 4), 0.0),
     r"indexer_scores: softmax_scale: expected a finite number > 0, got 0.0"),
    (lambda: topk_indices(torch.randn(2, 5), torch.tensor([1, 7]), 3), r"query_positions: a query at position 7 needs more"),
    (lambda: topk_indices(torch.randn(2, 5), torch.tensor([1, -1]), 3), r"query_positions: expected positions >= 0, got -1"),
    (lambda: topk_indices(torch.randn(2, 5), torch.tensor([1.0, 2.0]), 3), r"query_positions: expected dtype"),
    (lambda: topk_indices(torch.randn(2, 5), torch.tensor([1, 2]), 0), r"topk: expected an int in \[1, 2\^31\) \(int32 columns\), got 0"),
    (lambda: topk_indices(torch.randn(2, 5), torch.tensor([1, 2]), 10 ** 12), r"topk: expected an int in \[1, 2\^31\)"),
    (lambda: topk_indices(torch.ones(2, 5, dtype=torch.int64), torch.tensor([1, 2]), 3), r"scores: expected dtype"),
    # the imaginary part would be dropped in the einsum
    (lambda: indexer_scores(torch.randn(2, 4, 8, dtype=torch.complex64), torch.randn(5, 8), torch.randn(2, 4), 0.3),
     r"q_idx: expected dtype .*, got torch.complex64"),
    (lambda: hadamard_transform(torch.full((3, 64), 60000.0, dtype=torch.float16)),
     r"hadamard_transform: x: 3 rows of finite values transform past torch.float16's range"),
    (lambda: apply_rope(torch.randn(3, 8), torch.randn(3, 3), torch.randn(3, 3), True),
     r"apply_rope: x has 8 rope dims but cos has 3 \(expected 4\)"),
    (lambda: rms_norm(torch.randn(3, 8), torch.ones(7), 1e-6), r"weight: expected shape \[8\], got \[7\]"),
    # eps: negative (NaN rows), zero in float32 (a zero row NaN), a string; x not a float tensor
    (lambda: rms_norm(torch.zeros(3, 8), torch.ones(8), -1.0), r"eps: expected a finite number > 0, got -1.0"),
    (lambda: rms_norm(torch.zeros(3, 8), torch.ones(8), 1e-50), r"eps: expected a value > 0 in float32 .*got 1e-50"),
    (lambda: rms_norm(torch.zeros(3, 8), torch.ones(8), "1e-6"), r"eps: expected a finite number > 0, got '1e-6'"),
    (lambda: rms_norm([[1.0] * 8], torch.ones(8), 1e-6), r"x: expected a torch.Tensor, got list"),
    (lambda: rms_norm(torch.zeros(3, 8, dtype=torch.int64), torch.ones(8), 1e-6), r"x: expected dtype"),
    (lambda: layer_norm(torch.zeros(3, 8), torch.ones(8), torch.zeros(8), 0.0), r"eps: expected a finite number > 0"),
    (lambda: RMSNorm(8, -5), r"RMSNorm.eps: expected a finite number > 0, got -5"),
    (lambda: LayerNorm(8, float("nan")), r"LayerNorm.eps: expected a finite number > 0, got nan"),
    (lambda: fp8_quantize(torch.randn(2, 100), block=64), r"fp8_quantize: last dim 100 is not a multiple of the block 64"),
    (lambda: fp8_quantize(torch.randn(2, 128), scale=torch.ones(3, 1)), r"fp8_quantize: scale: expected shape \[2, 1\]"),
    (lambda: fp8_quantize(torch.randn(2, 128), scale=torch.zeros(2, 1)),
     r"fp8_quantize: scale: expected finite values > 0, got \[0.0, 0.0\]"),
    (lambda: fp8_quantize(torch.randn(2, 128), scale=-torch.ones(2, 1)), r"fp8_quantize: scale: expected finite values > 0"),
    (lambda: fp8_quantize(torch.randn(2, 128), scale=torch.full((2, 1), float("inf"))),
     r"fp8_quantize: scale: expected finite values > 0, got \[inf, inf\]"),
    (lambda: fp8_quantize(torch.randn(2, 128), block=0), r"fp8_quantize: block: expected >= 1, got 0"),
    (lambda: fp8_quantize(torch.ones(2, 128, dtype=torch.int32)), r"x: expected dtype .*float32.*, got torch.int32"),
    # non-finite input: an inf would be rounded to a number, a NaN would set its block's scale
    (lambda: fp8_quantize(torch.tensor([[float("inf")] + [1.0] * 127])), r"fp8_quantize: x: expected finite values, got 1"),
    (lambda: fp8_quantize(torch.tensor([[float("nan")] + [1.0] * 127])), r"fp8_quantize: x: expected finite values, got 1"),
    # float64 past fp32's range: inf where the format computes (it was quantised to a number)
    (lambda: fp8_quantize(torch.full((1, 128), 1e300, dtype=torch.float64)),
     r"fp8_quantize: x: expected finite values, got 128 NaN or inf \(in float32\)"),
    (lambda: quantize_fp8_blocks(torch.full((4, 4), 1e300, dtype=torch.float64)), r"w: expected finite values"),
    (lambda: quantize_fp8_blocks(torch.full((4, 4), float("nan"))), r"w: expected finite values in float32's range, got non-finite: w \(16 NaN"),
    (lambda: quantize_fp8_blocks(torch.ones(4, 4), (0, 128)), r"block: expected two ints >= 1 .*got \(0, 128\)"),
    (lambda: quantize_fp8_blocks(torch.ones(4)), r"w: expected shape \[\*, \*\], got \[4\]"),
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4), torch.ones(1, 1)), r"q: expected dtype torch.float8_e4m3fn"),
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.ones(1, 1), (0, 0)),
     r"block: expected two ints >= 1"),
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.tensor([[float("nan")]])),
     r"weight_scale_inv: expected finite scales > 0 in fp32, got 1 others, e.g. \[nan\]"),
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4).to(torch.float8_e4m3fn), -torch.ones(1, 1)),
     r"weight_scale_inv: expected finite scales > 0"),
    # a float64 scale below fp32's range multiplies as 0 (its block zeroed), one above it as inf
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.full((1, 1), 1e-300, dtype=torch.float64)),
     r"weight_scale_inv: expected finite scales > 0 in fp32, got 1 others, e.g. \[1e-300\]"),
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.full((1, 1), 1e300, dtype=torch.float64)),
     r"weight_scale_inv: expected finite scales > 0 in fp32, got 1 others, e.g. \[1e\+300\]"),
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.int8)),
     r"weight_scale_inv: expected dtype"),
    (lambda: dequantize_fp8_blocks(torch.ones(4, 4).to(torch.float8_e4m3fn), [[1.0]]),
     r"weight_scale_inv: expected a torch.Tensor, got list"),
    (lambda: dequantize_fp8_blocks(torch.full((4, 4), 448.0).to(torch.float8_e4m3fn), torch.full((1, 1), 1e38)),
     r"dequantize_fp8_blocks: non-finite: q \* weight_scale_inv \(0 NaN, 16 inf of 16\)"),
    (lambda: dequantize_fp8_blocks(torch.full((4, 4), float("nan")).to(torch.float8_e4m3fn), torch.ones(1, 1)),
     r"dequantize_fp8_blocks: non-finite: q \* weight_scale_inv \(16 NaN, 0 inf of 16\)"),
    (lambda: ue8m0_scale(torch.tensor([1.0, float("nan")])), r"amax: expected finite values >= 0 \(in float32\), got \[nan\]"),
    (lambda: pow2_scale(torch.tensor([-2.0]), -13), r"amax: expected finite values >= 0 \(in float32\), got \[-2.0\]"),
    # float64 past fp32's range (where the scales are computed): refused, not a scale read off fp32's inf
    (lambda: ue8m0_scale(torch.tensor([1e300], dtype=torch.float64)), r"amax: expected finite .*\(in float32\), got \[1e\+300\]"),
    (lambda: latent_scale(torch.tensor([1e39], dtype=torch.float64)), r"amax: expected finite .*got \[1e\+39\]"),
    (lambda: fp8_dequantize(torch.full((1, 128), 448.0).to(torch.float8_e4m3fn), torch.full((1, 1), 1e38)),
     r"fp8_dequantize: 128 values times their scales are past float32's range \(first at \(0, 0\)\)"),
    # a float64 scale: its product was returned in float64 (4.48e302), past the fp32 the docstring promises
    (lambda: fp8_dequantize(torch.full((1, 128), 448.0).to(torch.float8_e4m3fn),
                            torch.full((1, 1), 1e300, dtype=torch.float64)),
     r"fp8_dequantize: 128 values times their scales are past float32's range"),
    (lambda: quantize_latent(torch.cat([torch.randn(1, 512), torch.full((1, 64), 3.4e38)], -1)),
     r"latent: k_pe \(stored in bfloat16\): expected finite values, got 64 NaN or inf"),
    (lambda: fp8_quantize(torch.randn(2, 128), scale=torch.ones(2, 1, dtype=torch.int64)),
     r"fp8_quantize: scale: expected dtype torch.float32 or torch.float64, got torch.int64"),
    (lambda: fp8_quantize(torch.randn(2, 128), scale=torch.ones(2, 1, dtype=torch.bool)),
     r"fp8_quantize: scale: expected dtype torch.float32 or torch.float64, got torch.bool"),
    (lambda: fp8_quantize(torch.randn(2, 128), scale=torch.ones(2, 1).to(torch.float8_e4m3fn)),
     r"fp8_quantize: scale: expected dtype torch.float32 or torch.float64, got torch.float8_e4m3fn"),
    (lambda: apply_rope(torch.randn(1, 4), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.bool), True),
     r"sin: expected dtype torch.float32, got torch.bool"),
    (lambda: apply_rope(torch.randn(1, 4), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.float64), True),
     r"sin: expected dtype torch.float32, got torch.float64"),
    (lambda: fp8_dequantize(torch.zeros(2, 128), torch.ones(2, 1)), r"fp8_dequantize: q: expected dtype torch.float8_e4m3fn, got torch.float32"),
    (lambda: fp8_dequantize(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.zeros(2, 1)),
     r"fp8_dequantize: scale: expected finite values > 0, got \[0.0, 0.0\]"),
    (lambda: fp8_dequantize(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.tensor([[1.0], [float("nan")]])),
     r"fp8_dequantize: scale: expected finite values > 0, got \[nan\]"),
    # integer or non-tensor inputs to the float helpers; a flag that is not a bool
    (lambda: apply_rope(torch.tensor([[0, 1, 2, 3]]), torch.ones(1, 2), torch.zeros(1, 2), True),
     r"x: expected dtype .*, got torch.int64"),
    (lambda: apply_rope(torch.randn(1, 4), torch.ones(1, 2, dtype=torch.int64), torch.zeros(1, 2), True),
     r"cos: expected dtype .*, got torch.int64"),
    (lambda: apply_rope(torch.randn(1, 4), torch.ones(1, 2), torch.zeros(1, 2), "no"),
     r"apply_rope: interleaved: expected a bool, got str 'no'"),
    (lambda: apply_rope(torch.randn(4), torch.ones(4, 2), torch.zeros(4, 2), True), r"apply_rope: x: expected \[T, ..., d\]"),
    (lambda: hadamard_transform(torch.tensor([[3, 1]])), r"x: expected dtype .*, got torch.int64"),
    (lambda: hadamard_transform([1.0, 2.0]), r"x: expected a torch.Tensor, got list"),
    (lambda: hadamard_transform(torch.tensor(2.0)), r"x: expected shape \[\.\.\., \*\], got \[\]"),
    (lambda: fp8_dequantize(torch.zeros(2, 64), torch.ones(2, 1), 64, name="rows: c_kv"),
     r"rows: c_kv: q: expected dtype torch.float8_e4m3fn, got torch.float32"),
    (lambda: fp8_dequantize(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.ones(3)),
     r"fp8_dequantize: scale: expected shape \[2, 1\], got \[3\]"),
    (lambda: apply_rope(torch.randn(2, 8), torch.randn(3, 4), torch.randn(3, 4), True), r"cos: expected shape \[2, 4\]"),
    (lambda: RotaryEmbedding("glm-5.2"), r"RotaryEmbedding: config: expected a ModelConfig, got str"),
    (lambda: rope_inv_freq(None), r"rope_inv_freq: config: expected a ModelConfig, got NoneType"),
    (lambda: init_dummy_weights(None), r"init_dummy_weights: model: expected a torch.nn.Module, got NoneType"),
    (lambda: RotaryEmbedding(ModelConfig.preset("tiny-glm-5.2"))(torch.tensor([0]), dtype="float32"),
     r"RotaryEmbedding: dtype: expected a float torch.dtype, got 'float32'"),
    (lambda: RotaryEmbedding(ModelConfig.preset("tiny-glm-5.2"))(torch.tensor([0.5])), r"positions: expected dtype"),
    (lambda: RotaryEmbedding(ModelConfig.preset("tiny-glm-5.2"))(torch.tensor([3, -1])),
     r"positions: expected positions >= 0, got -1"),
    (lambda: ModelConfig.preset("tiny-glm-5.2").replace(hidden=64), r"ModelConfig.replace: unknown fields \['hidden'\]"),
    (lambda: apply_rope(torch.randn(3, 8), torch.tensor(1.0), torch.tensor(1.0), True), r"cos: expected shape \[3, 4\]"),
    (lambda: apply_rope(torch.randn(3, 8), torch.ones(3, 4, device="meta"), torch.ones(3, 4), True),
     r"cos: expected device cpu, got meta"),
    (lambda: RotaryEmbedding(TINY)(torch.tensor([0]), torch.float8_e4m3fn),
     r"RotaryEmbedding: dtype: expected a float dtype of 16 bits or more, got torch.float8_e4m3fn"),
    (lambda: RotaryEmbedding(TINY)(torch.tensor([0, TINY.max_position_embeddings])),
     r"positions: expected positions < max_position_embeddings"),
    # a scale float32 cannot hold, where the scores are computed in it: all NaN, or uniform attention
    (lambda: sparse_mla(*_q_kv(), torch.zeros(2, 4, dtype=torch.int32), 1e39, 16),
     r"sm_scale: expected a value within float32's range .*got 1e\+39"),
    (lambda: sparse_mla(*_q_kv(), torch.zeros(2, 4, dtype=torch.int32), 1e-50, 16),
     r"sm_scale: expected a value within float32's range .*got 1e-50"),
    (lambda: dense_mla(*_q_kv(), torch.ones(2, 5, dtype=torch.bool), 1e39, 16), r"sm_scale: expected a value within"),
    (lambda: indexer_scores(torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(2, 3), 1e39),
     r"indexer_scores: softmax_scale: expected a value within float32's range"),
    (lambda: rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6), r"x: expected shape \[\.\.\., \*\], got \[\]"),
    (lambda: layer_norm(torch.tensor(1.0), torch.ones(1), torch.ones(1), 1e-6), r"x: expected shape \[\.\.\., \*\]"),
    (lambda: rms_norm(torch.ones(3), torch.ones(3, dtype=torch.complex64), 1e-6),
     r"weight: expected dtype .*got torch.complex64"),
    (lambda: layer_norm(torch.ones(3), torch.ones(3), torch.ones(3, dtype=torch.int32), 1e-6),
     r"bias: expected dtype .*got torch.int32"),
    # a minimum exponent that is not an int in fp32's normal range gave scales that are not powers of two, or 0, inf
    (lambda: pow2_scale(torch.ones(2), 2.5), r"pow2_scale: min_exp: expected an int, got float 2.5"),
    (lambda: pow2_scale(torch.ones(2), True), r"pow2_scale: min_exp: expected an int, got bool True"),
    (lambda: pow2_scale(torch.ones(2), 200), r"pow2_scale: min_exp: expected an int in \[-126, 127\], got 200"),
    (lambda: pow2_scale(torch.ones(2), -200), r"pow2_scale: min_exp: expected an int in \[-126, 127\], got -200"),
    # the dense H_n of 2^16 took 32 GiB and minutes
    (lambda: hadamard_transform(torch.ones(1, 2 ** 13)),
     r"hadamard_transform: size must be a power of two <= 4096 \(the dense H_n\), got 8192"),
]


@pytest.mark.parametrize("call,match", REFERENCE_CASES, ids=[f"ref{i}" for i in range(len(REFERENCE_CASES))])
def test_reference(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _edited(**fields):
    """AttentionMetadata for one request of 3 tokens in block 0 of 4-token blocks, with fields replaced."""
    meta = AttentionMetadata.build([0], [3], [[0]], 4)
    tensors = {k: torch.tensor(v) if isinstance(getattr(meta, k), torch.Tensor) else v for k, v in fields.items()}
    return dataclasses.replace(meta, **tensors)


def test_reference_model_inputs():
    model = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32)
    V = model.config.vocab_size
    cases = [
        ((torch.tensor([1.0, 2.0]),), r"input_ids: expected dtype"),
        ((torch.tensor([[1, 2]]),), r"input_ids: expected shape \[\*\], got \[1, 2\]"),
        ((torch.tensor([], dtype=torch.long),), r"input_ids: expected at least one token"),
        ((torch.tensor([1, V]),), rf"input_ids: token ids must lie in \[0, {V}\), got \[1, {V}\]"),
        ((torch.tensor([-1, 2]),), r"input_ids: token ids must lie in"),
        ((torch.tensor([1, 2]), model.new_cache(4, 4)), r"kv_cache and attn_metadata: pass both or neither"),
        ((torch.tensor([1, 2]), model.new_cache(4, 4), AttentionMetadata.build([0], [3], [[0]], 4)),
         r"input_ids: attn_metadata describes 3 tokens, got 2"),
        ((torch.tensor([1, 2]), model.new_cache(4, 8), AttentionMetadata.build([0], [2], [[0]], 4)),
         r"kv_cache: block_size 8, but attn_metadata was built for blocks of 4"),
        ((torch.tensor([1, 2]), model.new_cache(4, 4), AttentionMetadata.build([0], [2], [[9]], 4)),
         r"attn_metadata.block_table: block ids must lie in \[0, 4\) \(kv_cache.num_blocks\), got 9"),
        # another model's cache, a cache or metadata of the wrong kind: named, not an AttributeError inside
        ((torch.tensor([1, 2]), tiny_model("tiny-glm-5.2", dtype=torch.float32).new_cache(4, 4),
          AttentionMetadata.build([0], [2], [[0]], 4)),
         r"kv_cache: built for a model whose layers, rows or indexer layers differ"),
        ((torch.tensor([1, 2]), {}, AttentionMetadata.build([0], [2], [[0]], 4)),
         r"kv_cache: expected a PagedKVCache, got dict"),
        ((torch.tensor([1, 2]), model.new_cache(4, 4), {"positions": None}),
         r"attn_metadata: expected an AttentionMetadata, got dict"),
        # metadata edited after it was built: positions reversed or repeated, slots outside the request's blocks
        # (each ran and attended over the wrong rows)
        ((torch.tensor([1, 2, 3]), model.new_cache(4, 4), _edited(positions=[2, 1, 0])),
         r"attn_metadata: positions\[0\] is 2, StepPlan.build makes 0 of its seq_lens"),
        ((torch.tensor([1, 2, 3]), model.new_cache(4, 4), _edited(positions=[0, 0, 0])),
         r"attn_metadata: positions\[1\] is 0, StepPlan.build makes 1"),
        ((torch.tensor([1, 2, 3]), model.new_cache(4, 4), _edited(slot_mapping=[4, 5, 6])),
         r"attn_metadata: slot_mapping\[0\] is 4, StepPlan.build makes 0"),
        ((torch.tensor([1, 2, 3]), model.new_cache(4, 4), _edited(seq_lens_cpu=[4])),
         r"attn_metadata: seq_lens and seq_lens_cpu differ"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            model(*args)
    with pytest.raises(ValueError, match=r"form: expected 'absorbed' or 'naive', got 'mha'"):
        model.set_form("mha")


# ---- cache and metadata ------------------------------------------------------------------------------

def _moved(kv_cache: PagedKVCache, device: str) -> PagedKVCache:
    """A cache whose latent tensors were moved after it was built (the constructor takes cpu and cuda only)."""
    kv_cache.latent = [t.to(device) for t in kv_cache.latent]
    return kv_cache


CACHE_CASES = [
    (lambda: AttentionMetadata.build([0], [1], [[0]], 4, device="nope"), r"AttentionMetadata: device: expected a device"),
    (lambda: PagedKVCache(ModelConfig.preset("tiny-glm-5.2"), 2, 4, device="cuda:7"),
     r"PagedKVCache: device: cuda:7 is not available here"),
    (lambda: PagedKVCache(ModelConfig.preset("tiny-glm-5.2"), 2, 4, device="meta"),
     r"PagedKVCache: device: expected a cpu or cuda device, got meta"),
    (lambda: AttentionMetadata.build([0], [1], [[0]], 4, device="meta"),
     r"AttentionMetadata: device: expected a cpu or cuda device, got meta"),
    (lambda: write_latent(torch.zeros(2, 4, 656, dtype=torch.uint8), torch.tensor([0]), torch.randn(576)),
     r"latent: expected shape \[\*, 576\], got \[576\]"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([[0]]), torch.zeros(1, 8)), r"slot_mapping: expected shape \[\*\]"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([0.0]), torch.zeros(1, 8)), r"slot_mapping: expected dtype"),
    (lambda: write_tokens(torch.zeros(8, 8), torch.tensor([0]), torch.zeros(1, 8)), r"cache: expected shape \[\*, \*, \*\]"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), [0], torch.zeros(1, 8)), r"slot_mapping: expected a torch.Tensor, got list"),
    (lambda: BlockAllocator(4, 2).release("x"), r"BlockAllocator.release: seq_id: expected an int, got str 'x'"),
    (lambda: BlockAllocator(10 ** 12, 4), r"BlockAllocator: num_blocks: at most 2147483647 \(block ids are int32\)"),
    (lambda: PagedKVCache(ModelConfig.preset("tiny-glm-5.2"), 10 ** 12, 64),
     r"PagedKVCache: num_blocks: at most 2147483647"),
    (lambda: AttentionMetadata.build([0], [8], [[3, 3]], 4),
     r"block_tables\[0\]: blocks \[3\] appear more than once \(their tokens would overwrite each other\)"),
    (lambda: AttentionMetadata.build([0], [1], [[0]], 4, num_blocks=2.5), r"num_blocks must be None or an int >= 1, got 2.5"),
    (lambda: AttentionMetadata.build([0], [1], [[0]], 4, num_blocks=True), r"num_blocks must be None or an int >= 1, got True"),
    (lambda: AttentionMetadata.build([0], [1], [[0]], 4, num_blocks=0), r"num_blocks must be None or an int >= 1, got 0"),
    (lambda: AttentionMetadata.build(5, [1], [[0]], 4), r"AttentionMetadata.build: context_lens must be a list, got int"),
    (lambda: AttentionMetadata.build([0], [1], [0], 4), r"block_tables must be a list of lists of block ids"),
    # a block whose slots pass int32
    (lambda: AttentionMetadata.build([0], [1], [[3]], 2 ** 30, num_blocks=4),
     r"block_tables\[0\]: block 3 of 1073741824 tokens needs 4294967296 slots, a cache holds at most 2147483647"),
    (lambda: AttentionMetadata.build([0], [1], [[1]], 2 ** 30, num_blocks=2),  # the last slot would be 2^31 - 1
     r"block 1 of 1073741824 tokens needs 2147483648 slots"),
    (lambda: check_cache_fits(PagedKVCache(TINY, 2, 4), None, "cpu"), r"check_cache_fits: config: expected a ModelConfig"),
    (lambda: check_cache_fits(PagedKVCache(TINY, 2, 4), TINY, "gpu"), r"check_cache_fits: device: expected a device"),
    (lambda: check_cache_fits(_moved(PagedKVCache(TINY, 2, 4), "meta"), TINY, "cpu"),
     r"kv_cache: expected it on cpu, got meta"),
    (lambda: check_cache_fits(PagedKVCache(TINY.replace(num_hidden_layers=TINY.num_hidden_layers + 1,
                                                        indexer_types=None), 2, 4), TINY, "cpu"),
     r"kv_cache: built for a model whose layers, .*cache vs model: num_hidden_layers"),
    (lambda: AttentionMetadata.build([0], [2], [[0.0]], 4), r"block_tables\[0\]: block ids must be ints in \[0, 2147483647\), got 0.0"),
    (lambda: AttentionMetadata.build([0], [2], [[1.5]], 4), r"block_tables\[0\]: block ids must be ints in \[0, 2147483647\), got 1.5"),
    (lambda: AttentionMetadata.build([0], [2], [[-1]], 4), r"block_tables\[0\]: block ids must be ints in \[0, 2147483647\), got -1"),
    (lambda: AttentionMetadata.build([0], [2], [[5]], 4, num_blocks=4),
     r"block_tables\[0\]: block ids must be ints \[0, 4\), got 5"),
    (lambda: AttentionMetadata.build([0, 0], [2, 2], [[3], [3]], 4),
     r"block_tables\[1\]: block 3 also belongs to request 0 of this step"),
    (lambda: AttentionMetadata.build([0], [2], [[0]], 0), r"block_size must be an int >= 1, got 0"),
    (lambda: AttentionMetadata.build([0], [2], [[0]], 2.5), r"block_size must be an int >= 1, got 2.5"),
    (lambda: AttentionMetadata.build([-1], [2], [[0]], 4), r"request 0: context_len -1 must be >= 0"),
    (lambda: AttentionMetadata.build([0.5], [2], [[0]], 4), r"context_lens\[0\] must be an int, got float 0.5"),
    (lambda: AttentionMetadata.build([0], [2.0], [[0]], 4), r"query_lens\[0\] must be an int, got float 2.0"),
    (lambda: AttentionMetadata.build([], [], [], 4), r"must have one equal, non-zero length"),
    (lambda: AttentionMetadata.build([6], [3], [[0, 1]], 4), r"block_tables\[0\] has 2 blocks of 4 for 9 tokens"),
    (lambda: PagedKVCache(TINY, 0, 4), r"PagedKVCache: num_blocks: expected >= 1, got 0"),
    (lambda: PagedKVCache(TINY, 4, 4.0), r"PagedKVCache: block_size: expected an int, got float 4.0"),
    (lambda: PagedKVCache(TINY, 4, 4, dtype=torch.int8), r"PagedKVCache: dtype: expected one of .*got torch.int8"),
    (lambda: PagedKVCache("glm-5.2", 4, 4), r"PagedKVCache: config: expected a ModelConfig, got str"),
    (lambda: PagedKVCache(TINY, 4, 2 ** 30), r"PagedKVCache: num_blocks x block_size: at most 2\^31 - 1 slots"),
    (lambda: PagedKVCache(TINY, 4, 4, fp8_parts=(["latent"],)),
     r"PagedKVCache: fp8_parts: expected a non-empty tuple of \('latent', 'indexer'\), got \(\['latent'\],\)"),
    (lambda: BlockAllocator(0, 4), r"BlockAllocator: num_blocks: expected >= 1, got 0"),
    (lambda: BlockAllocator(4, True), r"BlockAllocator: block_size: expected an int, got bool True"),
    (lambda: BlockAllocator(4, 4).ensure(0, -1), r"BlockAllocator: num_tokens: expected >= 0, got -1"),
    (lambda: BlockAllocator(4, 4).ensure("a", 2), r"BlockAllocator: seq_id: expected an int, got str 'a'"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([8]), torch.zeros(1, 8)),
     r"slot_mapping: slots must lie in \[0, 8\), got \[8, 8\]"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([1]), torch.zeros(1, 9)), r"rows: expected shape \[1, 8\]"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([3, 1, 3]), torch.zeros(3, 8)),
     r"slot_mapping: each slot at most once, got slots \[3\] 2 times"),
    (lambda: gather_tokens(torch.zeros(2, 4, 8), torch.tensor([0, 5]), 6),
     r"block_table_row: a sequence of 6 tokens reads blocks outside \[0, 2\)"),
    # rows the cache cannot hold: complex (the imaginary part dropped), ints, finite values past its range (inf)
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([0]), torch.full((1, 8), 1 + 5j)), r"rows: expected dtype"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([0]), torch.ones(1, 8, dtype=torch.int64)),
     r"rows: expected dtype"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([0]), torch.full((1, 8), 1e300, dtype=torch.float64)),
     r"rows: 8 finite values past torch.float32's range \(the cache's\)"),
    (lambda: gather_tokens(torch.zeros(8, 8), torch.tensor([0, 1]), 4), r"cache: expected shape \[\*, \*, \*\]"),
    (lambda: gather_tokens(torch.zeros(2, 4, 8), [0, 1], 4), r"block_table_row: expected a torch.Tensor, got list"),
    (lambda: token_bytes(TINY, torch.int8), r"token_bytes: dtype: expected one of .*, got torch.int8"),
    (lambda: token_bytes(TINY, torch.bfloat16, "fp9"), r"token_bytes: kv_cache_dtype: expected one of .*, got 'fp9'"),
    (lambda: token_bytes(TINY, torch.bfloat16, "fp8"), r"token_bytes: kv_cache_dtype: 'fp8' stores FlashMLA's rows"),
    (lambda: indexer_key_bytes(-4), r"indexer_key_bytes: head_dim: expected >= 1, got -4"),
    (lambda: indexer_key_bytes("128"), r"indexer_key_bytes: head_dim: expected an int, got str '128'"),
    (lambda: BlockAllocator(4, 4).ensure(3, 2 ** 80), r"BlockAllocator: num_tokens: .* more blocks of 4 than"),
    (lambda: AttentionMetadata.build([0], [3], [[2 ** 31]], 8), r"block_tables\[0\]: block ids must be ints in "
                                                                r"\[0, 2147483647\), got 2147483648"),
    (lambda: AttentionMetadata.build([2 ** 63], [1], [[0, 1]], 2 ** 63),
     r"request 0: context_len \+ query_len must be at most 2147483647"),
    # a hand-made plan is held to what StepPlan.build makes of its lengths and tables
    (lambda: AttentionMetadata.from_plan(dataclasses.replace(StepPlan.build([2, 0], [1, 3], [[0], [1]], 4),
                                                             slot_mapping=[99, 4, 5, 6])),
     r"plan: slot_mapping\[0\] is 99, StepPlan.build makes 2 of its seq_lens, query_start_loc and block tables"),
    (lambda: AttentionMetadata.from_plan(dataclasses.replace(StepPlan.build([2, 0], [1, 3], [[0], [1]], 4),
                                                             query_start_loc=[0, 1])),
     r"plan: its seq_lens, query_start_loc and block tables describe no step \(list index out of range\)"),
    (lambda: AttentionMetadata.from_plan({"positions": [0]}), r"plan: expected a StepPlan, got dict"),
    # the FP8 oracle's entry points check what they are given before reading it
    (lambda: sparse_mla_fp8([1], torch.zeros(1, 4, 1, 656, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int32), 0.1),
     r"q: expected a torch.Tensor, got list"),
    (lambda: sparse_mla_fp8(torch.ones(1, 2, 576, dtype=torch.int64), torch.zeros(1, 4, 1, 656, dtype=torch.uint8),
                            torch.zeros(1, 2, dtype=torch.int32), 0.1), r"q: expected dtype"),
    (lambda: sparse_mla_fp8(torch.ones(1, 2, 576).to(torch.float8_e4m3fn), torch.zeros(1, 4, 1, 656, dtype=torch.uint8),
                            torch.zeros(1, 2, dtype=torch.int32), 0.1), r"q: expected dtype"),
    (lambda: indexer_scores_fp8([1], torch.ones(1, 2), torch.zeros(1, 64, 1, 132, dtype=torch.uint8),
                                torch.tensor([0]), 3, 0.1), r"q_idx: expected a torch.Tensor, got list"),
    (lambda: indexer_scores_fp8(torch.ones(1, 2, 128), torch.ones(1, 2, dtype=torch.int64),
                                torch.zeros(1, 64, 1, 132, dtype=torch.uint8), torch.tensor([0]), 3, 0.1),
     r"weights: expected dtype"),
    (lambda: indexer_scores_fp8(torch.ones(1, 2, 128), torch.ones(1, 2), torch.zeros(1, 64, 1, 132, dtype=torch.uint8),
                                [0, 1], 3, 0.1), r"block_table_row: expected a torch.Tensor, got list"),
    # another device than the data's (meta stands in for a second device on a CPU machine)
    (lambda: fp8_quantize(torch.randn(2, 128), scale=torch.ones(2, 1, device="meta")),
     r"fp8_quantize: scale: expected device cpu, got meta"),
    (lambda: write_tokens(torch.zeros(2, 4, 8), torch.tensor([0]), torch.zeros(1, 8, device="meta")),
     r"rows: expected device cpu, got meta"),
    (lambda: write_latent(torch.zeros(2, 4, 656, dtype=torch.uint8), torch.tensor([0], device="meta"),
                          torch.randn(1, 576)), r"slot_mapping: expected device cpu, got meta"),
    (lambda: fp8_dequantize(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1, device="meta")),
     r"fp8_dequantize: scale: expected device cpu, got meta"),
    (lambda: dequantize_fp8_blocks(torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, device="meta")),
     r"weight_scale_inv: expected device cpu, got meta"),
    # on the meta device alone: no values to check (checking them would fail inside torch, at .item())
    (lambda: fp8_quantize(torch.randn(2, 128, device="meta")), r"x: a tensor on the meta device holds no values"),
    (lambda: quantize_latent(torch.randn(2, 576, device="meta")), r"a tensor on the meta device holds no values"),
    # an expanded view claims 2^40 slots (an arange over them would take 8 TB)
    (lambda: gather_tokens(torch.zeros(1, 1, 8).expand(1, 2 ** 40, 8), torch.zeros(1, dtype=torch.int32), 2 ** 40),
     r"cache: at most 2\^31 - 1 slots \(int32 slot ids\), got 1 x 1099511627776"),
]


@pytest.mark.parametrize("call,match", CACHE_CASES, ids=[f"cache{i}" for i in range(len(CACHE_CASES))])
def test_cache_and_metadata(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# Sizes within every other bound that could not be allocated on a machine of 16 GiB (what these cases pretend this
# one holds, so that a machine of any size refuses them and none tries): refused before torch or Python tries.
MEMORY_CASES = [
    # a top-k wider than the keys is padded with -1; here its output alone would take 32 TiB
    (lambda: topk_indices(torch.randn(2 ** 12, 5), torch.zeros(2 ** 12, dtype=torch.long), 2 ** 31 - 1),
     r"topk_indices: its work tensors and the int32 output \[n, topk\]: needs 32768.0 GiB, more than cpu holds in "
     r"all \(16.0 GiB\)"),
    (lambda: PagedKVCache(ModelConfig.preset("deepseek-v3.2"), 2 ** 16, 2 ** 14),
     r"PagedKVCache: needs 85888.0 GiB, more than cpu holds in all"),
    # host lists of a step or a block table
    (lambda: AttentionMetadata.build([0], [2 ** 30], [[0]], 2 ** 31 - 1),
     r"AttentionMetadata.build: the step's host lists \(positions, slots, requests\): needs 120.0 GiB, more than"),
    (lambda: BlockAllocator(2 ** 31 - 1, 1).ensure(0, 2 ** 31 - 1),
     r"BlockAllocator: sequence 0's list of 2147483647 more blocks: needs 80.0 GiB, more than cpu holds"),
    # the engine's dummy model at full size, and its largest tensor drawn in fp32 beside it
    (lambda: build_model(ModelConfig.preset("deepseek-v3.2"), "narrow", "cpu", torch.bfloat16, 0),
     r"build_model: deepseek-v3.2 in torch.bfloat16: needs 1293.7 GiB, more than cpu holds in all \(16.0 GiB\)"),
]


@pytest.mark.parametrize("call,match", MEMORY_CASES, ids=[f"memory{i}" for i in range(len(MEMORY_CASES))])
def test_what_cannot_fit_is_refused_before_it_is_allocated(call, match, monkeypatch):
    monkeypatch.setattr(checks, "device_memory_bytes", lambda device: 16 * 2 ** 30)
    with pytest.raises(ValueError, match=match):
        call()


# ---- kernels: host-side facts (interpreter) ----------------------------------------------------------

def _mla_args(T=2, H=4, B=1):
    q, cache = torch.zeros(T, H, 40), torch.zeros(3, 4, 40)
    bt, req, sl = torch.zeros(B, 3, dtype=torch.int32), torch.zeros(T, dtype=torch.int32), torch.ones(B, dtype=torch.int32)
    topk, out = torch.zeros(T, 8, dtype=torch.int32), torch.zeros(T, H, 32)
    return dict(q=q, latent_cache=cache, block_table=bt, req_indices=req, seq_lens=sl, topk_indices=topk,
                sm_scale=0.1, out=out)


def _mla(**over):
    a = _mla_args()
    a.update(over)
    return lambda: sparse_mla_paged(**a)


def _strided(t, dim=0):
    """The same values with a gap after every element of `dim` (a view a careless caller might pass)."""
    shape = list(t.shape)
    shape[dim] *= 2
    big = torch.zeros(shape, dtype=t.dtype)
    idx = [slice(None)] * t.dim()
    idx[dim] = slice(0, None, 2)
    v = big[tuple(idx)]
    v.copy_(t)
    return v


def _nr_args(T=2):
    return dict(q_c=torch.zeros(T, 48), q_a_norm_weight=torch.ones(48), q_c_out=torch.zeros(T, 48),
                kv=torch.zeros(T, 40), kv_a_norm_weight=torch.ones(32), latent_cache=torch.zeros(3, 4, 40),
                positions=torch.zeros(T, dtype=torch.long), slot_mapping=torch.zeros(T, dtype=torch.long),
                cos=torch.zeros(8, 4), sin=torch.zeros(8, 4), rms_eps=1e-6)


def _nr(**over):
    a = _nr_args()
    a.update(over)
    return lambda: fused_norm_rope(**a)


@CPU
def test_caches_of_any_strides_and_the_largest_allocator():
    """write_tokens and gather_tokens take a cache view of any strides (a transposed or strided view raised a
    RuntimeError from view()), with the result of the contiguous copy; an allocator of the most blocks block ids
    allow is made at once (it listed every id: about 70 GB) and hands out low ids first."""
    pool = torch.zeros(4, 2, 8)  # [BS, NB, D] in memory: the cache [NB, BS, D] is its transposed view
    cache, packed = pool.transpose(0, 1), torch.zeros(2, 4, 8)
    slots, rows = torch.tensor([5, 0, 2]), torch.randn(3, 8)
    for c in (cache, packed):
        write_tokens(c, slots, rows)
    assert torch.equal(cache, packed)
    table = torch.tensor([1, 0])
    assert torch.equal(gather_tokens(cache, table, 7), gather_tokens(packed, table, 7))
    alloc = BlockAllocator(2 ** 31 - 1, 16)
    assert alloc.ensure(0, 40) == [0, 1, 2] and len(alloc.free) == 2 ** 31 - 4
    alloc.release(0)
    assert alloc.ensure(1, 17) == [0, 1] and len(alloc.free) == 2 ** 31 - 3


def test_fused_norm_rope_debug_mode_refuses_a_slot_twice():
    """Two tokens for one cache slot race on a GPU (which row lands is unspecified); the graph-safe launcher cannot
    see it without a sync, its debug mode names it. Padding (-1) may repeat."""
    from dsv32ref.checks import checking_device_values
    with checking_device_values():
        _nr(slot_mapping=torch.tensor([-1, -1]))()
        with pytest.raises(ValueError, match=r"slot_mapping: each slot at most once, got slots \[5\] 2 times"):
            _nr(slot_mapping=torch.tensor([5, 5]))()


def _fq_args(T=2):
    return dict(q_lat=torch.zeros(T, 4, 32), q=torch.zeros(T, 4, 24), q_mqa=torch.zeros(T, 4, 40),
                positions=torch.zeros(T, dtype=torch.long), cos=torch.zeros(8, 4), sin=torch.zeros(8, 4),
                q_idx=torch.zeros(T, 2, 16), q_idx_out=torch.zeros(T, 2, 16), weights=torch.zeros(T, 2),
                weights_out=torch.zeros(T, 2))


def _fq(**over):
    a = _fq_args()
    a.update(over)
    return lambda: fused_q(**a)


def _idx_args(T=2):
    return dict(q_idx=torch.zeros(T, 4, 16), weights=torch.zeros(T, 4), index_cache=torch.zeros(3, 4, 16),
                block_table=torch.zeros(1, 3, dtype=torch.int32), req_indices=torch.zeros(T, dtype=torch.int32),
                positions=torch.zeros(T, dtype=torch.long), softmax_scale=0.25, scores=torch.zeros(T, 12))


def _topk(**over):
    return lambda: topk_from_scores(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long),
                                    torch.zeros(2, 4, dtype=torch.int32), **over)


def _idx(**over):
    a = _idx_args()
    a.update(over)
    return lambda: indexer_scores_paged(**a)


KERNEL_CASES = [
    (_mla(config={"BLOCK_H": 3}), r"sparse_mla_paged: config BLOCK_H must be a power of two in \[1, 128\], got 3"),
    (_mla(config={"BLOCK_N": 0}), r"sparse_mla_paged: config BLOCK_N must be a power of two in \[1, 256\], got 0"),
    (_mla(config={"BLOCK_H": "16"}), r"sparse_mla_paged: config BLOCK_H must be a power of two in \[1, 128\], got '16'"),
    (_mla(config={"num_warps": 3}), r"sparse_mla_paged: config num_warps must be a power of two in \[1, 16\], got 3"),
    (_mla(config={"num_stages": 0}), r"sparse_mla_paged: config num_stages must be an int in \[1, 8\], got 0"),
    (_mla(q=torch.zeros(2, 0, 40), out=torch.zeros(2, 0, 32)), r"q: expected at least one head \(dim 1\), got shape \[2, 0, 40\]"),
    (_nr(q_c=torch.zeros(2, 0), q_c_out=torch.zeros(2, 0), q_a_norm_weight=torch.ones(0)),
     r"q_c: expected q_lora_rank \(dim 1\) >= 1, got shape \[2, 0\]"),
    # a flag that is not a bool; a cache whose blocks hold no token
    (_mla(valid_first="no"), r"sparse_mla_paged: valid_first: expected a bool, got str 'no'"),
    (_fq(indexer_interleaved=2), r"fused_q: indexer_interleaved: expected a bool, got int 2"),
    (_nr(indexer_interleaved="yes"), r"fused_norm_rope: indexer_interleaved: expected a bool, got str 'yes'"),
    (_mla(latent_cache=torch.zeros(3, 0, 40)), r"latent_cache: expected a block size \(dim 1\) >= 1, got shape \[3, 0, 40\]"),
    (_nr(latent_cache=torch.zeros(3, 0, 40)), r"latent_cache: expected a block size \(dim 1\) >= 1, got shape \[3, 0, 40\]"),
    (_idx(index_cache=torch.zeros(3, 0, 16)), r"index_cache: expected a block size \(dim 1\) >= 1, got shape \[3, 0, 16\]"),
    (_mla(config={"NUM_SPLIT": 2}), r"sparse_mla_paged: config: unknown key\(s\) \['NUM_SPLIT'\]"),
    (_mla(config={"BLOCK_h": 16}), r"unknown key\(s\) \['BLOCK_h'\]"),
    (_mla(q=torch.zeros(2, 4, 80)[..., ::2]), r"q: the last dim must be dense"),
    (_mla(seq_lens=_strided(torch.ones(1, dtype=torch.int32).expand(2).clone())[:1]), None),  # size-1: any stride
    (_mla(seq_lens=_strided(torch.ones(2, dtype=torch.int32)), block_table=torch.zeros(2, 3, dtype=torch.int32)),
     r"seq_lens: the last dim must be dense \(stride 1 at dim 0\), got strides \(2,\)"),
    (_mla(req_indices=_strided(torch.zeros(2, dtype=torch.int32))), r"req_indices: the last dim must be dense"),
    (_mla(block_table=torch.zeros(1, 6, dtype=torch.int32)[:, ::2]), r"block_table: the last dim must be dense"),
    (_mla(topk_indices=torch.zeros(2, 16, dtype=torch.int32)[:, ::2]), r"topk_indices: the last dim must be dense"),
    (_mla(out=torch.zeros(2, 4, 64)[..., ::2]), r"out: the last dim must be dense"),
    (_mla(lse=torch.zeros(2, 8)[:, ::2]), r"lse: the last dim must be dense"),
    (_mla(lse=torch.zeros(2, 4, dtype=torch.float16)), r"lse: expected dtype torch.float32, got torch.float16"),
    (_mla(lse=torch.zeros(2, 3)), r"lse: expected shape \[2, 4\], got \[2, 3\]"),
    (_mla(sm_scale=math.nan), r"sparse_mla_paged: sm_scale: expected a finite number > 0, got nan"),
    (_mla(sm_scale=0), r"sparse_mla_paged: sm_scale: expected a finite number > 0, got 0"),
    (_mla(num_sms=0), r"sparse_mla_paged: num_sms must be None or an int >= 1, got 0"),
    (_mla(out=torch.zeros(2, 4, 32, dtype=torch.float16)), r"out: expected dtype torch.float32, got torch.float16"),
    (_mla(seq_lens=torch.ones(1, dtype=torch.int64)), r"seq_lens: expected dtype torch.int32, got torch.int64"),
    (_mla(block_table=torch.zeros(2, 3, dtype=torch.int32)), r"block_table: expected shape \[1, \*\], got \[2, 3\]"),
    (_mla(req_indices=torch.zeros(3, dtype=torch.int32)), r"req_indices: expected shape \[2\], got \[3\]"),
    (_nr(sin=torch.zeros(4, 8).T), r"sin: the last dim must be dense"),
    (_nr(sin=torch.zeros(8, 8)[:, :4], cos=torch.zeros(8, 4)),
     r"fused_norm_rope: sin must have cos's strides \(4, 1\), got \(8, 1\)"),
    (_nr(positions=_strided(torch.zeros(2, dtype=torch.long))), r"positions: the last dim must be dense"),
    (_nr(slot_mapping=_strided(torch.zeros(2, dtype=torch.long))), r"slot_mapping: the last dim must be dense"),
    (_nr(q_a_norm_weight=_strided(torch.ones(48))), r"q_a_norm_weight: the last dim must be dense"),
    (_nr(kv_a_norm_weight=torch.ones(32, dtype=torch.int32)), r"kv_a_norm_weight: expected dtype"),
    (_nr(rms_eps=0.0), r"fused_norm_rope: rms_eps: expected a finite number > 0, got 0.0"),
    (_nr(cos=torch.zeros(0, 4), sin=torch.zeros(0, 4)), r"fused_norm_rope: cos/sin must hold at least one position"),
    (_nr(cos=torch.zeros(8, 20), sin=torch.zeros(8, 20)), r"kv.shape\[1\] \(40\) must exceed qk_rope_head_dim"),
    (_nr(index_cache=torch.zeros(3, 4, 16)), r"fused_norm_rope: \['index_cache'\] given without index_k"),
    (_nr(slot_mapping=torch.zeros(2)), r"slot_mapping: expected dtype torch.int64 or torch.int32, got torch.float32"),
    (_fq(q=torch.zeros(2, 4, 6)), r"fused_q: q.shape\[-1\] \(6\) must hold qk_nope_head_dim >= 0"),
    (_fq(weights=torch.zeros(2, 4)[:, ::2]), r"weights: the last dim must be dense"),
    (_fq(weights_out=torch.zeros(2, 2, dtype=torch.float64)), r"weights_out: expected dtype torch.float32"),
    (_fq(q_idx_out=torch.zeros(2, 2, 16, dtype=torch.float16)), r"q_idx_out: expected dtype torch.float32 or"),
    (_fq(q_idx=None), r"fused_q: \['q_idx_out', 'weights', 'weights_out'\] given without q_idx"),
    (_fq(sin=torch.zeros(8, 8)[:, :4]), r"fused_q: sin must have cos's strides"),
    (_fq(positions=torch.zeros(2, 1, dtype=torch.long)), r"positions: expected shape \[2\], got \[2, 1\]"),
    (_fq(q_idx=torch.zeros(2, 2, 4), q_idx_out=torch.zeros(2, 2, 4)), r"fused_q: index_head_dim \(4\) must be >= qk_rope"),
    (_idx(softmax_scale=-1.0), r"indexer_scores_paged: softmax_scale: expected a finite number > 0, got -1.0"),
    (_idx(scores=torch.zeros(2, 24)[:, ::2]), r"scores: the last dim must be dense"),
    (_idx(index_cache=torch.zeros(3, 4, 16, dtype=torch.float64)), r"index_cache: expected dtype torch.float32"),
    (_idx(weights=torch.zeros(2, 4, dtype=torch.float16)), r"weights: expected dtype torch.float32"),
    (_idx(q_idx=torch.zeros(2, 3, 16), weights=torch.zeros(2, 3)), r"indexer_topk: index_n_heads must be a power of two"),
    (_idx(block_table=torch.zeros(1, 3, dtype=torch.int64)), r"block_table: expected dtype torch.int32"),
    (_idx(tiles=3), r"indexer_scores_paged: tiles must be a power of two, got 3"),
    (_idx(tiles=0), r"indexer_scores_paged: tiles must be a power of two, got 0"),
    (_idx(block_s=48), r"indexer_scores_paged: block_s must be a power of two, got 48"),
    (_idx(block_s=2 ** 20), r"indexer_scores_paged: block_s must be at most 1024 and num_warps at most 16"),
    (_idx(num_stages=0), r"indexer_scores_paged: num_stages must be None or an int >= 1, got 0"),
    (_idx(num_sms=0), r"indexer_scores_paged: num_sms must be None or an int >= 1, got 0"),
    (_idx(tokens=3), r"indexer_scores_paged: tokens must be a power of two, got 3"),
    (_idx(num_warps=6), r"indexer_scores_paged: num_warps must be a power of two, got 6"),
    (_idx(tokens=128), r"indexer_scores_paged: tokens x index_n_heads must be at most 256 MMA columns, got 128 x 4"),
    (_topk(pdl="on"), r"topk_from_scores: pdl must be None, True or False, got 'on'"),
    (_topk(pdl=True), r"topk_from_scores: pdl=True needs a CUDA device of compute capability >= 9.0"),
    (_topk(split_above=-1), r"topk_from_scores: split_above must be an int >= 0, got -1"),
    (_topk(block=3), r"topk_from_scores: block must be a power of two, got 3"),
    (_topk(chunk=6), r"topk_from_scores: chunk must be a power of two, got 6"),
    (_topk(chunk=32768), r"topk_from_scores: chunk must be at most 16384, got 32768"),
    # tiles past what an SM holds; a config that is not a dict, or has keys of other types; scales that overflow or
    # vanish in float32, where the kernels compute (1e308 gave NaN outputs, an eps of 1e-50 NaN rows)
    (_topk(block=32768), r"topk_from_scores: block must be at most 16384, got 32768"),
    (_topk(num_warps=32), r"topk_from_scores: num_warps must be at most 16, got 32"),
    (_mla(config={"BLOCK_N": 512}), r"sparse_mla_paged: config BLOCK_N must be a power of two in \[1, 256\], got 512"),
    (_mla(config={"num_stages": 9}), r"sparse_mla_paged: config num_stages must be an int in \[1, 8\], got 9"),
    (_mla(config={1: 2, "a": 3}), r"sparse_mla_paged: config: unknown key\(s\) \['a', 1\]"),
    (_mla(config=[]), r"sparse_mla_paged: config: expected None or a dict, got list \[\]"),
    (_mla(config="BLOCK_N"), r"sparse_mla_paged: config: expected None or a dict, got str 'BLOCK_N'"),
    (_mla(sm_scale=1e308), r"sparse_mla_paged: sm_scale: expected a value whose product with 1.4427 lies within "
                           r"float32's range \[1.4e-45, 3.403e\+38\] \(the kernel computes in it\), got 1e\+308"),
    (_mla(sm_scale=1e-50), r"sparse_mla_paged: sm_scale: expected a value whose product .* got 1e-50"),
    (_idx(softmax_scale=1e308), r"indexer_scores_paged: softmax_scale: expected a value within float32's range"),
    (_nr(rms_eps=1e-50), r"fused_norm_rope: rms_eps: expected a value > 0 in float32 and finite there"),
    (lambda: add_rms_norm(torch.zeros(2, 64), None, torch.ones(64), 1e-50, torch.empty(2, 64), torch.empty(2, 64)),
     r"add_rms_norm: eps: expected a value > 0 in float32 and finite there \(the norms compute in it\), got 1e-50"),
    (lambda: skinny_gemm_counters("gpu"), r"skinny_gemm_counters: device: expected a device such as 'cpu'"),
    (lambda: skinny_gemm_counters(3), r"skinny_gemm_counters: device: expected a device such as 'cpu' .*got 3"),
    (lambda: skinny_gemm_counters("cpu", 1 << 40), r"skinny_gemm_counters: n"),
    (lambda: checks.check_scale("sm_scale", 2 ** 1024), r"sm_scale: expected a finite number > 0, got \d{24}\.\.\. "
                                                 r"\(309 characters\)"),
    (lambda: topk_from_scores(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.long),
                              torch.zeros(2, 4, dtype=torch.int32)), r"scores: expected dtype torch.float32"),
]


@CPU
@pytest.mark.parametrize("call,match", KERNEL_CASES, ids=[f"kernel{i}" for i in range(len(KERNEL_CASES))])
def test_kernel_launchers(call, match):
    if match is None:  # a legal input that looks odd: runs
        call()
        return
    with pytest.raises(ValueError, match=match):
        call()


# ---- kernels: values on the device (a subprocess, since a bad access could crash it) ------------------

_DEVICE_VALUES = textwrap.dedent('''
    import json, os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from dsv32ref.checks import checking_device_values
    from dsv32ref.kernels import fused_norm_rope, fused_q, indexer_scores_paged, sparse_mla_paged, topk_from_scores
    res = {}

    def run(name, fn, check):
        try:
            res[name] = {"ok": bool(check(fn()))}
        except Exception as e:
            res[name] = {"ok": False, "error": repr(e)[:200]}
        try:
            with checking_device_values():
                fn()
            res[name]["debug"] = "no error"
        except ValueError as e:
            res[name]["debug"] = str(e)

    torch.manual_seed(0)
    q, cache = torch.randn(2, 4, 40), torch.randn(3, 4, 40)
    topk = torch.tensor([[0, 1, 2, -1], [0, 5, 9, 11]], dtype=torch.int32)

    def mla(bt, req, sl):
        out, lse = torch.full((2, 4, 32), float("nan")), torch.full((2, 4), float("nan"))
        sparse_mla_paged(q, cache, bt, req, sl, topk, 0.1, out, lse)
        return out, lse

    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    ok = lambda r: torch.isfinite(r[0]).all() and not torch.isnan(r[1]).any()
    empty = lambda r: (r[0] == 0).all() and torch.isposinf(r[1]).all()
    run("mla req >= B", lambda: mla(bt, torch.tensor([0, 7], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)),
        lambda r: ok(r) and empty((r[0][1], r[1][1])))
    run("mla req < 0", lambda: mla(bt, torch.tensor([-3, 0], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)),
        lambda r: ok(r) and empty((r[0][0], r[1][0])))
    run("mla seq_len past the block table", lambda: mla(bt, torch.zeros(2, dtype=torch.int32),
        torch.tensor([1000], dtype=torch.int32)), ok)
    run("mla negative seq_len", lambda: mla(bt, torch.zeros(2, dtype=torch.int32), torch.tensor([-5], dtype=torch.int32)),
        empty)
    run("mla block id >= num_blocks", lambda: mla(torch.tensor([[2, 99, 1]], dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32), torch.tensor([12], dtype=torch.int32)), ok)
    run("mla negative block id", lambda: mla(torch.tensor([[-4, 0, 1]], dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32), torch.tensor([12], dtype=torch.int32)), ok)

    def norm_rope(pos, slot):
        latent = torch.full((3, 4, 40), 7.0)
        fused_norm_rope(torch.randn(2, 48), torch.ones(48), torch.zeros(2, 48), torch.randn(2, 40), torch.ones(32),
                        latent, pos, slot, torch.randn(8, 4), torch.randn(8, 4), 1e-6)
        return latent

    run("norm_rope slot >= NB*BS", lambda: norm_rope(torch.tensor([0, 1]), torch.tensor([3, 12])),
        lambda lat: (lat.view(12, 40)[3] != 7).any() and (lat.view(12, 40)[[0, 1, 2] + list(range(4, 12))] == 7).all())
    run("norm_rope position past cos", lambda: norm_rope(torch.tensor([0, 8]), torch.tensor([3, 5])),
        lambda lat: (lat.view(12, 40)[3] != 7).any() and (lat.view(12, 40)[5] == 7).all())
    run("norm_rope negative position", lambda: norm_rope(torch.tensor([-1, 0]), torch.tensor([3, 5])),
        lambda lat: (lat.view(12, 40)[3] == 7).all() and (lat.view(12, 40)[5] != 7).any())

    def fq(pos):
        out = torch.full((2, 4, 40), float("nan"))
        fused_q(torch.randn(2, 4, 32), torch.randn(2, 4, 24), out, pos, torch.randn(8, 4), torch.randn(8, 4))
        return out

    run("fused_q position past cos", lambda: fq(torch.tensor([1, 50])), lambda o: torch.isfinite(o).all())

    def idx(bt, req, pos, width=12, block_s=64):
        scores = torch.full((2, width), -7.0)
        indexer_scores_paged(torch.randn(2, 4, 16), torch.randn(2, 4), torch.randn(3, 4, 16), bt, req, pos, 0.25,
                             scores, block_s=block_s)
        return scores

    bt_i = torch.tensor([[1, 0, 2]], dtype=torch.int32)
    run("indexer position >= scores width", lambda: idx(bt_i, torch.zeros(2, dtype=torch.int32),
        torch.tensor([3, 40])), lambda s: torch.isfinite(s).all() and (s[0, 4:] == -7).all())
    run("indexer req >= B", lambda: idx(bt_i, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3, 5])),
        lambda s: (s[1] == -7).all() and (s[0, :4] != -7).all())
    # the keys of block 50 (positions 4..7) are left unscored, the others scored; a tile across blocks (a block
    # id per key) and a tile inside one block (its id loaded before the loop)
    bad_block = lambda s: ((s[1, 4:8] == -7).all() and (s[1, :4] != -7).all() and (s[1, 8:10] != -7).all()
                           and (s[0, :4] != -7).all() and (s[0, 4:] == -7).all() and (s[1, 10:] == -7).all())
    for name, bs in (("indexer block id >= num_blocks", 64), ("indexer block id >= num_blocks, tile in a block", 4)):
        run(name, lambda bs=bs: idx(torch.tensor([[1, 50, 2]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                    torch.tensor([3, 9]), block_s=bs), bad_block)

    def tk(pos):
        out = torch.full((2, 4), -7, dtype=torch.int32)
        topk_from_scores(torch.randn(2, 8), pos, out, block=4)
        return out

    run("topk position >= scores width", lambda: tk(torch.tensor([2, 100])),
        lambda o: (o[1] >= 0).all() and (o[1] < 8).all() and o[0].tolist()[3] == -1)
    print("RESULT " + json.dumps(res))
''')

DEVICE_VALUE_DEBUG = {
    "mla req >= B": r"req_indices: values must lie in \[0, 1\)",
    "mla req < 0": r"req_indices: values must lie in \[0, 1\)",
    "mla seq_len past the block table": r"seq_lens: values must lie in \[0, 13\)",
    "mla negative seq_len": r"seq_lens: values must lie in",
    "mla block id >= num_blocks": r"block_table\[0\] \(its first 3 blocks\): values must lie in \[0, 3\)",
    "mla negative block id": r"block_table\[0\] \(its first 3 blocks\): values must lie in \[0, 3\)",
    "norm_rope slot >= NB*BS": r"slot_mapping: values must lie in \[-1, 12\)",
    "norm_rope position past cos": r"positions: values must lie in \[0, 8\) \(cos.shape\[0\]\)",
    "norm_rope negative position": r"positions: values must lie in \[0, 8\)",
    "fused_q position past cos": r"positions: values must lie in \[0, 8\) \(cos.shape\[0\]\)",
    "indexer position >= scores width": r"positions: values must lie in \[0, 12\)",
    "indexer req >= B": r"req_indices: values must lie in \[0, 1\)",
    "indexer block id >= num_blocks": r"block_table\[0\] \(the blocks of token 1\): values must lie in \[0, 3\)",
    "indexer block id >= num_blocks, tile in a block":
        r"block_table\[0\] \(the blocks of token 1\): values must lie in \[0, 3\)",
    "topk position >= scores width": r"positions: values must lie in \[0, 8\) \(scores.shape\[1\]\)",
}


@CPU
def test_the_debug_mode_refuses_outputs_that_overlap():
    """Outputs that overlap an input, each other or themselves (an expanded view): the debug mode names them (off,
    the eager-path launchers trust the caller: the check costs host time on every call). add_rms_norm checks
    always (it runs inside graphs, where the check costs nothing at replay)."""
    from dsv32ref.checks import checking_device_values

    q, cache = torch.randn(2, 4, 40), torch.randn(3, 4, 40)
    topk = torch.tensor([[0, 1, 2, -1], [0, 5, 9, 11]], dtype=torch.int32)
    meta = (torch.tensor([[2, 0, 1]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            torch.tensor([12], dtype=torch.int32), topk, 0.1)
    out, scores = torch.empty(2, 4, 32), torch.randn(2, 8)
    with checking_device_values():
        with pytest.raises(ValueError, match="sparse_mla_paged: out overlaps lse in memory"):
            sparse_mla_paged(q, cache, *meta, out, out.view(-1)[:8].view(2, 4))
        with pytest.raises(ValueError, match="sparse_mla_paged: out overlaps latent_cache in memory"):
            sparse_mla_paged(q, cache, *meta, cache.view(-1)[:256].view(2, 4, 32))
        with pytest.raises(ValueError, match="topk_from_scores: out has elements that share memory"):
            topk_from_scores(scores, torch.tensor([7, 7]), torch.zeros(1, 4, dtype=torch.int32).expand(2, 4))
        with pytest.raises(ValueError, match="topk_from_scores: out overlaps scores in memory"):
            topk_from_scores(scores, torch.tensor([7, 7]), scores.view(torch.int32)[:, :4])
    from dsv32ref.checks import check_disjoint
    check_disjoint("empty", {"out": torch.empty(0).as_strided((5, 0), (0, 1))}, {})  # no elements: none shared
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="add_rms_norm: out has elements that share memory"):
        add_rms_norm(x, None, torch.ones(64), 1e-6, torch.zeros(1, 64).expand(4, 64), torch.empty(4, 64))


@CPU
def test_a_model_or_step_buffers_past_the_machine_are_refused_before_they_are_allocated():
    """The reference model's constructor and the engine's step buffers (sized by EngineConfig) are weighed against
    the device first: a ValueError naming them, not the allocator's error (or, on a host that overcommits, a machine
    filled as the zeros are written)."""
    big = ModelConfig.preset("tiny-deepseek-v3.2").replace(n_shared_experts=2 ** 40)
    with pytest.raises(ValueError, match=r"DeepseekV32ForCausalLM: tiny-deepseek-v3.2 in torch.float32: needs "
                                         r"[\d.]+ GiB, more than cpu holds in all"):
        DeepseekV32ForCausalLM(big)
    with torch.device("meta"):  # no memory there: built
        DeepseekV32ForCausalLM(big)
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    ec = EngineConfig(mode=CUDAGraphMode.NONE, max_model_len=4096, max_num_seqs=2 ** 26, max_num_batched_tokens=2 ** 26,
                      block_size=64, capture_sizes=[1], num_blocks=64)
    with pytest.raises(ValueError, match=r"InputBatch: the step's buffers \(EngineConfig's max_num_batched_tokens, "
                                         r"max_num_seqs and max_model_len size them\): needs [\d.]+ GiB"):
        LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))


@CPU
def test_kernels_never_access_out_of_bounds_and_the_debug_mode_names_the_value():
    """Out-of-range values on the device: the kernels mask them (documented results, no crash, nothing
    outside the tensors touched), and checking_device_values() turns each into a ValueError that names it."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", _DEVICE_VALUES], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert set(res) == set(DEVICE_VALUE_DEBUG)
    import re

    for name, match in DEVICE_VALUE_DEBUG.items():
        assert res[name]["ok"], (name, res[name])
        assert re.search(match, res[name]["debug"]), (name, res[name]["debug"])


# ---- engine ------------------------------------------------------------------------------------------

ENGINE_CONFIG_CASES = [
    (dict(boundary="medium"), r"boundary: expected one of \('wide', .*got 'medium'"),
    (dict(mode="full"), r"EngineConfig.mode: expected a CUDAGraphMode .*, got str 'full'"),
    (dict(max_model_len=0), r"EngineConfig.max_model_len: expected an int in \[1, 2147483647\], got 0"),
    (dict(max_num_seqs=0), r"EngineConfig.max_num_seqs: expected an int in \[1, 2147483647\], got 0"),
    (dict(max_num_batched_tokens=0), r"EngineConfig.max_num_batched_tokens: expected an int in \[1, 2147483647\]"),
    (dict(max_num_batched_tokens=-8), r"EngineConfig.max_num_batched_tokens: expected an int in .*, got -8"),
    (dict(max_num_batched_tokens=8.0), r"EngineConfig.max_num_batched_tokens: expected an int, got float 8.0"),
    (dict(block_size=0), r"EngineConfig.block_size: expected an int in \[1, 65536\], got 0"),
    (dict(block_size=2 ** 40), r"EngineConfig.block_size: expected an int in \[1, 65536\], got 1099511627776"),
    (dict(max_num_seqs=10 ** 12), r"EngineConfig.max_num_seqs: expected an int in \[1, 2147483647\]"),
    (dict(block_size="16"), r"EngineConfig.block_size: expected an int, got str '16'"),
    (dict(capture_sizes=[-1, 8]), r"EngineConfig.capture_sizes: every size must be an int >= 1, got -1"),
    (dict(capture_sizes=[0]), r"EngineConfig.capture_sizes: every size must be an int >= 1, got 0"),
    (dict(capture_sizes=[1.5]), r"EngineConfig.capture_sizes: every size must be an int >= 1, got 1.5"),
    (dict(capture_sizes="8"), r"EngineConfig.capture_sizes: expected a list of ints, got '8'"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization: expected \(0, 1\], got 0"),
    (dict(gpu_memory_utilization="0.9"), r"gpu_memory_utilization: expected \(0, 1\], got '0.9'"),
    (dict(num_blocks=0), r"EngineConfig.num_blocks: expected >= 1, got 0"),
    (dict(num_blocks=7, max_model_len=512, block_size=64),
     r"EngineConfig.num_blocks: 7 blocks of 64 tokens cannot hold one sequence of max_model_len 512 \(8 blocks\)"),
    (dict(seed=-1), r"EngineConfig.seed: expected an int in \[0, 9223372036854775807\], got -1"),
    (dict(num_sms=0), r"EngineConfig.num_sms: expected >= 1, got 0"),
    (dict(boundary=["narrow"]), r"boundary: expected one of .*, got \['narrow'\]"),
]


@pytest.mark.parametrize("kw,match", ENGINE_CONFIG_CASES, ids=[next(iter(k)) for k, _ in ENGINE_CONFIG_CASES])
def test_engine_config(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_an_engine_config_cannot_change_under_its_checks():
    """Frozen: a field set after the checks (block_size 0 divided by zero deep in the engine) is refused; a
    changed copy (dataclasses.replace) is checked again."""
    import dataclasses
    ec = EngineConfig(max_model_len=64, block_size=16, capture_sizes=[4, 1, 4])
    assert ec.capture_sizes == (1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ec.block_size = 0
    with pytest.raises(ValueError, match=r"EngineConfig.block_size: expected an int in \[1, 65536\], got 0"):
        dataclasses.replace(ec, block_size=0)


WEIGHTS_CASES = [  # the engine's weight plumbing, given what it cannot build from
    (lambda: build_model(TINY, "narrow", "cpu", None, 0), r"build_model: dtype: expected one of torch.bfloat16, .*got None"),
    (lambda: build_model(TINY, "narrow", "cpu", torch.int32, 0), r"build_model: dtype: .*got torch.int32"),
    (lambda: build_model(TINY, "narrow", "cpu", "bf16", 0), r"build_model: dtype: .*got 'bf16'"),
    (lambda: build_model(TINY, "narrow", "gpu0", torch.float32, 0), r"build_model: device: expected a device"),
    (lambda: build_model(TINY, "narrow", "cpu", torch.float32, 1.5), r"build_model: seed: expected an int, got float"),
    (lambda: build_model(TINY, "narrow", "cpu", torch.float32, -1),
     r"build_model: seed: expected an int in \[0, 9223372036854775807\], got -1"),
    (lambda: build_model(TINY, "narrow", "meta", torch.float32, 0), r"build_model: device: expected a cpu or cuda device"),
    (lambda: build_model(None, "narrow", "cpu", torch.float32, 0), r"EngineModel: config: expected a ModelConfig"),
    (lambda: EngineModel(TINY, "narrow", tp=4), r"EngineModel: tp: expected a TensorParallel \(rank, size\), got int"),
    (lambda: from_reference(None), r"from_reference: ref: expected a DeepseekV32ForCausalLM, got NoneType"),
    (lambda: from_reference(TINY), r"from_reference: ref: expected a DeepseekV32ForCausalLM, got ModelConfig"),
    (lambda: share_weights(3, "narrow"), r"share_weights: model: expected an EngineModel, got int"),
]


@pytest.mark.parametrize("call,match", WEIGHTS_CASES, ids=[f"weights{i}" for i in range(len(WEIGHTS_CASES))])
def test_engine_weights(call, match):
    with pytest.raises(ValueError, match=match):
        call()


STEP_CASES = [
    ([], r"StepInput.requests: expected a non-empty list"),
    ([(0, [1, 2], 0), (0, [3], 0)], r"StepInput.requests\[1\].seq_id: sequence 0 appears twice in one step"),
    ([(0, [1, 2], -1)], r"StepInput.requests\[0\].context_len: expected >= 0, got -1"),
    ([(0, [1.0, 2.0], 0)], r"StepInput.requests\[0\].token_ids: token ids must be ints, got float 1.0"),
    ([(0, [], 0)], r"StepInput.requests\[0\].token_ids: expected a non-empty list of ints"),
    ([(0, [1])], r"StepInput.requests\[0\]: expected \(seq_id, token_ids, context_len\)"),
    ([(-1, [1], 0)], r"StepInput.requests\[0\].seq_id: expected >= 0, got -1"),
    ([(0, [True], 0)], r"token ids must be ints, got bool True"),
]


@pytest.mark.parametrize("requests,match", STEP_CASES, ids=[f"step{i}" for i in range(len(STEP_CASES))])
def test_step_input(requests, match):
    with pytest.raises(ValueError, match=match):
        StepInput(requests)


def _cpu_engine() -> LLMEngine:
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    ec = EngineConfig(boundary="narrow", mode=CUDAGraphMode.NONE, max_model_len=16, max_num_seqs=2,
                      max_num_batched_tokens=16, block_size=4, capture_sizes=[1, 2, 4])
    return LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))


@pytest.fixture(scope="module")
def cpu_engine():
    return _cpu_engine()


def test_engine_rejects_a_placement_it_cannot_run():
    """A device name torch does not know (or one the engine cannot run on, or CUDA where there is none), a dtype
    given as a string, a config or engine config of another type, a model or weights built for another config or
    of another class, a context past the model's positions, a seed that is not an int: ValueErrors naming the
    argument (they were a RuntimeError, an AssertionError, an engine that ran with the model's numbers and the
    config's sizes, and accepted)."""
    cfg = tiny_model("tiny-glm-5.2").config
    ec = EngineConfig(boundary="narrow", mode=CUDAGraphMode.NONE, max_model_len=16, max_num_seqs=2,
                      max_num_batched_tokens=16, block_size=4, capture_sizes=[1, 2, 4])
    with pytest.raises(ValueError, match="LLMEngine: device: expected a device such as 'cpu' .* got 'gpu'"):
        LLMEngine(cfg, ec, device="gpu")
    with pytest.raises(ValueError, match="LLMEngine: device: expected a cpu or cuda device, got meta"):
        LLMEngine(cfg, ec, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="LLMEngine: device: cuda is not available here"):
            LLMEngine(cfg, ec)
    for bad, match in ((None, "config: expected a ModelConfig"), ("tiny-glm-5.2", "config: expected a ModelConfig")):
        with pytest.raises(ValueError, match=match):
            LLMEngine(bad, ec, device="cpu")
    with pytest.raises(ValueError, match="engine_config: expected None or an EngineConfig, got dict"):
        LLMEngine(cfg, {"boundary": "narrow"}, device="cpu")
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"model was built for another ModelConfig .*\['rope_theta'\]"):
        LLMEngine(cfg.replace(rope_theta=1e6), ec, device="cpu", dtype=torch.float32, model=from_reference(ref))
    with pytest.raises(ValueError, match="weights: expected an EngineModel .* got "):
        LLMEngine(cfg, ec, device="cpu", dtype=torch.float32, weights=ref)
    model = from_reference(ref)
    LLMEngine(cfg.replace(name="renamed"), ec, device="cpu", dtype=torch.float32, model=model)  # names may differ
    with pytest.raises(ValueError, match="kv_cache: expected a PagedKVCache, got dict"):
        LLMEngine(cfg, ec, device="cpu", dtype=torch.float32, model=model, kv_cache={})
    for other in (cfg.replace(index_head_dim=2 * cfg.index_head_dim),
                  cfg.replace(indexer_types=("full",) * cfg.num_hidden_layers)):
        cache = PagedKVCache(other, 8, ec.block_size, torch.float32)
        with pytest.raises(ValueError, match="kv_cache: built for a model whose layers, rows or indexer layers differ"):
            LLMEngine(cfg, ec, device="cpu", dtype=torch.float32, model=model, kv_cache=cache)
    with pytest.raises(ValueError, match="LLMEngine: dtype: expected one of torch.bfloat16, .* got 'bf16'"):
        LLMEngine(cfg, ec, device="cpu", dtype="bf16")
    # a shared cache too small for one sequence, a model of another dtype: refused before a step fails inside
    with pytest.raises(ValueError, match=r"kv_cache: 1 blocks of 4 tokens cannot hold one sequence of max_model_len "
                                         r"16 \(4 blocks\)"):
        LLMEngine(cfg, ec, device="cpu", dtype=torch.float32, model=model,
                  kv_cache=PagedKVCache(cfg, 1, ec.block_size, torch.float32))
    with pytest.raises(ValueError, match=r"model: its weights are torch.float32 on cpu, the engine runs "
                                         r"torch.bfloat16 on cpu"):
        LLMEngine(cfg, ec, device="cpu", dtype=torch.bfloat16, model=model)
    long = EngineConfig(boundary="narrow", mode=CUDAGraphMode.NONE, max_model_len=8192, max_num_seqs=2,
                        max_num_batched_tokens=16, block_size=4, capture_sizes=[1, 2, 4])
    with pytest.raises(ValueError, match=r"max_model_len: 8192 exceeds the model's max_position_embeddings \(4096\)"):
        LLMEngine(cfg, long, device="cpu", dtype=torch.float32)
    for seed in (0.5, "0", True, -1, 2 ** 63):  # (-1 drew seed 2^63 - 1's weights, 2^63 seed 0's)
        with pytest.raises(ValueError, match="init_dummy_weights: seed: expected an int"):
            init_dummy_weights(tiny_model("tiny-glm-5.2"), seed)
    with pytest.raises(ValueError, match=r"EngineConfig.seed: expected an int in \[0, 9223372036854775807\]"):
        EngineConfig(seed=2 ** 63)
    with pytest.raises(ValueError, match=r"build_model: seed: expected an int in \[0, 9223372036854775807\]"):
        build_model(TINY, "narrow", "cpu", torch.float32, 2 ** 63)


@CPU
def test_engine_holds_steps_to_the_token_budget_and_prompts_whole():
    """A capture size past max_num_batched_tokens pads decode steps, it does not raise the budget (a step of 24
    tokens ran at a budget of 16, and the refusal named the capture size); a prompt's bad token is refused before
    any chunk of it runs (five chunks were prefilled first, and the message named a StepInput the caller never
    built)."""
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    ec = EngineConfig(boundary="narrow", mode=CUDAGraphMode.NONE, max_model_len=64, max_num_seqs=2,
                      max_num_batched_tokens=8, block_size=4, capture_sizes=[1, 2, 4, 32])
    eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))
    with pytest.raises(ValueError, match=r"step of 12 tokens exceeds max_num_batched_tokens=8"):
        eng.step(StepInput([(0, list(range(1, 13)), 0)]))
    steps = []
    eng.execute = lambda prep: steps.append(prep) or pytest.fail("a chunk ran")
    with pytest.raises(ValueError, match=r"prompt\[40\]: expected a token id, .*got 1000000"):
        eng.generate(list(range(1, 41)) + [10 ** 6], 1)
    assert steps == [] and not eng.allocator.tables


@CPU
def test_engine_rejects_requests_it_cannot_run(cpu_engine):
    eng = cpu_engine
    V = eng.config.vocab_size
    cases = [
        (lambda: eng.generate(list(range(1, 18)), 1), r"prompt: 17 tokens \+ 0 decoded ones exceed max_model_len=16"),
        (lambda: eng.generate([1, 2, 3], 15), r"prompt: 3 tokens \+ 14 decoded ones exceed max_model_len=16"),
        (lambda: eng.generate([], 1), r"prompt: expected a non-empty list of token ids"),
        (lambda: eng.generate([1, V], 1), rf"prompt\[1\]: expected a token id, an int in \[0, {V}\) \(vocab_size\), "
                                          rf"got {V}"),
        (lambda: eng.generate([1, -2], 1), r"prompt\[1\]: expected a token id, .*got -2"),
        (lambda: eng.generate([1, 2.0], 1), r"prompt\[1\]: expected a token id, .*got 2.0"),
        (lambda: eng.generate([1, 2], 0), r"max_new_tokens: expected an int >= 1, got 0"),
        (lambda: eng.generate([1, 2], "1"), r"max_new_tokens: expected an int >= 1, got '1'"),
        (lambda: eng.step(StepInput([(0, [1], 0), (1, [2], 0), (2, [3], 0)])),
         r"StepInput.requests: 3 requests in one step, max_num_seqs is 2"),
        (lambda: eng.step(StepInput([(0, [1] * 17, 0)])), r"step of 17 tokens exceeds max_num_batched_tokens=16"),
        (lambda: eng.step(StepInput([(0, [1] * 4, 14)])), r"sequence 0 would hold 18 tokens \(context 14 \+ 4 new\)"),
        # a context the cache does not hold: rows no step wrote would be read as context, or written ones skipped
        (lambda: eng.step(StepInput([(5, [1], 3)])), r"requests\[0\]: sequence 5 holds 0 cached tokens, got "
                                                     r"context_len 3"),
        (lambda: eng.step(StepInput([(6, [4], 3), (7, [4], 2)])), r"requests\[1\]: sequence 7 holds 0 .*context_len 2"),
        (lambda: eng.step(StepInput([(6, [4], 4)])), r"sequence 6 holds 3 cached tokens, got context_len 4"),
    ]
    eng.step(StepInput([(6, [1, 2, 3], 0)]))
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    eng.step(StepInput([(6, [4], 3)]))  # nothing was staged by the refused steps: sequence 6 goes on from 3
    eng.allocator.release(6)
    toks, _ = eng.generate([1, 2, 3], 2)  # still usable afterwards, and no block leaked
    assert len(toks) == 2 and len(eng.allocator.free) == eng.runner.kv_cache.num_blocks


@CPU
def test_a_step_refused_for_blocks_changes_nothing():
    """A step whose requests do not all fit the free blocks is refused before any block moves: no sequence holds
    blocks or tokens afterwards, so a later step cannot attend over rows the refused one never wrote."""
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    ec = EngineConfig(boundary="narrow", mode=CUDAGraphMode.NONE, max_model_len=16, max_num_seqs=2,
                      max_num_batched_tokens=17, block_size=4, capture_sizes=[1, 2, 4], num_blocks=4)
    eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))
    with pytest.raises(ValueError, match=r"StepInput.requests: the step needs 5 more cache blocks of 4 tokens, 4 "
                                         r"are free"):
        eng.step(StepInput([(0, list(range(1, 17)), 0), (1, [1], 0)]))
    assert eng.allocator.held == {} and eng.allocator.tables == {} and len(eng.allocator.free) == 4
    with pytest.raises(ValueError, match=r"sequence 0 holds 0 cached tokens, got context_len 15"):
        eng.step(StepInput([(0, [5], 15)]))
    for call in (lambda: eng.step([(0, [1], 0)]), lambda: eng.step(None)):
        with pytest.raises(ValueError, match=r"step: expected a StepInput, got (list|NoneType)"):
            call()
    toks, _ = eng.step(StepInput([(0, list(range(1, 17)), 0)]))  # the same prompt alone fits
    assert len(toks) == 1 and eng.allocator.held == {0: 16}


@CPU
def test_a_step_whose_forward_raises_leaves_no_tokens_held(monkeypatch):
    """A step that fails after staging (its forward raises, or a caller of stage() gives it up with unstage()):
    its sequences hold what they held before, blocks included, so the next step's context is checked against
    rows that were written (the allocator had said 3 tokens held, and a decode then attended over unwritten rows).
    A step that ran, or a stage() that was refused, leaves nothing for unstage() to undo; nor does a sequence
    released in between."""
    eng = _cpu_engine()
    eng.step(StepInput([(0, [1, 2, 3], 0)]))
    before = ({**eng.allocator.held}, {k: list(v) for k, v in eng.allocator.tables.items()}, len(eng.allocator.free))

    def broken(prep):
        raise RuntimeError("a kernel failed")
    monkeypatch.setattr(eng.runner, "execute", broken)
    for step in (StepInput([(1, [4, 5, 6, 7, 8], 0)]), StepInput([(0, [4, 5], 3)])):
        with pytest.raises(RuntimeError, match="a kernel failed"):
            eng.step(step)
        assert (eng.allocator.held, eng.allocator.tables, len(eng.allocator.free)) == before
    monkeypatch.undo()
    eng.stage(StepInput([(1, list(range(1, 9)), 0)]))
    eng.unstage()
    assert (eng.allocator.held, eng.allocator.tables, len(eng.allocator.free)) == before
    with pytest.raises(ValueError, match=r"sequence 0 holds 3 cached tokens, got context_len 5"):
        eng.step(StepInput([(0, [6], 5)]))
    eng.step(StepInput([(0, [4], 3)]))  # ran: row 3 is written
    with pytest.raises(ValueError, match=r"sequence 0 holds 4 cached tokens, got context_len 9"):
        eng.stage(StepInput([(0, [6], 9)]))
    eng.unstage()  # after a refused stage: the step before stays
    assert eng.allocator.held == {0: 4}
    eng.stage(StepInput([(0, [5], 4)]))
    eng.allocator.release(0)
    eng.unstage()  # released since: stays released
    assert eng.allocator.held == {} and eng.allocator.tables == {} and len(eng.allocator.free) == before[2] + 1


@CPU
def test_a_timed_request_that_fails_leaves_no_sequence_held(monkeypatch):
    """LLMEngine.staged, through which the experiments run a request's parts themselves (the host costs' timed
    replay, the TTFT anatomy), releases its sequence when a part raises, so that the engine's next request is not
    refused for a sequence the failed one left held; a request whose stage is refused releases nothing (the sequence
    id may be the caller's)."""
    from dsv32ref.experiments import host_costs

    eng = _cpu_engine()

    def broken(prep):
        raise RuntimeError("a kernel failed")
    monkeypatch.setattr(eng.runner, "execute_timed", broken)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        host_costs._timed_request(eng, [1, 2, 3], 7)
    assert eng.allocator.held == {} and eng.allocator.tables == {}
    eng.step(StepInput([(7, [1, 2], 0)]))  # the caller's sequence 7
    with pytest.raises(ValueError, match=r"sequence 7 holds 2 cached tokens, got context_len 0"):
        host_costs._timed_request(eng, [1, 2, 3], 7)
    assert eng.allocator.held == {7: 2}
    with eng.staged(StepInput([(8, [1], 0)])) as prep:  # and after a part that ran
        assert prep.plan.num_reqs == 1 and eng.allocator.held[8] == 1
    assert eng.allocator.held == {7: 2}


@CPU
def test_uniform_decode_padded_past_max_num_seqs(seed):
    """max_num_seqs=3 with capture sizes [1, 2, 4] (the issue's [1, 2, 4, 8, 16], cut to what the test reaches):
    three decoding requests pad to 4 rows, which the decode indexer's workspace must hold (it had 3 rows: a
    crash)."""
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32, num_hidden_layers=2, indexer_types=("full", "shared"))
    ec = EngineConfig(boundary="narrow", mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_model_len=16, max_num_seqs=3,
                      max_num_batched_tokens=16, block_size=4, capture_sizes=[1, 2, 4])
    eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))
    assert eng.runner.batch.scores.shape[0] == 4
    eng.capture()
    toks, how = eng.step(StepInput([(0, [1, 2], 0), (1, [3, 4, 5], 0), (2, [6], 0)]))
    toks, how = eng.step(StepInput([(0, [toks[0]], 2), (1, [toks[1]], 3), (2, [toks[2]], 1)]))
    assert how == "PIECEWISE" and len(toks) == 3


_HERE = os.path.dirname(__file__)
CLI_REFUSALS = [  # (argv, what stderr says): exit status 2, before any work
    (["ttft", "--requests", "0"], "dsv32ref: error: TTFTProtocol.requests: expected an int in [1, 65536], got 0"),
    (["ttft", "--skip-topk", "narow"], "TTFTProtocol.skip_topk: unknown boundaries ['narow']"),
    (["ttft", "--fp8-kv", "nnone"], "TTFTProtocol.fp8_kv: unknown boundaries ['nnone']"),
    (["ttft", "--skinny-gemm", "nnone"], "TTFTProtocol.skinny_gemm: unknown boundaries ['nnone']"),
    (["ttft", "--fused-skinny", "fused"], "TTFTProtocol.fused_skinny: unknown boundaries ['fused']"),
    (["regimes", "--max-prompt", "0"], "dsv32ref: error: --max-prompt: expected an int >= 8 (the shortest of the "
                                       "default prompt_lens), got 0"),
    (["regimes", "--max-prompt", "7"], "--max-prompt: expected an int >= 8"),  # below every default: no lengths left
    (["regimes", "--max-context", "1000"], "--max-context: expected an int >= 1024 (the shortest of the default "
                                           "contexts), got 1000"),
    (["summary", "--seed", str(10 ** 22)], "dsv32ref: error: --seed: expected an int in [0, 2^63)"),
    (["capture", "--heads-per-rank", "-5"], "--heads-per-rank: expected an int >= 1, got -5"),
    # where the result would go, and what it reads, checked before any work
    (["ledger", "--predict", "--out", ""], "dsv32ref: error: --out: expected a file path, got ''"),
    (["ledger", "--predict", "--out", _HERE], "(a directory)"),
    (["fp8-accuracy", "--tokens", "1", "--out", "/tmp/not_yet_a_folder/"], "(ends in a separator)"),
    (["fp8-accuracy", "--tokens", "1", "--out", "/proc/nope/x.json"],
     "dsv32ref: error: --out: cannot make the folder '/proc/nope'"),
    # a folder that exists and takes no file (os.access says yes to root there: the run went ahead and failed at
    # the end with a traceback)
    (["fp8-accuracy", "--tokens", "1", "--out", "/proc/x.json"], "dsv32ref: error: --out: cannot write into the "
                                                                 "folder '/proc'"),
    (["ledger", "--predict", "--measured", "/nonexistent/ttft.json"],
     "dsv32ref: error: --measured: no such file '/nonexistent/ttft.json'"),
    (["ledger", "--predict", "--measured", _HERE], "--measured: a directory, not a TTFT result"),
    (["ledger", "--predict", "--measured", ""], "--measured: expected a TTFT result's path, got ''"),
    (["ledger", "--predict", "--measured", os.devnull], f"--measured: not a regular file '{os.devnull}'"),
    (["ledger", "--predict", "--measured", os.path.join(_HERE, "..", "data", "fp8_speed.json")],  # not a TTFT run's
     "not a TTFT result (`dsv32ref ttft`'s file): it has no host_costs, variants"),
    (["ledger", "--predict", "--record", "--out", "x.json"], "dsv32ref: error: --record and --out 'x.json': give one"),
    # a result path the file system refuses, a run past the models' positions: refused before the run (both were
    # refused only when the result was written, after the whole experiment)
    (["fp8-accuracy", "--tokens", "1", "--out", "/tmp/" + "a" * 300 + ".json"],
     "--out: the file name takes 305 bytes, a file system takes at most 255"),
    (["fp8-accuracy", "--tokens", "1", "--out", "/tmp/\0x.json"], "--out: a path cannot hold a NUL character"),
    (["fp8-accuracy", "--tokens", str(10 ** 8)], "fp8_accuracy.run: tokens: expected an int in [1, 2048], got "
                                                 "100000000"),
]


@pytest.mark.parametrize("argv,message", CLI_REFUSALS)
def test_cli_refuses(argv, message, capsys):
    from dsv32ref.__main__ import main

    assert main(argv) == 2 and message in capsys.readouterr().err


def test_cli_rejects_bad_arguments(capsys):
    from dsv32ref.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["ttft", "--model", "llama"])
    assert e.value.code == 2 and "invalid choice: 'llama'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ttft", "--requests", "many"])
    assert "invalid int value: 'many'" in capsys.readouterr().err
    assert main(["ledger"]) == 2 and "use --predict" in capsys.readouterr().err
    assert main(["ttft", "--tp", "0"]) == 2 and "--tp: expected an int >= 1, got 0" in capsys.readouterr().err
    for tp in ("3", str(2 ** 40)):  # refused before asking for GPUs: heads, experts and MLP columns split evenly
        assert main(["ttft", "--tp", tp]) == 2
        assert f"--tp {tp}: num_attention_heads=64 is not divisible" in capsys.readouterr().err
    for h in ("7", "1000"):  # not a rank's share of the model's heads
        assert main(["capture", "--heads-per-rank", h]) == 2
        assert f"--heads-per-rank {h}: expected a divisor of glm-5.2's 64 heads" in capsys.readouterr().err
    if not torch.cuda.is_available():  # a GPU benchmark refused on stderr, before --out's folders are made
        out = os.path.join(_HERE, "no-such-folder", "k.json")
        assert main(["kernels", "--out", out]) == 2 and not os.path.exists(os.path.dirname(out))
        assert "dsv32ref: error: kernels needs 1 CUDA GPU(s)" in capsys.readouterr().err


def _regions(run: dict, **narrow) -> dict:
    """A change to run's host_costs: its narrow variant's measured regions with the given lists."""
    regions = dict(run["host_costs"]["regions"], narrow=dict(run["host_costs"]["regions"]["narrow"], **narrow))
    return {"host_costs": dict(run["host_costs"], regions=regions)}


def test_the_ledger_refuses_a_ttft_run_it_cannot_model(tmp_path, capsys):
    """--measured: another model's run, or a run whose fields are of the wrong kind, refused before the
    prediction's minutes with the file and the field named (they were tracebacks, or a model of the wrong run)."""
    from dsv32ref.__main__ import main
    data = os.path.join(os.path.dirname(__file__), "..", "data")
    assert main(["ledger", "--predict", "--model", "deepseek-v3.2", "--measured",
                 os.path.join(data, "ttft_glm-5.2.json")]) == 2
    assert "a TTFT run of 'glm-5.2', the prediction is of 'deepseek-v3.2'" in capsys.readouterr().err
    with open(os.path.join(data, "ttft_glm-5.2.json")) as f:
        run = json.load(f)
    broken = [
        ({"variants": []}, "variants: expected an object, got list"),
        ({"provenance": None}, "provenance: expected an object, got NoneType"),
        ({"host_costs": {"sync_us": "1"}}, "host_costs: expected finite numbers >= 0 .* for aten_launch_us"),
        ({"variants": {"narrow": {}}},
         r"variants\['narrow'\]: expected mean_ms and median_ms > 0 and ledger.gpu_busy_ms >= 0"),
        ({"variants": {"narrow": dict(run["variants"]["narrow"], mean_ms=True)}}, r"variants\['narrow'\]"),
        # a launcher's wrapper cost missing (a KeyError after the prediction), a negative time (a -1097 % miss)
        ({"host_costs": dict(run["host_costs"], wrapper_us={})}, r"host_costs: .* for wrapper_us.norm_rope"),
        ({"host_costs": dict(run["host_costs"], sync_us=-1.0)}, r"host_costs: expected finite numbers >= 0 .*sync_us"),
        ({"variants": {"wide": dict(run["variants"]["wide"], mean_ms=-5.0)}}, r"variants\['wide'\]: .* > 0"),
        ({"variants": {"wide": dict(run["variants"]["wide"], median_ms=0.0)}}, r"variants\['wide'\]: .* > 0"),
        # the measured host time per layer: a truncated list (zip had dropped every layer: a -99.6 % miss), NaN,
        # a list where the object belongs (an AttributeError)
        (_regions(run, graph_us=[1.0]), r"host_costs.regions\['narrow'\]: .* graph_us one longer, got lists of 78 "
                                        r"and 1"),
        (_regions(run, eager_us=[float("nan")] * 78), r"host_costs.regions\['narrow'\]: expected eager_us .*got nan"),
        ({"host_costs": dict(run["host_costs"], regions=[1])}, r"host_costs.regions: expected an object, got list"),
        # a prompt the prediction cannot take, or none: refused before it runs (at its end, the model's compare)
        ({"protocol": dict(run["protocol"], prompt_len=32)}, r"predict_all: prompt_len: expected an int in \[1, 16\]"),
        ({"protocol": {}}, r"protocol.prompt_len: expected an int >= 1 \(the prompt the run measured\), got None"),
    ]
    for i, (change, match) in enumerate(broken):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(dict(run, **change)))
        assert main(["ledger", "--predict", "--measured", str(path)]) == 2
        assert re.search(match, capsys.readouterr().err), match


def test_save_pretrained_changes_nothing_when_a_file_it_writes_is_a_folder_there(tmp_path):
    """config.json is a folder at the path: refused before any file moves in (the shards had replaced the earlier
    checkpoint's, and then the move of config.json failed with IsADirectoryError)."""
    save_pretrained(tiny_model("tiny-glm-5.2", dtype=torch.float32, seed=1), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != "config.json"}
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"path: '.*config.json' exists and is not a regular file"):
        save_pretrained(tiny_model("tiny-glm-5.2", dtype=torch.float32, seed=2), tmp_path)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before and (tmp_path / "config.json").is_dir()


def test_cli_refuses_an_out_path_that_holds_a_fifo(tmp_path, capsys):
    """Refused before any work: the result's rename would have put a file in the FIFO's place (as it did in
    /dev/null's)."""
    from dsv32ref.__main__ import main
    os.mkfifo(tmp_path / "pipe")
    assert main(["fp8-accuracy", "--tokens", "1", "--out", str(tmp_path / "pipe")]) == 2
    assert "exists and is not a regular file" in capsys.readouterr().err and (tmp_path / "pipe").is_fifo()
    os.mkfifo(tmp_path / "r.partial.json")  # where a long run writes as it goes: refused before the run too
    assert main(["fp8-accuracy", "--tokens", "1", "--out", str(tmp_path / "r.json")]) == 2
    assert "r.partial.json' exists and is not a regular file" in capsys.readouterr().err


def test_a_result_is_never_renamed_over_a_fifo_or_a_folder(tmp_path):
    """write_atomic refuses a path that holds something other than a regular file, and leaves it as it was."""
    from dsv32ref.results import write_result
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    for name in ("pipe", "dir"):
        with pytest.raises(ValueError, match=rf"path: '.*{name}' exists and is not a regular file"):
            write_result(tmp_path / name, {"x": 1})
    assert (tmp_path / "pipe").is_fifo() and (tmp_path / "dir").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["dir", "pipe"]
    write_result(tmp_path / "ok.json", {"x": 1})  # a new file, then a regular file replaced
    write_result(tmp_path / "ok.json", {"x": 2})
    assert json.loads((tmp_path / "ok.json").read_text())["x"] == 2
    # links are followed: the target is what a result replaces (the link stays), a link to a FIFO is refused
    os.symlink(tmp_path / "ok.json", tmp_path / "link.json")
    os.symlink(tmp_path / "pipe", tmp_path / "to_pipe")
    write_result(tmp_path / "link.json", {"x": 3})
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "ok.json").read_text())["x"] == 3
    with pytest.raises(ValueError, match=r"path: '.*to_pipe' exists and is not a regular file"):
        write_result(tmp_path / "to_pipe", {"x": 1})
    (tmp_path / "ok.partial.json").mkdir()  # a folder where the partial file would be: the result is still written
    write_result(tmp_path / "ok.json", {"x": 4})
    assert json.loads((tmp_path / "ok.json").read_text())["x"] == 4


def test_save_pretrained_refuses_tensors_its_config_does_not_describe(tmp_path):
    """A resized lm_head was written, and the checkpoint then refused by load_pretrained."""
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"not those of its config:\n  lm_head.weight: shape \[3, 3\], its config "
                                         r"gives \[\d+, \d+\]"):
        save_pretrained(model, tmp_path / "resized")
    assert not (tmp_path / "resized").exists()


def test_arguments_refused_at_construction_with_their_names(tmp_path):
    """An odd rope width, a config_form that is not one, an indexer width the deployed numerics cannot rotate:
    refused where they are given, naming them (they were a width mismatch, a non-finite-weights error about
    an uninitialised model, and an error at the first forward)."""
    with pytest.raises(ValueError, match=r"apply_rope: x: the rope dims \(its last\) must be even, got 7"):
        apply_rope(torch.randn(3, 7), torch.randn(3, 3), torch.randn(3, 3), True)
    with pytest.raises(ValueError, match=r"save_pretrained: config_form: expected 'released' or 'current', got 'x'"):
        save_pretrained(tiny_model("tiny-glm-5.2"), tmp_path, config_form="x")
    cfg = ModelConfig.preset("tiny-deepseek-v3.2").replace(index_head_dim=24)
    with pytest.raises(ValueError, match=r"Indexer: deployed_numerics .* index_head_dim must be a power of two "
                                         r"<= 4096, got 24"):
        DeepseekV32ForCausalLM(cfg, deployed_numerics=True)
    DeepseekV32ForCausalLM(cfg)  # exact numerics need no rotation
    with torch.device("meta"):
        meta = DeepseekV32ForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"save_pretrained: model: \d+ tensors on the meta device hold no values"):
        save_pretrained(meta, tmp_path / "meta")


def test_shards_and_their_index_must_agree(tmp_path):
    """A tensor in a shard that the index does not map there (it was ignored), and one the index maps to a shard
    that lacks it, are refused, naming shard and tensor."""
    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    save_pretrained(model, tmp_path, max_shard_bytes=100_000)
    index = tmp_path / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    name, shard = next(iter(good["weight_map"].items()))
    other = next(fn for fn in sorted(set(good["weight_map"].values())) if fn != shard)
    tensors = load_file(tmp_path / shard)
    save_file(dict(tensors, **{"bogus.weight": torch.ones(3)}), tmp_path / shard)
    with pytest.raises(ValueError, match=rf"its shards and .*disagree:\n  {shard} holds bogus.weight, which "):
        load_pretrained(tmp_path)
    save_file(tensors, tmp_path / shard)
    index.write_text(json.dumps({"weight_map": {k: v for k, v in good["weight_map"].items() if k != name}}))
    with pytest.raises(ValueError, match=rf"{shard} holds {re.escape(name)}, which model.safetensors.index.json"):
        load_pretrained(tmp_path)
    index.write_text(json.dumps({"weight_map": dict(good["weight_map"], **{name: other})}))
    with pytest.raises(ValueError, match=rf"maps {re.escape(name)} to {other}, which does not hold it"):
        load_pretrained(tmp_path)
    index.write_text(json.dumps(good))
    load_pretrained(tmp_path, dtype=torch.float32)


def test_the_recorded_runs_are_found_from_any_directory(tmp_path, monkeypatch):
    """The commands read the repository's data/, not the working directory's."""
    from dsv32ref.experiments import reproduce
    monkeypatch.chdir(tmp_path)
    rows = reproduce.table()
    assert any(r["recorded"] is not None for r in rows)
    with pytest.raises(ValueError, match=r"reproduce: no recorded runs at .*empty"):
        reproduce.table(str(tmp_path / "empty"))


def test_comparator_arguments():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"compare\('x'\): row_dims must lie in \[0, 2\], got -1"):
        compare("x", a, a, row_dims=-1)
    with pytest.raises(ValueError, match=r"compare\('x'\): expected: expected a torch.Tensor, got ndarray"):
        compare("x", a, a.numpy())
    with pytest.raises(ValueError, match=r"compare\('x'\): got: a meta tensor holds no values to compare"):
        compare("x", a.to("meta"), a)
    with pytest.raises(ValueError, match=r"compare\('x'\): expected's dtype: expected a float dtype .*torch.int64"):
        compare("x", a.long(), a.long())
    for kw, match in ((dict(row_dims=1.0), r"row_dims must lie in \[0, 2\], got 1.0"),
                      (dict(row_dims=True), r"row_dims must lie in \[0, 2\], got True"),
                      (dict(rtol="2"), r"rtol: expected a finite number >= 0 \(units of eps\), got '2'"),
                      (dict(rtol=-1), r"rtol: expected a finite number >= 0"),
                      (dict(atol=float("nan")), r"atol: expected a finite number >= 0 .*got nan"),
                      (dict(dtype="float32"), r"dtype: expected a float dtype \(.*\), got 'float32'"),
                      (dict(dtype=torch.int64), r"dtype: expected a float dtype .*got torch.int64"),
                      (dict(precision=torch.int8), r"precision: expected a float dtype .*got torch.int8"),
                      (dict(dtype=[torch.float32]), r"dtype: expected a float dtype .*got \[torch.float32\]"),
                      (dict(precision={}), r"precision: expected a float dtype .*got \{\}"),
                      # past float's range (an OverflowError); a dtype beside a precision (a mismatch that could
                      # never pass)
                      (dict(rtol=10 ** 400), r"rtol: expected a finite number >= 0 .*got 1000.*\(401 characters\)"),
                      (dict(atol=-(10 ** 400)), r"atol: expected a finite number >= 0"),
                      (dict(dtype="float32", precision=torch.float32), r"dtype: expected a float dtype .*'float32'"),
                      (dict(dtype=torch.int32, precision=torch.float32), r"dtype: expected a float dtype .*int32")):
        with pytest.raises(ValueError, match=rf"compare\('x'\): {match}"):
            compare("x", a, a, **kw)
    with pytest.raises(ValueError, match=r"compare\('x'\): got: expected a dense \(strided\) tensor, got "
                                         r"torch.sparse_coo"):
        compare("x", a.to_sparse(), a)
    # a tolerance in float units over tensors that are not real floats: complex values lost their imaginary part,
    # int64 ones were rounded past 2^53 (both compared equal)
    for got, want, kw in ((torch.tensor([1 + 1j]), torch.tensor([1 + 5j]), dict(precision=torch.float32)),
                          (torch.tensor([2 ** 53 + 1]), torch.tensor([2 ** 53]), dict(precision=torch.float64))):
        with pytest.raises(ValueError, match=rf"compare\('x'\): got: expected a real float tensor, got {got.dtype}"):
            compare("x", got, want, rtol=0, atol=0, **kw)
    with pytest.raises(ValueError, match=r"eps: expected a float dtype .*got \[torch.float32\]"):
        eps([torch.float32])
    for empty in (torch.zeros(0, 4), torch.zeros(3, 0), torch.zeros(0)):  # nothing to compare: agreement
        for row_dims in range(empty.dim() + 1):
            assert compare("x", empty, empty.clone(), row_dims=row_dims)
    assert not compare("x", torch.zeros(0, 4), torch.zeros(0, 5))  # though the shapes must still agree
    # near float64's largest value the tolerance is still finite: a got of 0 is not within it
    assert not compare("x", torch.tensor([0.0], dtype=torch.float64), torch.tensor([1e308], dtype=torch.float64))
    assert compare("x", torch.tensor([1e308], dtype=torch.float64), torch.tensor([1e308], dtype=torch.float64))


@pytest.mark.parametrize("kw,match", [
    (dict(requests=0), r"TTFTProtocol.requests: expected an int in \[1, 65536\], got 0"),
    (dict(warmup=-1), r"TTFTProtocol.warmup: expected an int in \[0, 4096\], got -1"),
    (dict(prompt_len=0), r"TTFTProtocol.prompt_len: expected an int in \[1, 511\], got 0"),
    # refused before any engine is built
    (dict(requests=10 ** 12), r"TTFTProtocol.requests: expected an int in \[1, 65536\]"),  # prompts of 64 TB
    (dict(prompt_len=600), r"TTFTProtocol.prompt_len: expected an int in \[1, 511\], got 600"),
    (dict(seed=2 ** 80), r"TTFTProtocol.seed: expected an int in \[0, "),
    (dict(seed=-1), r"TTFTProtocol.seed: expected an int in \[0, "),
    (dict(mode="bogus"), r"TTFTProtocol.mode: expected one of \['none', .*got 'bogus'"),
    (dict(host_costs="no"), r"TTFTProtocol.host_costs: expected a bool, got str 'no'"),
    (dict(fp8_kv=None), r"TTFTProtocol.fp8_kv: expected a tuple of boundaries, got None"),
    (dict(variants=("wide",), instrument_ab=("narrow",)),
     r"TTFTProtocol.instrument_ab: \['narrow'\] not among the variants \['wide'\]"),
    (dict(skip_topk=("narrow", "narrow")), r"TTFTProtocol.skip_topk: each boundary once, got \['narrow', 'narrow'\]"),
    (dict(variants=("none", "none")), r"TTFTProtocol.variants: each boundary once"),
    (dict(variants=("narow",)), r"TTFTProtocol.variants: unknown boundaries \['narow'\]"),
    (dict(variants=()), r"TTFTProtocol.variants: unknown boundaries \[\]"),
    (dict(instrument_ab=("wide", "x")), r"TTFTProtocol.instrument_ab: unknown boundaries \['x'\]"),
    (dict(fused_moe=("fused",)), r"TTFTProtocol.fused_moe: unknown boundaries \['fused'\]"),
    (dict(skinny_gemm=("skinny",)), r"TTFTProtocol.skinny_gemm: unknown boundaries \['skinny'\]"),
    (dict(fused_skinny=("none+fused",)), r"TTFTProtocol.fused_skinny: unknown boundaries \['none\+fused'\]")])
def test_ttft_experiment_arguments(kw, match):
    from dsv32ref.experiments.ttft import TTFTProtocol

    with pytest.raises(ValueError, match=match):
        TTFTProtocol(**kw)


@pytest.mark.parametrize("name", ["nope+fused", "narrow+nope", None, 123, ["narrow"]])
def test_an_arm_name_is_checked_before_it_is_read(name):
    """protocol.numerics read "nope+fused" as "+fused" and "narrow+nope" as "" (silently grouping those tokens);
    arm(None) and arm(123) were AttributeErrors."""
    from dsv32ref.experiments.protocol import arm, numerics

    for f in (arm, numerics):
        with pytest.raises(ValueError, match=r"arm"):
            f(name)


@pytest.mark.parametrize("kw,match", [
    (dict(prompt_lens=()), r"RegimeProtocol.prompt_lens: expected a non-empty list of ints >= 1, got \(\)"),
    (dict(batches=(0,)), r"RegimeProtocol.batches: expected a non-empty list of ints >= 1, got \(0,\)"),
    (dict(decode_steps=0), r"RegimeProtocol.decode_steps: expected an int >= 1, got 0"),
    (dict(variants=("x",)), r"RegimeProtocol.variants: unknown variant\(s\) \['x'\]")])
def test_regime_experiment_arguments(kw, match):
    from dsv32ref.experiments.regimes import RegimeProtocol

    with pytest.raises(ValueError, match=match):
        RegimeProtocol(**kw)


@pytest.mark.gpu
def test_start_up_with_no_capture_size_in_a_phase():
    """max_num_seqs=4 with capture sizes [8, 64]: no size is small enough for FULL (uniform decode), so the
    graph-memory estimate has no FULL sample (it indexed an empty list: IndexError at start-up)."""
    widths = dict(hidden_size=256, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                  v_head_dim=32, num_attention_heads=16, index_n_heads=16, index_head_dim=32, index_topk=16)
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32, **widths).to("cuda", torch.bfloat16)  # compiled dots: K >= 16
    ec = EngineConfig(boundary="narrow", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                      block_size=16, capture_sizes=[8, 64])
    eng = LLMEngine(ref.config, ec, device="cuda", dtype=torch.bfloat16, model=from_reference(ref, "narrow"))
    assert set(eng.runner.memory["graph_estimate_detail"]) == {"PIECEWISE"}
    eng.capture()
    toks, how = eng.step(StepInput([(0, [1, 2, 3], 0)]))
    assert how == "PIECEWISE" and len(toks) == 1


@pytest.mark.parametrize("name", ["none+", "none+fused+fused", "none+fast", "nnone+fused", "+fused", "none++fused"])
def test_an_arm_name_is_a_boundary_and_known_switches_once(name):
    """protocol.arm refuses an empty, repeated or unknown switch and an unknown boundary, naming the arm."""
    from dsv32ref.experiments.protocol import arm

    with pytest.raises(ValueError, match=rf"arm '{re.escape(name)}': expected <boundary> or <boundary>\+<arm>"):
        arm(name)


@pytest.mark.parametrize("name,tail", [("none", ""), ("narrow+skip", ""), ("wide+ranges", ""), ("none+fused", "+fused"),
                                       ("none+fused+skinny", "+fused+skinny"), ("none+skinny+fused", "+fused+skinny"),
                                       ("narrow+skip+fp8", "+fp8")])
def test_an_arm_rounds_as_the_switches_it_turns_on(name, tail):
    """protocol.numerics: the switches that change the rounding, in one order whatever the name's (the TTFT run
    compares the tokens of arms of one numerics); the top-k skip and the instrument change none."""
    from dsv32ref.experiments.protocol import numerics

    assert numerics(name) == tail


@pytest.mark.parametrize("name", ["nope+ranges", "none+fast+ranges", "none+ranges+ranges", 3])
def test_numerics_names_the_arm_it_was_given(name):
    """protocol.numerics refuses what arm refuses, naming the name it was given (the instrument's "+ranges" tail
    included), not the boundary it strips it to."""
    from dsv32ref.experiments.protocol import numerics

    with pytest.raises(ValueError, match=rf"numerics\({re.escape(repr(name))}\): arm"):
        numerics(name)


def test_a_step_keeps_what_was_checked():
    """StepInput holds its requests as tuples of ints: a token list changed after the check (a float appended,
    which the engine would have truncated to a token) changes nothing in the step."""
    from dsv32ref.engine import StepInput

    toks = [1, 2]
    step = StepInput([(0, toks, 0)])
    toks.append(2.5)
    assert step.requests == ((0, (1, 2), 0),) and step.num_tokens == 2
    # and it cannot be given other requests afterwards (floats then reached the engine unchecked, and
    # uniform_decode stayed as computed for the first ones)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.requests = ((0, (1.7, 2.2, 3.9), 0),)


@pytest.mark.parametrize("args,match", [
    ((0, 0), r"TensorParallel.size: expected >= 1, got 0"),
    ((0, "2"), r"TensorParallel.size: expected an int, got str '2'"),
    ((2, 2), r"TensorParallel.rank: expected an int in \[0, 2\) \(size 2\), got 2"),
    ((-1, 2), r"TensorParallel.rank: expected an int in \[0, 2\)"),
])
def test_a_tensor_parallel_rank_is_one_of_its_size(args, match):
    """TensorParallel(rank, size): a size of 0 (a ZeroDivisionError in check) or a rank outside [0, size) (a size
    mismatch deep in load_state_dict) refused by name; shard refuses what is not one."""
    from dsv32ref.engine import TensorParallel, shard

    with pytest.raises(ValueError, match=match):
        TensorParallel(*args)
    with pytest.raises(ValueError, match=r"shard: tp: expected a TensorParallel \(rank, size\), got int 2"):
        shard(None, 2)


def test_an_empty_tensor_is_dense_whatever_its_strides():
    """check_tensor(dense_dims=...) on a tensor without elements: nothing to lay out (a contiguous [2, 0] tensor
    was refused for a stride of 1 at dim 0, the step past a dim of 0 being 0); a strided one with elements still is
    refused."""
    from dsv32ref.checks import check_tensor
    from dsv32ref.kernels.fused_moe import align_pairs

    for t in (torch.zeros(2, 0, dtype=torch.int32), torch.zeros(0, 3).t()):
        assert check_tensor("t", t, dense_dims=2) is t
    with pytest.raises(ValueError, match=r"t: the last 2 dims must be dense"):
        check_tensor("t", torch.zeros(3, 4)[:, ::2], dense_dims=2)
    align_pairs(torch.zeros(2, 0, dtype=torch.int32), 4)  # no pair to align: no error


def test_the_reference_router_names_what_it_was_given():
    """reference.moe.route: x that is not a tensor (an AttributeError), of another hidden size (a matmul's shape
    error), weights and bias of another shape, each refused by name."""
    from dsv32ref.reference.moe import route

    c = ModelConfig.preset("tiny-deepseek-v3.2")
    E, hd = c.n_routed_experts, c.hidden_size
    w, b = torch.randn(E, hd), torch.zeros(E)
    for args, match in ((("x", w, b), r"x: expected a torch.Tensor, got str"),
                        ((torch.randn(2, hd + 1), w, b), rf"x: expected shape \[\*, {hd}\], got \[2, {hd + 1}\]"),
                        ((torch.randn(2, hd), w[1:], b), rf"weight: expected shape \[{E}, {hd}\]"),
                        ((torch.randn(2, hd), w, b[1:]), rf"e_score_correction_bias: expected shape \[{E}\]")):
        with pytest.raises(ValueError, match=match):
            route(c, *args)


@pytest.mark.parametrize("name", ["paged_sparse_mla_inputs", "fp8_sparse_decode_inputs", "fp8_indexer_inputs"])
def test_the_input_generators_name_a_device_they_cannot_use(name):
    """A device torch does not know ('gpu'), or CUDA where there is none: refused by name before any input is drawn
    (torch's RuntimeError or AssertionError came after all of them were built)."""
    import dsv32ref.testing as testing

    with pytest.raises(ValueError, match=rf"{name}: device: expected a device such as 'cpu' or 'cuda:0', got 'gpu'"):
        getattr(testing, name)(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=rf"{name}: device: cuda is not available here \(0 CUDA devices\)"):
            getattr(testing, name)(device="cuda")
    with pytest.raises(ValueError, match=rf"{name}: device: expected a cpu or cuda device, got meta"):
        getattr(testing, name)(device="meta")  # (tensors that hold no values: the inputs drawn were none)


def test_a_scale_block_larger_than_the_weight_is_one_block():
    """quantize / dequantize_fp8_blocks with a block past the weight's size (a checkpoint's weight_block_size of
    2^28 asked for 68 GB, 2^20 x 2^20 for 4 TB): the scales of a block of the weight's size, nothing padded past it."""
    from dsv32ref.checkpoint import dequantize_fp8_blocks, quantize_fp8_blocks

    w = torch.randn(4, 6)
    q, s = quantize_fp8_blocks(w, (2 ** 20, 2 ** 20))
    q4, s4 = quantize_fp8_blocks(w, (4, 6))
    assert s.shape == (1, 1) and torch.equal(s, s4) and torch.equal(q.view(torch.uint8), q4.view(torch.uint8))
    assert torch.equal(dequantize_fp8_blocks(q, s, (2 ** 28, 2 ** 28)), dequantize_fp8_blocks(q4, s4, (4, 6)))
    q2, s2 = quantize_fp8_blocks(w, (2, 2 ** 30))  # past the weight in one dim only
    assert s2.shape == (2, 1) and torch.equal(dequantize_fp8_blocks(q2, s2, (2, 2 ** 30)),
                                              dequantize_fp8_blocks(*quantize_fp8_blocks(w, (2, 6)), (2, 6)))


def test_the_fp8_generator_names_the_widths_its_rows_hold():
    """paged_sparse_mla_inputs(kv_cache_dtype="fp8") at other widths: refused naming d_lat and d_rope (it said the
    latent rows' shape was wrong, after drawing them)."""
    from dsv32ref.testing import paged_sparse_mla_inputs

    with pytest.raises(ValueError, match=r"paged_sparse_mla_inputs: kv_cache_dtype 'fp8': FlashMLA's rows hold d_lat "
                                         r"512 and d_rope 64, got 32 and 8"):
        paged_sparse_mla_inputs(d_lat=32, d_rope=8, kv_cache_dtype="fp8")


@pytest.mark.parametrize("field,t,value,match", [
    ("positions", 2, -2, r"x.positions\[2\]: expected 0..5 \(within request 1's 6 keys\), got -2"),
    ("positions", 0, 4, r"x.positions\[0\]: expected 0..1 \(within request 0's 2 keys\), got 4"),
    ("req_indices", 0, -1, r"x.req_indices\[0\]: expected 0..1, got -1"),
    ("req_indices", 0, 5, r"x.req_indices\[0\]: expected 0..1, got 5")])
def test_the_fp8_indexer_oracle_refuses_a_token_outside_its_requests(field, t, value, match):
    """A request index or position out of range: refused naming it (Python's negative indexing scored token 2 at
    position -2 over five keys, and request -1 as the last request)."""
    from dsv32ref.testing import fp8_indexer_inputs, reference_indexer_scores_fp8

    x = fp8_indexer_inputs(num_heads=2, head_dim=8, context_lens=[0, 5], query_lens=[2, 1], block_kv=4)
    getattr(x, field)[t] = value
    with pytest.raises(ValueError, match=r"reference_indexer_scores_fp8: " + match):
        reference_indexer_scores_fp8(x)


def test_an_fp8_value_times_its_scale_past_fp32_is_refused_by_every_dequantiser():
    """A row (or key) whose power-of-two scale takes an fp8 value past fp32's range: no quantiser writes one, and
    every dequantiser refuses it naming what it read (dequantize_latent gave inf, sparse_mla_fp8 NaN)."""
    from dsv32ref.reference.fp8_cache import dequantize_indexer_keys, dequantize_latent, quantize_indexer_keys

    row = quantize_latent(torch.zeros(1, 576)).clone()
    row[0, 512:516] = torch.tensor([2.0 ** 127]).view(torch.uint8)  # group 0's scale
    row[0, 0] = 0x7E  # 448
    with pytest.raises(ValueError, match=r"rows: c_kv: 1 values times their scales are past float32's range"):
        dequantize_latent(row)
    cache = row.view(1, 1, 1, 656)
    with pytest.raises(ValueError, match=r"rows: c_kv: 1 values times their scales"):
        sparse_mla_fp8(torch.randn(1, 2, 576), cache, torch.zeros(1, 1, dtype=torch.int32), 0.1)
    keys = quantize_indexer_keys(torch.zeros(1, 4, 8)).clone()  # [1, 4, 1, 12]: 32 values, then 4 scales
    flat = keys.view(-1)
    flat[32:36] = torch.tensor([2.0 ** 127]).view(torch.uint8)  # token 0's scale
    flat[0] = 0x7E
    with pytest.raises(ValueError, match=r"cache: keys: 1 values times their scales are past float32's range"):
        dequantize_indexer_keys(keys)
    with pytest.raises(ValueError, match=r"cache: keys: 1 values times their scales"):
        indexer_scores_fp8(torch.randn(1, 2, 8), torch.ones(1, 2), keys, torch.zeros(1, dtype=torch.int32), 4, 0.1)


def test_indexer_scores_computes_in_the_widest_dtype_it_was_given():
    """float64 queries and keys with fp32 weights: scored in float64 (it was cast to fp32 by the weights' dtype,
    where q.k of 1e300s is inf)."""
    q, k = torch.full((1, 2, 4), 1e150, dtype=torch.float64), torch.full((3, 4), 1e150, dtype=torch.float64)
    out = indexer_scores(q, k, torch.ones(1, 2), 1e-300)
    assert out.dtype == torch.float64 and out.isfinite().all()
    assert torch.allclose(out, torch.full((1, 3), 2 * 4e300 * 1e-300, dtype=torch.float64))


def test_write_tokens_refuses_rows_read_from_the_cache_it_writes():
    """rows that are a view of the cache (slots 0-1 copied to 1-2): a ValueError naming both (it was torch's
    RuntimeError about overlapping memory)."""
    cache = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=r"write_tokens: cache overlaps rows in memory"):
        write_tokens(cache, torch.tensor([1, 2]), cache.view(8, 3)[0:2])


@pytest.mark.parametrize("dtype", [torch.int32, None, "float64", torch.float8_e4m3fn])
def test_the_paged_oracle_names_its_dtype(dtype):
    """reference_sparse_mla_paged's compute dtype: not a float dtype is refused naming it (an int blamed the cache,
    None computed in q's dtype, a string failed inside torch)."""
    from dsv32ref.testing import paged_sparse_mla_inputs, reference_sparse_mla_paged

    x = paged_sparse_mla_inputs(num_heads=2, d_lat=16, d_rope=8, topk=8, context_lens=(4,), query_lens=(2,))
    with pytest.raises(ValueError, match=r"reference_sparse_mla_paged: dtype: expected one of torch.bfloat16, "):
        reference_sparse_mla_paged(x, dtype)


GENERATOR_CASES = [  # the testing generators and oracles, given what they cannot draw or read
    (lambda t: t.paged_sparse_mla_inputs(num_heads=2 ** 24, d_lat=2 ** 24),
     r"paged_sparse_mla_inputs: q would hold \d+ elements, at most 268435456"),
    (lambda t: t.paged_sparse_mla_inputs(block_size=2 ** 24, extra_blocks=2 ** 24),
     r"paged_sparse_mla_inputs: latent_cache would hold"),
    (lambda t: t.fp8_indexer_inputs(block_kv=2 ** 24), r"fp8_indexer_inputs: k_cache would hold"),
    (lambda t: t.fp8_sparse_decode_inputs(context_lens=5), r"fp8_sparse_decode_inputs: context_lens: expected a non-empty"),
    # named as fp8_sparse_decode_inputs' own (it was reported as paged_sparse_mla_inputs')
    (lambda t: t.fp8_sparse_decode_inputs(topk=0), r"fp8_sparse_decode_inputs: topk: expected an int in"),
    (lambda t: t.reference_sparse_mla_paged(None), r"reference_sparse_mla_paged: x: expected PagedSparseMLAInputs"),
    (lambda t: t.reference_sparse_decode_fp8(None), r"reference_sparse_decode_fp8: x: expected FP8SparseDecodeInputs"),
    (lambda t: t.reference_indexer_scores_fp8(None), r"reference_indexer_scores_fp8: x: expected FP8IndexerInputs"),
    (lambda t: t.fp8_latent_rows(torch.tensor(1.0)), r"fp8_latent_rows: cache: expected shape \[..., 576\], got \[\]"),
    # fp8 is a floating-point dtype too: torch's isfinite raised NotImplementedError on it
    (lambda t: t.fp8_latent_rows(torch.zeros(2, 576).to(torch.float8_e4m3fn)),
     r"fp8_latent_rows: cache: expected dtype .*got torch.float8_e4m3fn"),
    # computed in float32 and returned so, whatever dtype was asked for
    (lambda t: t.reference_sparse_decode_fp8(t.fp8_sparse_decode_inputs(), torch.float16),
     r"reference_sparse_decode_fp8: dtype: expected torch.float32 or torch.float64, got torch.float16"),
]


@pytest.mark.parametrize("call,match", GENERATOR_CASES, ids=[f"gen{i}" for i in range(len(GENERATOR_CASES))])
def test_generators_and_oracles(call, match):
    from dsv32ref import testing

    with pytest.raises(ValueError, match=match):
        call(testing)


def test_a_long_tables_repeated_block_is_named_in_linear_time():
    """A 200k-block table with one block twice: named in well under a second's work (counting each id's
    occurrences one by one took minutes)."""
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"block_tables\[0\]: blocks \[0\] appear more than once"):
        AttentionMetadata.build([0], [1], [list(range(200_000)) + [0]], 4)
    assert time.perf_counter() - start < 5


def test_readers_refuse_fifos_and_malformed_results(tmp_path, capsys):
    """A FIFO where a checkpoint's or a result's file belongs (every read blocked forever; config.json alone was
    refused), and result files that do not parse or hold other kinds of fields (a JSONDecodeError naming no file,
    AttributeError, TypeError, KeyError): ValueErrors naming the file."""
    from dsv32ref.experiments.reproduce import table
    from dsv32ref.experiments.ttft_model import load_ttft_result
    from dsv32ref.summary import print_recorded

    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    for name in ("model.safetensors", "model.safetensors.index.json"):
        ckpt = tmp_path / name.replace(".", "_")
        save_pretrained(model, ckpt)
        (ckpt / "model.safetensors").unlink()
        os.mkfifo(ckpt / name)
        with pytest.raises(ValueError, match=rf"{re.escape(name)}: '.*' is not a regular file"):
            load_pretrained(ckpt, dtype=torch.float32)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "seeds.json")
    for call in (lambda: load_ttft_result(str(fifo / "seeds.json")), lambda: print_recorded(str(fifo)),
                 lambda: table(str(fifo))):
        with pytest.raises(ValueError, match=r"result: '.*seeds.json' is not a regular file"):
            call()
    data = os.path.join(os.path.dirname(__file__), "..", "data")
    cases = [("a.json", '{"provenance": ', r"a.json': not a readable result \(JSONDecodeError"),
             ("a.json", "[1, 2]", r"a.json': expected a result \(a JSON object\), got a JSON list"),
             ("a.json", '{"provenance": "H200"}', r"a.json: not the results this reads \(AttributeError"),
             ("a.json", '{"provenance": {"git_commit": 5, "device": "H200"}}', r"a.json: not the results .*TypeError")]
    for i, (name, text, match) in enumerate(cases):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        (folder / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            print_recorded(str(folder))
    with pytest.raises(ValueError, match=r"print_recorded: data_dir: expected a folder of results, got None"):
        print_recorded(None)
    print_recorded(str(tmp_path / "nowhere"))  # said, not counted as a folder of 0 files
    assert "Recorded: no folder '" in capsys.readouterr().out
    (tmp_path / "seeds").mkdir()
    (tmp_path / "seeds" / "seeds.json").write_text("{}")
    with pytest.raises(ValueError, match=r"seeds.json: not the results this reads \(KeyError: 'ttft'\)"):
        table(str(tmp_path / "seeds"))
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / "ttft_glm-5.2.json").write_text('{"variants": {"wide": {}}}')
    with pytest.raises(ValueError, match=r"live's ttft_glm-5.2.json .*: not the results this reads \(KeyError"):
        table(data, str(tmp_path / "live"))


def test_attention_stats_needs_queries_past_the_top_k():
    """Sequences of at most index_topk tokens leave no query to average over (a ZeroDivisionError); a model of
    another kind (an AttributeError)."""
    from dsv32ref.diagnostics import attention_stats

    model = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    for n in (5, model.config.index_topk):
        with pytest.raises(ValueError, match=rf"attention_stats: input_ids: expected more than index_topk=8 tokens .*"
                                             rf"got {n}"):
            attention_stats(model, torch.arange(1, n + 1))
    with pytest.raises(ValueError, match=r"attention_stats: model: expected a DeepseekV32ForCausalLM, got NoneType"):
        attention_stats(None, torch.arange(1, 20))
    with pytest.raises(ValueError, match=r"attention_stats: input_ids: expected"):
        attention_stats(model, [1, 2, 3])


def test_allocator_weak_alias_and_spawn_answer_with_value_errors():
    """A sequence past the free blocks (a RuntimeError), weak_alias of a 16-byte dtype or a list (KeyError,
    AttributeError), spawn of no ranks and `python -m dsv32ref.parallel --nproc 0` (nothing ran, exit 0)."""
    from dsv32ref.graphs import weak_alias
    from dsv32ref.parallel import spawn

    for call in (lambda: BlockAllocator(4, 4).ensure(0, 100), lambda: BlockAllocator(4, 4).assume(0, 100)):
        with pytest.raises(ValueError, match=r"BlockAllocator: num_tokens: sequence 0 needs 25 more blocks, 4 free"):
            call()
    with pytest.raises(ValueError, match=r"weak_alias: t: expected a tensor of 1, 2, 4 or 8-byte elements .*"
                                         r"complex128"):
        weak_alias(torch.zeros(3, dtype=torch.complex128))
    with pytest.raises(ValueError, match=r"weak_alias: t: expected a torch.Tensor, got list"):
        weak_alias([1.0])
    with pytest.raises(ValueError, match=r"spawn: world_size: expected >= 1, got 0"):
        spawn(print, 0)
    for argv, message in ((["--nproc", "0"], "--nproc: expected >= 1, got 0"),
                          (["--nproc", "2", "--model", "nope"], "argument --model: invalid choice: 'nope'"),
                          (["--prompt-len", "17"], "--prompt-len: expected an int in [1, 16], got 17")):
        r = subprocess.run([sys.executable, "-m", "dsv32ref.parallel", *argv], capture_output=True, text=True,
                           timeout=120, cwd=os.path.join(os.path.dirname(__file__), ".."))
        assert r.returncode == 2 and message in r.stderr, (argv, r.returncode, r.stderr[-300:])


@pytest.mark.parametrize("call,match", [
    # a misspelt boundary was modelled as one without copy buffers (capture said to succeed where narrow_copy
    # fails), negative sizes gave negative bytes, [] became the default sizes, a total of 0 a ZeroDivisionError
    (lambda m, c: m.predict(c, "narrow-copy"), r"predict: boundary: expected one of wide, narrow, narrow_copy"),
    (lambda m, c: m.predict(c, None), r"predict: boundary: expected one of"),
    (lambda m, c: m.capture_outcome(c, 10, 1, 1, boundary="narrowcopy"), r"capture_outcome: boundary: expected"),
    (lambda m, c: m.predict(c, "narrow", max_num_batched_tokens=-8),
     r"predict: max_num_batched_tokens: expected >= 1, got -8"),
    (lambda m, c: m.predict(c, "narrow", capture_sizes=[0, -4]), r"predict.capture_sizes: every size must be an int >= 1, got 0"),
    (lambda m, c: m.predict(c, "narrow", capture_sizes=[]), r"predict.capture_sizes: expected at least one size"),
    (lambda m, c: m.predict(c, "narrow", max_num_seqs=0), r"predict: max_num_seqs: expected >= 1, got 0"),
    (lambda m, c: m.predict(c, "narrow", dtype_bytes=0), r"predict: dtype_bytes: expected >= 1, got 0"),
    (lambda m, c: m.threshold(c, 10, 1, 1, 0, 0.9), r"threshold: total: expected >= 1, got 0"),
])
def test_the_capture_memory_model_refuses_settings_the_engine_would(call, match):
    from dsv32ref.experiments import memory_model

    with pytest.raises(ValueError, match=match):
        call(memory_model, ModelConfig.preset("glm-5.2"))


def test_the_ttft_model_compares_a_ledger_and_a_run_of_one_preset_and_prompt():
    """compare() with another preset's predicted ledger, or another prompt length's: refused (deepseek-v3.2's 61
    layers modelled glm-5.2's run, and switched its host costs to the launch count, silently)."""
    from dsv32ref.experiments.ttft_model import compare
    from dsv32ref.results import read_result

    run = read_result(os.path.join(os.path.dirname(__file__), "..", "data", "ttft_glm-5.2.json"))
    ledger = read_result(os.path.join(os.path.dirname(__file__), "..", "data", "ledger_predicted_glm-5.2.json"))
    assert set(compare(ledger, run)) <= set(run["variants"])  # the recorded pair: one preset, one prompt
    other = read_result(os.path.join(os.path.dirname(__file__), "..", "data", "ledger_predicted_deepseek-v3.2.json"))
    with pytest.raises(ValueError, match=r"compare: the predicted ledger's preset is 'deepseek-v3.2', the TTFT "
                                         r"run's 'glm-5.2'"):
        compare(other, run)
    with pytest.raises(ValueError, match=r"compare: the predicted ledger's prompt_len is 16, the TTFT run's 8"):
        compare({**ledger, "prompt_len": 16}, run)


@pytest.mark.parametrize("kw,match", [
    (dict(prompt_len=17), r"predict_all: prompt_len: expected an int in \[1, 16\], got 17"),
    (dict(prompt_len=0), r"predict_all: prompt_len: expected an int in \[1, 16\], got 0"),
    (dict(prompt_len=8.0), r"predict_all: prompt_len: expected an int, got float 8.0"),
    (dict(prompt_len=True), r"predict_all: prompt_len: expected an int, got bool True"),
    (dict(variants=()), r"predict_all: variants: expected a non-empty list of arm names, got \(\)"),
    (dict(variants="narrow"), r"predict_all: variants: expected a non-empty list of arm names, got 'narrow'"),
    (dict(variants=["narrow", "narow"]), r"arm 'narow': expected <boundary>"),
])
def test_the_predicted_ledger_names_what_it_cannot_predict(kw, match):
    """Refused before any arm runs (17 tokens named an internal max_num_batched_tokens, 0 an empty StepInput,
    8.0 a TypeError, True was recorded as prompt_len true, a string was iterated character by character)."""
    from dsv32ref.experiments.ledger import predict_all

    with pytest.raises(ValueError, match=match):
        predict_all(**kw)


def test_save_pretrained_refuses_tied_weights_before_it_writes(tmp_path):
    """The head tied to the embedding: a ValueError naming both, and no checkpoint folder made (safetensors'
    RuntimeError came after the folder was)."""
    model = tiny_model("tiny-glm-5.2")
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"save_pretrained: lm_head.weight and model.embed_tokens.weight share "
                                         r"memory \(tied weights\)"):
        save_pretrained(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@CPU
def test_engines_sharing_a_cache_take_turns():
    """A second engine on the first one's cache: its step is refused while the first holds a live sequence (its
    blocks overwrote the first's rows, and the first's next decode read them), and runs once it is released."""
    a = _cpu_engine()
    b = LLMEngine(a.config, a.ec, device="cpu", dtype=torch.float32, model=a.model, kv_cache=a.runner.kv_cache)
    a.step(StepInput([(0, [1, 2, 3, 4, 5], 0)]))
    with pytest.raises(ValueError, match=r"kv_cache: another engine on this cache holds live sequences \[0\]"):
        b.generate([7, 8, 9], 1)
    a.allocator.release(0)
    assert len(b.generate([7, 8, 9], 2)[0]) == 2
