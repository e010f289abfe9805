"""DeepSeek-V2 / V3 feed-forward blocks: dense SwiGLU MLPs (the first `first_k_dense_replace`
layers) and MoE blocks (a router, routed experts, shared experts).

Routers (layers/router.py; HF parameter names under `gate.`; logits in fp32 from `weight [E, hidden]`):

    V3  scores = sigmoid(logits); choice = scores + e_score_correction_bias
        groups (n_group of E / n_group experts) score by the sum of their top-2 choices; the best
        topk_group groups stay, the top-k choices among their experts are routed; weights come from
        the unbiased scores, / their sum when norm_topk_prob, then * routed_scaling_factor
    V2  scores = softmax(logits); "greedy": the top-k scores; "group_limited_greedy": groups score
        by their best expert, the top-k among the best topk_group groups; weights = the scores *
        routed_scaling_factor (no renormalisation, as transformers' DeepseekV2 router)

Tensor parallelism (n ranks): the dense MLPs and the shared experts split their intermediate size
(gate|up by rows, down by columns); the routed experts split over expert_parallel_size rank groups
(layers/fused_moe.FusedExperts: the first holder of a slice computes it). Each block ends with ONE
all_reduce of [routed partial + shared partial].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import all_reduce
from deepinfer.model_executor.layers.activation import GatedMLP
from deepinfer.model_executor.layers.fused_moe import FusedExperts
from deepinfer.model_executor.layers.ops.qmatmul import qmatmul
from deepinfer.model_executor.layers.parallel_linear import computes_expert_slice
from deepinfer.model_executor.layers.quant_linear import QuantLinear
from deepinfer.model_executor.layers.router import Router, RouterSpec
from deepinfer.model_executor.models.deepseek_v3.config import V3


class SplitMLP(GatedMLP):
    """The gated (SwiGLU) MLP with HF names (`gate_proj` | `up_proj` merged into `gate_up_proj`,
    `down_proj`), its intermediate size split over the ranks. `partial` is this rank's share of the
    output. Either projection may be a quantized twin (GGUF blocks, layers/quant_linear.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, what: str):
        super().__init__(hidden_size, intermediate_size, what=what)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's term of the output [T, hidden] (the whole output with one rank)."""
        act = self.act(self.gate_up_proj(x))  # [T, I / n]
        if isinstance(self.down_proj, QuantLinear):  # its blocks, without the twin's all_reduce
            return qmatmul(act, self.down_proj.qweights, self.down_proj.act_levels)  # [T, hidden]
        return F.linear(act, self.down_proj.weight)  # [T, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x))  # [T, hidden]


def deepseek_router(cfg) -> RouterSpec:
    """The V3 or V2 router of the module docstring, kept in fp32 (parameters `weight`, and V3's
    `e_score_correction_bias`)."""
    groups = cfg.n_group or 1
    topk_group = cfg.topk_group or groups
    common = dict(hidden_size=cfg.hidden_size, num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                  sorted_topk=False, num_groups=groups, scale=cfg.routed_scaling_factor, keep_fp32=True)
    if cfg.model_type == V3:
        return RouterSpec(score="sigmoid", correction_bias=True, topk_group=topk_group, group_score="top2_sum",
                          renormalize=bool(cfg.norm_topk_prob), **common)
    limited = cfg.topk_method == "group_limited_greedy"
    return RouterSpec(score="softmax", topk_group=topk_group if limited else groups, group_score="max", **common)


class DeepseekMoE(nn.Module):
    """Router `gate`, routed `experts` (FusedExperts), `shared_experts` (SplitMLP), as HF names them.
    forward(x [T, hidden]) -> [T, hidden], after one all_reduce over the ranks."""

    def __init__(self, cfg, router: RouterSpec, expert_parallel_size: int = 1):
        super().__init__()
        self.gate = Router(router)
        inter = cfg.moe_intermediate_size
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, inter, None, expert_parallel_size)
        self.computes_experts = computes_expert_slice(expert_parallel_size)  # fixed at construction
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = SplitMLP(cfg.hidden_size, inter * cfg.n_shared_experts,
                                           "moe_intermediate_size * n_shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, k], [T, k]
        out = self.experts(x, ids, weights) if self.computes_experts else torch.zeros_like(x)  # [T, hidden]
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x)
        return all_reduce(out)  # [T, hidden]
