"""One validated configuration for DeepSeek-V3.2 and GLM-5.x sparse MLA (DSA) models.

Field names follow the HF config.json of `deepseek_v32` / `glm_moe_dsa` checkpoints so that a reader can
map each one onto the released model definitions. Derived sizes are properties, never stored twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from dsv32ref.checks import check_eps, check_fp32_scale, check_readable, check_scale, is_finite_number, is_int, shown
from dsv32ref.hf_config import MAX_LAYERS, indexer_types_from_schedule, parse

__all__ = ["ModelConfig", "PRESETS", "REDUCED_MOE", "indexer_types_from_schedule", "reduced_moe"]

_INDEXER_TYPES = ("full", "shared")


class _FrozenDict(dict):
    """A dict that cannot change after it is made: a frozen ModelConfig's rope_scaling (a shared or later-mutated
    dict would change every config holding it, past the checks it passed). Hashable, picklable, JSON-serialisable
    as the dict it is."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("ModelConfig.rope_scaling is read-only: make another config with .replace(rope_scaling=...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):
        return _FrozenDict, (dict(self),)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DSA (DeepSeek Sparse Attention) MLA model.

    All sizes are per full model (no tensor-parallel split). `indexer_types[i]` is "full" when layer i
    runs its own indexer and "shared" when it reuses the previous full layer's top-k (IndexShare).
    `rope_scaling` is None for plain RoPE or a dict with YaRN's keys (factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim).
    """

    name: str
    model_type: str  # "deepseek_v32" | "glm_moe_dsa"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    rope_theta: float
    rope_scaling: dict | None = None
    indexer_rope_interleave: bool = False
    indexer_types: tuple[str, ...] | None = None  # None: every layer runs its indexer
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 0  # MTP layers in a checkpoint; the reference skips them
    extra: dict = field(default_factory=dict, compare=False, repr=False)  # ignored config.json keys

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"ModelConfig.name: expected a str, got {type(self.name).__name__} {self.name!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"ModelConfig.extra: expected a dict, got {type(self.extra).__name__}")
        if self.model_type not in ("deepseek_v32", "glm_moe_dsa"):
            raise ValueError(
                f"ModelConfig.model_type: expected 'deepseek_v32' or 'glm_moe_dsa', got {self.model_type!r}"
            )
        _check_sizes(self)
        _check_router(self)
        if self.rope_scaling is not None:
            _check_yarn(self.rope_scaling)
            object.__setattr__(self, "rope_scaling", _FrozenDict(self.rope_scaling))  # this config's own copy
            if not math.isfinite(self.softmax_scale):  # m^2 past float's range
                raise ValueError(f"ModelConfig.rope_scaling: mscale_all_dim {self.rope_scaling.get('mscale_all_dim')}"
                                 f" and factor {self.rope_scaling['factor']} give the softmax scale tau = "
                                 f"{self.softmax_scale}, not a finite number")
        if self.indexer_types is not None:
            if not isinstance(self.indexer_types, (tuple, list)):
                raise ValueError(f"ModelConfig.indexer_types: expected a tuple of 'full' / 'shared', got "
                                 f"{self.indexer_types!r}")
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
            _check_indexer_types(self)

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key size of the naive (MHA) form: nope + rope (192 for DeepSeek-V3.2)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token: [c_kv | k_pe] (576); also d_qk of the absorbed MQA form."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """YaRN attention mscale m = 0.1 * mscale_all_dim * ln(factor) + 1 (1 without YaRN)."""
        if self.rope_scaling is None:
            return 1.0
        factor = float(self.rope_scaling["factor"])
        mscale_all_dim = float(self.rope_scaling.get("mscale_all_dim", 0) or 0)
        if factor <= 1 or not mscale_all_dim:
            return 1.0
        return 0.1 * mscale_all_dim * math.log(factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        """tau = qk_head_dim^-1/2 * m^2 (DeepSeek-V3.2: 0.135234). Pass it explicitly to FlashMLA-like kernels."""
        return self.qk_head_dim ** -0.5 * self.mscale * self.mscale

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        return self.indexer_types or ("full",) * self.num_hidden_layers

    def _layer(self, layer) -> int:
        if not is_int(layer) or not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_hidden_layers}), got {layer!r}")
        return layer

    def runs_indexer(self, layer: int) -> bool:
        return self.layer_indexer_types[self._layer(layer)] == "full"

    def indexer_source_layer(self, layer: int) -> int:
        """The layer whose top-k layer `layer` uses: itself if it runs its indexer, else the last full one."""
        while self.layer_indexer_types[self._layer(layer)] != "full":
            layer -= 1
        return layer

    def is_moe_layer(self, layer: int) -> bool:
        return self._layer(layer) >= self.first_k_dense_replace

    @property
    def num_indexer_layers(self) -> int:
        return sum(t == "full" for t in self.layer_indexer_types)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name])  # a copy: nothing a caller does to it reaches the next one

    def replace(self, **changes: Any) -> "ModelConfig":
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"ModelConfig.replace: unknown fields {unknown}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read an HF config.json (a file or a checkpoint directory) of model_type deepseek_v32 or glm_moe_dsa.

        Accepts the released form (`rope_theta` + `rope_scaling`) and current transformers' form
        (`rope_parameters`, `indexer_types`, `index_topk_freq`, `index_skip_topk_offset`).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path: expected a checkpoint directory or a config.json path, got {type(path).__name__}")
        path = os.fspath(path)
        if "\0" in str(path):
            raise ValueError(f"path: a file path cannot hold a NUL character, got {path!r}")
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        check_readable("config.json", file)
        if os.path.isfile(file) and os.path.getsize(file) > MAX_CONFIG_BYTES:
            raise ValueError(f"config.json: {file!r} holds {os.path.getsize(file)} bytes, a config at most "
                             f"{MAX_CONFIG_BYTES}")
        try:
            with open(file) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config.json: no such file {file!r}") from None
        except OSError as e:  # a folder named config.json, no permission, an invalid path
            raise ValueError(f"config.json: cannot read {file!r} ({type(e).__name__}: {e})"[:300]) from None
        except ValueError as e:  # not JSON, not UTF-8, an integer past Python's digit limit
            raise ValueError(f"config.json: {file!r} is not valid JSON ({type(e).__name__}: {e})"[:300]) from None
        except RecursionError:
            raise ValueError(f"config.json: {file!r} nests its values too deeply to be a config") from None
        return cls.from_hf_dict(raw, name=os.path.basename(os.path.dirname(os.path.abspath(file))))

    @classmethod
    def from_hf_dict(cls, raw: dict, name: str = "hf") -> "ModelConfig":
        return cls(name=name, **parse(raw))  # the key-by-key mapping lives in dsv32ref.hf_config



_POSITIVE = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok", "n_group",
    "topk_group", "max_position_embeddings",
)


MAX_SIZE = 2 ** 31 - 1  # every size indexes int32 tensors in the kernels
RELEASED_INDEX_TOPK = 2048  # DeepSeek-V3.2's and GLM-5's top-k (small configs often keep it with fewer positions)
MAX_CONFIG_BYTES = 1 << 24  # a config.json (a released one takes a few KiB)


def _check_sizes(c: ModelConfig) -> None:
    for name in _POSITIVE:
        value = getattr(c, name)
        if not is_int(value) or value <= 0:
            raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if value > MAX_SIZE:
            raise ValueError(f"ModelConfig.{name}: expected at most {MAX_SIZE} (int32 indices), got {value}")
    if c.num_hidden_layers > MAX_LAYERS:
        raise ValueError(f"ModelConfig.num_hidden_layers: expected at most {MAX_LAYERS}, got {c.num_hidden_layers}")
    if c.index_topk > max(c.max_position_embeddings, RELEASED_INDEX_TOPK):  # each step holds [tokens, index_topk]
        raise ValueError(f"ModelConfig.index_topk: expected at most max_position_embeddings="
                         f"{c.max_position_embeddings} (a token sees no more keys than positions) or the released "
                         f"models' {RELEASED_INDEX_TOPK}, got {c.index_topk}")
    if not is_int(c.first_k_dense_replace) or not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        raise ValueError(f"ModelConfig.first_k_dense_replace: expected 0..num_hidden_layers={c.num_hidden_layers}, "
                         f"got {c.first_k_dense_replace!r}")
    if c.qk_rope_head_dim % 2 or c.qk_rope_head_dim > c.index_head_dim:
        raise ValueError(f"ModelConfig.qk_rope_head_dim: expected an even size <= index_head_dim={c.index_head_dim}, "
                         f"got {c.qk_rope_head_dim}")
    if not is_int(c.num_nextn_predict_layers) or c.num_nextn_predict_layers < 0:
        raise ValueError(f"ModelConfig.num_nextn_predict_layers: expected an int >= 0, got "
                         f"{c.num_nextn_predict_layers!r}")
    check_scale("ModelConfig.rope_theta", c.rope_theta)
    check_eps("ModelConfig.rms_norm_eps", c.rms_norm_eps)
    if c.rope_theta <= 1:  # the frequencies theta^(-2i/d) fall with i only above 1 (and YaRN divides by log theta)
        raise ValueError(f"ModelConfig.rope_theta: expected a base > 1, got {c.rope_theta!r}")
    for name in ("indexer_rope_interleave", "norm_topk_prob"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"ModelConfig.{name}: expected a bool, got {getattr(c, name)!r}")


def _check_router(c: ModelConfig) -> None:
    """The DeepSeek-V3 router's constants: groups divide the experts, top-k fits in the kept groups."""
    if not is_int(c.n_shared_experts) or c.n_shared_experts < 0:
        raise ValueError(f"ModelConfig.n_shared_experts: expected an int >= 0, got {c.n_shared_experts!r}")
    if c.n_routed_experts % c.n_group:
        raise ValueError(f"ModelConfig.n_group: n_routed_experts={c.n_routed_experts} is not divisible by "
                         f"n_group={c.n_group}")
    if c.topk_group > c.n_group:
        raise ValueError(f"ModelConfig.topk_group: {c.topk_group} > n_group={c.n_group}")
    per_group = c.n_routed_experts // c.n_group
    if c.n_group > 1 and per_group < 2:
        raise ValueError("ModelConfig.n_group: the group score sums the top-2 experts of a group")
    if c.num_experts_per_tok > c.topk_group * per_group:
        raise ValueError(f"ModelConfig.num_experts_per_tok: {c.num_experts_per_tok} experts cannot be chosen from "
                         f"topk_group={c.topk_group} groups of {per_group}")
    check_fp32_scale("ModelConfig.routed_scaling_factor", c.routed_scaling_factor)  # a float32 factor of the MoE


