"""config.json (HF) -> ModelConfig keyword arguments, for both released and current transformers forms.

Every key is either consumed, checked against the only value the reference implements, or listed as
having no effect on the math. Anything else is an error: a silently ignored key is how a reference drifts
from the model it claims to describe.
"""

from __future__ import annotations

from typing import Any

from dsv32ref.checks import is_int

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

# Copied straight into ModelConfig.
_DIRECT = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "first_k_dense_replace", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "max_position_embeddings",
    "num_nextn_predict_layers", "indexer_rope_interleave",
)
_REQUIRED = _DIRECT[:21]  # every size and the router's constants; the rest have defaults

# Keys whose value is fixed by the architecture: any other value is an error.
_FIXED: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "mlp_bias": False,
}
# Keys with no effect on the forward pass (bookkeeping, training-only, or derived elsewhere).
_IGNORED = {
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
    "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "initializer_range", "attention_dropout", "ep_size", "aux_loss_alpha", "seq_aux", "pretraining_tp",
    "rope_interleave", "num_key_value_heads", "head_dim", "qk_head_dim", "layer_types",
    "mlp_layer_types", "rope_theta", "rope_scaling", "rope_parameters", "indexer_types",
    "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "output_router_logits",
    "router_aux_loss_coef", "partial_rotary_factor", "use_sliding_window", "sliding_window",
}  # (rope_interleave, head_dim, qk_head_dim, layer_types, partial_rotary_factor and use_sliding_window do change
#    the math at other values: _check_attention holds them to the ones the reference implements)
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


MAX_LAYERS = 2 ** 16  # decoder layers a config may declare (DeepSeek-V3.2 has 61, GLM-5.2 78): a schedule is a tuple


