"""The dense SwiGLU MLP and the DeepSeek-V3-family MoE (sigmoid router with group-limited top-k).

Router, per token:
    s = sigmoid(W_g x)                                  (fp32)
    choice = s + e_score_correction_bias
    group score = sum of the top-2 choices in each of n_group groups; keep the top `topk_group` groups
    experts = top-`num_experts_per_tok` of choice within the kept groups
    weights = s at those experts, normalised to sum 1 (norm_topk_prob), x routed_scaling_factor
Output = sum_e weights_e * expert_e(x) + shared_experts(x).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dsv32ref.checks import check_tensor
from dsv32ref.config import ModelConfig


class MLP(nn.Module):
    """down_proj(silu(gate_proj x) * up_proj x)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """`mlp.gate`: weight [n_routed_experts, hidden] and e_score_correction_bias [n_routed_experts]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # fp32 whatever the default dtype (the engine builds its model under a bf16 default)
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def _apply(self, fn, recurse=True):
        # The released checkpoints keep the correction bias in fp32 (it shifts near-tied choices):
        # casting the model to bf16 must not round it.
        super()._apply(fn, recurse)
        for p in (self.weight, self.e_score_correction_bias):
            if p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids int64 [T, k], weights fp32 [T, k])."""
        return route(self.config, x, self.weight, self.e_score_correction_bias)


def route(config: ModelConfig, x: torch.Tensor, weight: torch.Tensor, e_score_correction_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3 router (module docstring): x [T, hidden], weight [E, hidden], bias [E] -> (expert ids
    int64 [T, k], weights [T, k] in fp32 or wider). The one implementation, used by the engine's MoE too."""
    c = config
    floats = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    check_tensor("x", x, shape=(None, c.hidden_size), dtype=floats)
    check_tensor("weight", weight, shape=(c.n_routed_experts, c.hidden_size), dtype=floats, device=x.device)
    check_tensor("e_score_correction_bias", e_score_correction_bias, shape=(c.n_routed_experts,), dtype=floats,
                 device=x.device)
    dt = torch.promote_types(x.dtype, torch.float32)
    s = torch.sigmoid(F.linear(x.to(dt), weight.to(dt)))  # (T, E)
    choice = s + e_score_correction_bias.to(dt)
    groups = choice.view(x.shape[0], c.n_group, -1)  # (T, G, E/G)
    if c.n_group > 1:
        group_score = groups.topk(2, dim=-1).values.sum(-1)  # (T, G)
        keep = group_score.topk(c.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = groups.masked_fill(~group_mask[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(c.num_experts_per_tok, dim=-1).indices  # (T, k)
    weights = s.gather(1, ids)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * c.routed_scaling_factor


class MoE(nn.Module):
    """gate (Router), experts.E.{gate,up,down}_proj, shared_experts.{gate,up,down}_proj."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # (T, k), (T, k)
        out = torch.zeros_like(x, dtype=weights.dtype)
        # Reference loop: each expert runs on the tokens routed to it (host sync; engines use grouped GEMMs).
        for e in ids.unique().tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            out.index_add_(0, tok, self.experts[e](x[tok]).to(out.dtype) * weights[tok, slot, None])
        out = out.to(x.dtype)
        return out + self.shared_experts(x) if self.shared_experts is not None else out