def _check_yarn(rs) -> None:
    if not isinstance(rs, dict):
        raise ValueError(f"ModelConfig.rope_scaling: expected None or a dict, got {shown(rs)}")
    for key in ("type", "rope_type"):
        if rs.get(key, "yarn") != "yarn":
            raise ValueError(f"ModelConfig.rope_scaling.{key}: expected 'yarn' (or no rope_scaling), got {rs[key]!r}")
    required = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
    if not all(isinstance(key, str) for key in rs):
        raise ValueError(f"ModelConfig.rope_scaling: expected str keys, got "
                         f"{sorted((k for k in rs if not isinstance(k, str)), key=repr)}")
    unknown = sorted(set(rs) - set(required) - {"type", "rope_type", "mscale", "mscale_all_dim"})
    if unknown:
        raise ValueError(f"ModelConfig.rope_scaling: keys {unknown} are not implemented (YaRN here: "
                         f"{list(required)}, mscale, mscale_all_dim)")
    missing = [k for k in required if k not in rs]
    if missing:
        raise ValueError(f"ModelConfig.rope_scaling: YaRN needs {missing}, got {rs}")
    for key in required:
        check_scale(f"ModelConfig.rope_scaling.{key}", rs[key])
    if not is_int(rs["original_max_position_embeddings"]):
        raise ValueError(f"ModelConfig.rope_scaling.original_max_position_embeddings: expected an int, got "
                         f"{rs['original_max_position_embeddings']!r}")
    for key in ("mscale", "mscale_all_dim"):
        v = rs.get(key)
        if v is not None and not (is_finite_number(v) and v >= 0):  # an int past float's range is refused too
            raise ValueError(f"ModelConfig.rope_scaling.{key}: expected a finite number >= 0, got {shown(v)}")
    if rs["factor"] < 1:
        raise ValueError(f"ModelConfig.rope_scaling.factor: expected >= 1, got {rs}")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if rs["factor"] > 1 and not (mscale and mscale_all_dim):
        # transformers then scales cos and sin by 0.1 ln(factor) + 1 (its attention_factor); no DSA model needs it
        raise ValueError(f"ModelConfig.rope_scaling: YaRN with factor > 1 needs mscale and mscale_all_dim, both "
                         f"non-zero (without them transformers scales cos and sin by 0.1 ln(factor) + 1, which is "
                         f"not implemented), got {rs}")
    if mscale and mscale_all_dim and float(mscale) != float(mscale_all_dim):
        # HF would scale cos/sin by the ratio of the two mscales; no released DSA model needs it
        raise ValueError(f"ModelConfig.rope_scaling: mscale != mscale_all_dim is not implemented, got {rs}")
    if rs["beta_fast"] < rs["beta_slow"]:
        raise ValueError(f"ModelConfig.rope_scaling: beta_fast ({rs['beta_fast']}) must be >= beta_slow "
                         f"({rs['beta_slow']})")


