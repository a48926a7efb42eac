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

from dsv32ref.checks import check_scale, is_int

__all__ = ["ModelConfig", "PRESETS", "indexer_types_from_schedule"]

_INDEXER_TYPES = ("full", "shared")




def indexer_types_from_schedule(num_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    """IndexShare schedule (GLM-5.2): layer i runs its own indexer iff max(i - offset + 1, 0) % freq == 0.

    The other layers ("shared") reuse the top-k of the closest earlier "full" layer.
    """
    for name, v, low in (("index_topk_freq", freq, 1), ("index_skip_topk_offset", offset, 0)):
        if not is_int(v) or v < low:
            raise ValueError(f"config: {name} must be an int >= {low}, got {v!r}")
    return tuple(
        "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
    )


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
        if self.model_type not in ("deepseek_v32", "glm_moe_dsa"):
            raise ValueError(
                f"ModelConfig.model_type: expected 'deepseek_v32' or 'glm_moe_dsa', got {self.model_type!r}"
            )
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
            "index_topk", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        ]
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"ModelConfig.first_k_dense_replace: expected 0..num_hidden_layers="
                f"{self.num_hidden_layers}, got {self.first_k_dense_replace}"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"ModelConfig.n_shared_experts: expected >= 0, got {self.n_shared_experts}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"ModelConfig.qk_rope_head_dim: expected an even size <= index_head_dim="
                f"{self.index_head_dim}, got {self.qk_rope_head_dim}"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"ModelConfig.n_group: n_routed_experts={self.n_routed_experts} is not divisible by "
                f"n_group={self.n_group}"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"ModelConfig.topk_group: {self.topk_group} > n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError("ModelConfig.n_group: the group score sums the top-2 experts of a group")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok: {self.num_experts_per_tok} experts cannot be chosen "
                f"from topk_group={self.topk_group} groups of {per_group}"
            )
        for name in ("rope_theta", "routed_scaling_factor", "rms_norm_eps"):
            check_scale(f"ModelConfig.{name}", getattr(self, name))
        for name in ("max_position_embeddings",):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if not is_int(self.num_nextn_predict_layers) or self.num_nextn_predict_layers < 0:
            raise ValueError(f"ModelConfig.num_nextn_predict_layers: expected an int >= 0, got "
                             f"{self.num_nextn_predict_layers!r}")
        for name in ("indexer_rope_interleave", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if not isinstance(rs, dict):
                raise ValueError(f"ModelConfig.rope_scaling: expected None or a dict, got {rs!r}")
            kind = rs.get("type", rs.get("rope_type", "yarn"))
            if kind != "yarn":
                raise ValueError(f"ModelConfig.rope_scaling.type: expected 'yarn' (or no rope_scaling), got {kind!r}")
            required = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
            missing = [k for k in required if k not in rs]
            if missing:
                raise ValueError(f"ModelConfig.rope_scaling: YaRN needs {missing}, got {rs}")
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                check_scale(f"ModelConfig.rope_scaling.{key}", rs[key])
            for key in ("mscale", "mscale_all_dim"):
                if key in rs and rs[key] is not None:
                    v = rs[key]
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                        raise ValueError(f"ModelConfig.rope_scaling.{key}: expected a finite number >= 0, got {v!r}")
            if rs["factor"] < 1:
                raise ValueError(f"ModelConfig.rope_scaling.factor: expected >= 1, got {rs}")
            if rs["beta_fast"] < rs["beta_slow"]:
                raise ValueError(f"ModelConfig.rope_scaling: beta_fast ({rs['beta_fast']}) must be >= beta_slow "
                                 f"({rs['beta_slow']})")
        if self.indexer_types is not None:
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
            if len(self.indexer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"ModelConfig.indexer_types: expected {self.num_hidden_layers} entries, got "
                    f"{len(self.indexer_types)}"
                )
            bad = sorted(set(self.indexer_types) - set(_INDEXER_TYPES))
            if bad:
                raise ValueError(f"ModelConfig.indexer_types: unknown entries {bad}; expected {_INDEXER_TYPES}")
            if self.indexer_types[0] != "full":
                raise ValueError("ModelConfig.indexer_types: layer 0 must be 'full' (nothing to share from)")

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

    def runs_indexer(self, layer: int) -> bool:
        return self.layer_indexer_types[layer] == "full"

    def indexer_source_layer(self, layer: int) -> int:
        """The layer whose top-k layer `layer` uses: itself if it runs its indexer, else the last full one."""
        while self.layer_indexer_types[layer] != "full":
            layer -= 1
        return layer

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_indexer_layers(self) -> int:
        return sum(t == "full" for t in self.layer_indexer_types)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return PRESETS[name]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read an HF config.json (a file or a checkpoint directory) of model_type deepseek_v32 or glm_moe_dsa.

        Accepts the released form (`rope_theta` + `rope_scaling`) and current transformers' form
        (`rope_parameters`, `indexer_types`, `index_topk_freq`, `index_skip_topk_offset`).
        """
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(file) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config.json: no such file {file!r}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json: {file!r} is not valid JSON ({e})") from None
        return cls.from_hf_dict(raw, name=os.path.basename(os.path.dirname(os.path.abspath(file))))

    @classmethod
    def from_hf_dict(cls, raw: dict, name: str = "hf") -> "ModelConfig":
        from dsv32ref import hf_config  # the key-by-key mapping lives in its own module

        return cls(name=name, **hf_config.parse(raw))


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
