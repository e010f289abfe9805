"""DeepSeek-V2 / V3 feed-forward blocks: dense SwiGLU MLPs (the first `first_k_dense_replace`
layers) and MoE blocks (a router, routed experts, shared experts).

Routers (HF parameter names under `gate.`; logits in fp32 from `weight [E, hidden]`):

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
from deepinfer.model_executor.layers.activation import silu_and_mul
from deepinfer.model_executor.layers.fused_moe import FusedExperts
from deepinfer.model_executor.layers.ops.qmatmul import qmatmul
from deepinfer.model_executor.layers.parallel_linear import (
    ColumnParallelLinear,
    computes_expert_slice,
    even_piece,
    row_parallel_linear,
)
from deepinfer.model_executor.layers.quant_linear import QuantLinear
from deepinfer.model_executor.models.deepseek_v3.config import V3


class SplitMLP(nn.Module):
    """SwiGLU MLP with HF names (`gate_proj` | `up_proj` merged into `gate_up_proj`, `down_proj`),
    its intermediate size split over the ranks. `partial` is this rank's share of the output. Either
    projection may be a quantized twin (GGUF blocks, layers/quant_linear.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, what: str):
        super().__init__()
        piece = even_piece(intermediate_size, what)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [piece, piece], bias=False)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, False, what)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's term of the output [T, hidden] (the whole output with one rank)."""
        act = silu_and_mul(self.gate_up_proj(x))  # [T, I / n]
        if isinstance(self.down_proj, QuantLinear):  # its blocks, without the twin's all_reduce
            return qmatmul(act, self.down_proj.qweights, self.down_proj.act_levels)  # [T, hidden]
        return F.linear(act, self.down_proj.weight)  # [T, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x))  # [T, hidden]


class _Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.num_groups = cfg.n_group or 1
        self.topk_group = cfg.topk_group or self.num_groups
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))

    def _apply(self, fn, recurse: bool = True):
        """The router stays fp32 whatever dtype the model is cast to, as transformers keeps `gate.weight`
        and `e_score_correction_bias` (a bf16 router would pick other experts near ties)."""
        super()._apply(fn, recurse)
        for param in self._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
        return self

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)  # [T, E] fp32

    def group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """group_scores [T, G] -> [T, E] True for the experts of each token's best topk_group groups."""
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices  # [T, g]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        return keep.repeat_interleave(self.num_experts // self.num_groups, dim=1)  # [T, E]

    def grouped(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.view(scores.shape[0], self.num_groups, -1)  # [T, G, E/G]


class SigmoidGroupRouter(_Router):
    """DeepSeek-V3's router (see the module docstring). Parameters: `weight`, `e_score_correction_bias`."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.norm_topk_prob = bool(cfg.norm_topk_prob)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_ids [T, k], topk_weights [T, k] fp32)."""
        scores = self.logits(x).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]
        group_scores = self.grouped(choice).topk(2, dim=-1).values.sum(-1)  # [T, G]
        choice = choice.masked_fill(~self.group_mask(group_scores), float("-inf"))  # [T, E]
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


class SoftmaxGreedyRouter(_Router):
    """DeepSeek-V2's router (see the module docstring). Parameter: `weight`."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.group_limited = cfg.topk_method == "group_limited_greedy"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_ids [T, k], topk_weights [T, k] fp32)."""
        scores = self.logits(x).softmax(dim=-1)  # [T, E]
        if self.group_limited:
            scores = scores.masked_fill(~self.group_mask(self.grouped(scores).amax(-1)), 0.0)  # [T, E]
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)  # [T, k] each
        return ids, weights * self.routed_scaling_factor


class DeepseekMoE(nn.Module):
    """Router `gate`, routed `experts` (FusedExperts), `shared_experts` (SplitMLP), as HF names them.
    forward(x [T, hidden]) -> [T, hidden], after one all_reduce over the ranks."""

    def __init__(self, cfg, expert_parallel_size: int = 1):
        super().__init__()
        self.gate = SigmoidGroupRouter(cfg) if cfg.model_type == V3 else SoftmaxGreedyRouter(cfg)
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