def _check_indexer_types(c: ModelConfig) -> None:
    if len(c.indexer_types) != c.num_hidden_layers:
        raise ValueError(f"ModelConfig.indexer_types: expected {c.num_hidden_layers} entries, got "
                         f"{len(c.indexer_types)}")
    bad = [t for t in c.indexer_types if t not in _INDEXER_TYPES]
    if bad:
        raise ValueError(f"ModelConfig.indexer_types: unknown entries {bad}; expected {_INDEXER_TYPES}")
    if c.indexer_types[0] != "full":
        raise ValueError("ModelConfig.indexer_types: layer 0 must be 'full' (nothing to share from)")


def _deepseek_v32() -> ModelConfig:
    return ModelConfig(
        name="deepseek-v3.2", model_type="deepseek_v32", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        first_k_dense_replace=3, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_head_dim=128, index_topk=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        indexer_rope_interleave=False, rms_norm_eps=1e-6, max_position_embeddings=163840,
        num_nextn_predict_layers=1,
    )


def _glm5(name: str, theta: float, index_share: bool) -> ModelConfig:
    layers = 78
    return ModelConfig(
        name=name, model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
        intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=layers,
        first_k_dense_replace=3, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
        index_head_dim=128, index_topk=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5, rope_theta=theta,
        rope_scaling=None, indexer_rope_interleave=True,
        indexer_types=indexer_types_from_schedule(layers, 4, 3) if index_share else None,
        rms_norm_eps=1e-5, max_position_embeddings=202752, num_nextn_predict_layers=1,
    )