def indexer_types_from_schedule(num_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    """IndexShare schedule (GLM-5.2, config.json's index_topk_freq and index_skip_topk_offset): layer i runs its own indexer iff max(i - offset + 1, 0) % freq == 0.

    The other layers ("shared") reuse the top-k of the closest earlier "full" layer.
    """
    for name, v, low in (("num_hidden_layers", num_layers, 1), ("index_topk_freq", freq, 1),
                         ("index_skip_topk_offset", offset, 0)):
        if not is_int(v) or v < low:
            raise ValueError(f"config: {name} must be an int >= {low}, got {v!r}")
    if num_layers > MAX_LAYERS:
        raise ValueError(f"config: num_hidden_layers must be at most {MAX_LAYERS}, got {num_layers}")
    return tuple(
        "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
    )


def parse(raw: dict) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"config.json: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type expected one of {MODEL_TYPES}, got {model_type!r}")
    unknown = sorted(set(raw) - set(_DIRECT) - set(_FIXED) - _IGNORED)
    if unknown:
        raise ValueError(f"config.json: unknown fields {unknown} (model_type {model_type})")
    if raw.get("quantization_config") is not None and not isinstance(raw["quantization_config"], dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {raw['quantization_config']!r}")
    for key, expected in _FIXED.items():
        if key in raw and raw[key] != expected:
            raise ValueError(f"config.json: {key}={raw[key]!r} is not supported; expected {expected!r}")

    kw: dict[str, Any] = {"model_type": model_type}
    for key in _DIRECT:
        if key in raw:
            kw[key] = raw[key]
    _check_mlp_layer_types(raw, kw)  # may supply first_k_dense_replace
    missing = [k for k in _REQUIRED if k not in kw]
    if missing:
        raise ValueError(f"config.json: missing required fields {missing}")
    kw.setdefault("indexer_rope_interleave", model_type == "glm_moe_dsa")

    heads = raw.get("num_key_value_heads", kw["num_attention_heads"])
    if heads != kw["num_attention_heads"]:
        raise ValueError(
            f"config.json: num_key_value_heads={heads!r} != num_attention_heads={kw['num_attention_heads']!r}"
        )
    _check_attention(raw, kw)
    kw["rope_theta"], kw["rope_scaling"] = _rope(raw)
    kw["indexer_types"] = _indexer_types(raw, kw["num_hidden_layers"])
    kw["extra"] = {k: raw[k] for k in raw if k in _IGNORED}
    return kw


def _check_attention(raw: dict, kw: dict) -> None:
    """Keys transformers reads for the attention, at the only values the reference implements."""
    nope, rope = kw["qk_nope_head_dim"], kw["qk_rope_head_dim"]  # (not ints: ModelConfig names them)
    expected = {"head_dim": rope, "qk_head_dim": nope + rope if is_int(nope) and is_int(rope) else None,
                "rope_interleave": True, "partial_rotary_factor": 1.0}
    for key, want in expected.items():
        if raw.get(key) is not None and want is not None and raw[key] != want:
            raise ValueError(f"config.json: {key}={raw[key]!r} is not implemented; expected {want!r}")
    if raw.get("use_sliding_window"):
        raise ValueError(f"config.json: use_sliding_window={raw['use_sliding_window']!r} is not implemented "
                         f"(every layer attends to its whole top-k)")
    layer_types = raw.get("layer_types")
    kinds = ("full_attention", "indexed_attention")  # (transformers writes the latter: every layer its top-k)
    if layer_types is not None and (not isinstance(layer_types, list) or any(t not in kinds for t in layer_types)):
        raise ValueError(f"config.json: layer_types must list only {sorted(kinds)}, got {layer_types!r}")
    n = kw.get("num_hidden_layers")
    if layer_types is not None and is_int(n) and len(layer_types) != n:
        raise ValueError(f"config.json: layer_types: expected {n} entries (num_hidden_layers), got {len(layer_types)}")


def _theta(where: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"config.json: {where}: rope_theta must be a number, got {v!r}")
    try:
        return float(v)
    except OverflowError:
        raise ValueError(f"config.json: {where}: rope_theta must be a finite number, got {v!r}") from None


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, yarn dict or None) from `rope_parameters` and/or `rope_theta` + `rope_scaling`."""
    forms = []
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"config.json: {key} must be an object or null, got {raw[key]!r}")
    if "rope_parameters" in raw and raw["rope_parameters"] is not None:
        params = dict(raw["rope_parameters"])
        if "rope_theta" not in params:
            raise ValueError("config.json: rope_parameters has no rope_theta")
        forms.append(("rope_parameters", _theta("rope_parameters", params["rope_theta"]), params))
    if "rope_theta" in raw or raw.get("rope_scaling") is not None:  # rope_scaling alone: rope_parameters' theta
        if "rope_theta" not in raw and not forms:
            raise ValueError("config.json: rope_scaling is given without rope_theta (or rope_parameters)")
        theta = _theta("rope_theta", raw["rope_theta"]) if "rope_theta" in raw else forms[0][1]
        forms.append(("rope_theta/rope_scaling", theta, dict(raw.get("rope_scaling") or {})))
    if not forms:
        raise ValueError("config.json: neither rope_parameters nor rope_theta is given")
    parsed = []
    for where, theta, params in forms:
        types = [params.get(k) for k in ("rope_type", "type") if params.get(k) is not None]
        if any(not isinstance(t, str) for t in types):
            raise ValueError(f"config.json: {where}: rope_type / type must be a string, got {types!r}")
        types = set(types)
        if len(types) > 1:
            raise ValueError(f"config.json: {where}: rope_type and type disagree: {sorted(types)}")
        rope_type = types.pop() if types else "default"
        # keys with no effect at these values (transformers' YaRN defaults)
        if params.get("partial_rotary_factor", 1.0) not in (None, 1.0):  # (transformers 5 writes it here)
            raise ValueError(f"config.json: {where}: partial_rotary_factor={params['partial_rotary_factor']!r} is "
                             f"not implemented; expected 1.0")
        rest = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")
                and not (k == "attention_factor" and v is None) and not (k == "truncate" and v is True)}
        if rope_type == "default":
            if rest:
                raise ValueError(f"config.json: {where}: keys {sorted(rest)} have no effect on rope type 'default' "
                                 f"(did you mean type 'yarn'?)")
            parsed.append((where, theta, None))
        elif rope_type == "yarn":
            missing = [k for k in _YARN_KEYS[:4] if k not in params]
            if missing:
                raise ValueError(f"config.json: {where} of type yarn misses {missing}")
            unknown = sorted(set(rest) - set(_YARN_KEYS))
            if unknown:
                raise ValueError(f"config.json: {where}: YaRN keys {unknown} are not implemented at these values "
                                 f"(attention_factor null and truncate true are)")
            yarn = {"type": "yarn", **{k: params[k] for k in _YARN_KEYS if k in params}}
            parsed.append((where, theta, yarn))
        else:
            raise ValueError(f"config.json: {where}: rope type {rope_type!r} is not supported (default, yarn)")
    if len(parsed) == 2 and parsed[0][1:] != parsed[1][1:]:
        raise ValueError(f"config.json: rope_parameters and rope_theta/rope_scaling disagree: {parsed}")
    return parsed[0][1], parsed[0][2]


def _list(raw: dict, key: str) -> list:
    if not isinstance(raw[key], list):
        raise ValueError(f"config.json: {key} must be a list, got {raw[key]!r}")
    return raw[key]


def _indexer_types(raw: dict, num_layers: int) -> tuple[str, ...] | None:
    """IndexShare from whichever of its forms config.json gives (indexer_types, index_topk_pattern, the
    index_topk_freq schedule); given more than one, they must agree."""
    forms = {}
    if raw.get("indexer_types") is not None:
        forms["indexer_types"] = tuple(_list(raw, "indexer_types"))
    if raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        if isinstance(pattern, str):
            if set(pattern) - set("FS"):
                raise ValueError(f"config.json: index_topk_pattern {pattern!r} has letters other than F/S")
            pattern = ["full" if c == "F" else "shared" for c in pattern]
        forms["index_topk_pattern"] = tuple(_list({"index_topk_pattern": pattern}, "index_topk_pattern"))
    if "index_topk_freq" in raw or (not forms and "index_skip_topk_offset" in raw):
        forms["index_topk_freq/index_skip_topk_offset"] = indexer_types_from_schedule(
            num_layers, raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2))
    if not forms:
        return None
    (first, types), *others = forms.items()
    for name, other in others:
        if other != types:
            raise ValueError(f"config.json: {first} disagrees with {name}")
    return types


def _check_mlp_layer_types(raw: dict, kw: dict) -> None:
    if raw.get("mlp_layer_types") is None:
        return
    types = _list(raw, "mlp_layer_types")
    n = kw.get("num_hidden_layers", len(types))
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"config.json: mlp_layer_types must be {n} entries of 'dense'/'sparse'")
    k = types.index("sparse") if "sparse" in types else n
    if any(t != "sparse" for t in types[k:]):
        raise ValueError("config.json: mlp_layer_types must be dense layers first, then sparse ones")
    if "first_k_dense_replace" in kw and kw["first_k_dense_replace"] != k:
        raise ValueError(
            f"config.json: mlp_layer_types has {k} dense layers but first_k_dense_replace="
            f"{kw['first_k_dense_replace']}"
        )
    kw["first_k_dense_replace"] = k


def to_hf(config, form: str = "released", who: str = "to_hf: form") -> dict[str, Any]:
    """ModelConfig -> config.json dict. form "released": rope_theta + rope_scaling; form "current":
    transformers' rope_parameters and mlp_layer_types. IndexShare is written as an explicit indexer_types list.
    `who` names `form` in an error (the caller's argument)."""
    if not hasattr(config, "model_type") or not hasattr(config, "rope_scaling"):
        raise ValueError(f"to_hf: config: expected a ModelConfig, got {type(config).__name__}")
    if form not in ("released", "current"):
        raise ValueError(f"{who}: expected 'released' or 'current', got {form!r}")
    raw: dict[str, Any] = {"model_type": config.model_type, "architectures": [
        "DeepseekV32ForCausalLM" if config.model_type == "deepseek_v32" else "GlmMoeDsaForCausalLM"]}
    for key in _DIRECT:
        raw[key] = getattr(config, key)
    raw["num_key_value_heads"] = config.num_attention_heads
    raw.update({k: v for k, v in _FIXED.items() if k in ("hidden_act", "attention_bias", "tie_word_embeddings")})
    if form == "released":
        raw["rope_theta"] = config.rope_theta
        if config.rope_scaling is not None:
            raw["rope_scaling"] = dict(config.rope_scaling)
    else:
        params = {"rope_theta": config.rope_theta, "rope_type": "default"}
        if config.rope_scaling is not None:
            params.update({k: v for k, v in config.rope_scaling.items() if k != "type"}, rope_type="yarn")
        raw["rope_parameters"] = params
        raw["mlp_layer_types"] = ["dense" if not config.is_moe_layer(i) else "sparse"
                                  for i in range(config.num_hidden_layers)]
    if config.indexer_types is not None:
        raw["indexer_types"] = list(config.indexer_types)
    return raw