def _tiny(name: str, base: ModelConfig, **changes: Any) -> ModelConfig:
    """Small shapes with the same structure as `base`: for tests, notebooks and CPU runs."""
    sizes = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=8,
        n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        num_nextn_predict_layers=0,
    )
    sizes.update(changes)
    return dataclasses.replace(base, name=name, **sizes)


PRESETS: dict[str, ModelConfig] = {}
PRESETS["deepseek-v3.2"] = _deepseek_v32()
PRESETS["glm-5"] = _glm5("glm-5", theta=1e6, index_share=False)
PRESETS["glm-5.2"] = _glm5("glm-5.2", theta=8e6, index_share=True)
PRESETS["tiny-deepseek-v3.2"] = _tiny(
    "tiny-deepseek-v3.2", PRESETS["deepseek-v3.2"], num_hidden_layers=4, first_k_dense_replace=1,
    n_group=4, topk_group=2,
    # YaRN kept, with a short original context so that the ramp touches every frequency band.
    rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
PRESETS["tiny-glm-5.2"] = _tiny(
    "tiny-glm-5.2", PRESETS["glm-5.2"], num_hidden_layers=8, first_k_dense_replace=1,
    rope_theta=1e4, indexer_types=indexer_types_from_schedule(8, 2, 2),
)


REDUCED_MOE = ("MoE reduced to 4 routed experts (top-2) + 1 shared expert, moe_intermediate_size unchanged; the router "
               "keeps the DeepSeek-V3 formula. The engine's MoE computes it densely (every routed expert on every "
               "token, weighted by the router: moe='dense', the default) or with the fused kernels over the tokens "
               "each expert received (moe='fused', the '+fused' arms); neither has a host sync. Everything else "
               "(embedding, every attention layer at full width, indexers, dense MLPs of the first layers, lm_head) is "
               "at full size.")


def reduced_moe(name: str) -> ModelConfig:
    """The experiments' model: preset `name` with its MoE reduced as REDUCED_MOE says, so that the whole stack
    of a full-size model fits one H200 and a step has no host sync."""
    return ModelConfig.preset(name).replace(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
