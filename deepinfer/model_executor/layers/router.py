"""The MoE router every routed family uses: logits -> scores -> k experts per token and their weights.

    logits  = x W^T (+ b)                      [T, E]  fp32 (x and W upcast), or the compute dtype
    scores  = score(logits)                    softmax | sigmoid | sqrt(softplus)
    choice  = scores (+ e_score_correction_bias)        the bias steers the choice, never the weights
    groups  : E experts in G groups; a group scores by the sum of its best two choices ("top2_sum",
              other experts -inf) or by its best one ("max", other experts 0); the topk_group best
              groups stay
    ids     = top-k(choice), or tid2eid[input_ids] (a hash layer)               [T, k]
    weights = scores at ids (choice at ids without a correction bias)           [T, k]
              / their sum (+ 1e-20) when `renormalize`, then * `scale`

GPT-OSS takes the top-k of the logits first and scores only those (softmax over the k). Parameter
names (HF's, under the block's `gate.` or `router.`): `weight [E, H]`, `bias [E]`,
`e_score_correction_bias [E]`, `tid2eid [vocab, k]`.

    family       score         correction  groups    renormalize         scale
    qwen*_moe    softmax       -           -         norm_topk_prob      1
    mixtral      softmax       -           -         always              1
    gpt_oss      softmax of k  -           -         (softmax of k)      1
    deepseek_v2  softmax       -           max       never               routed_scaling_factor
    deepseek_v3  sigmoid       yes         top2_sum  norm_topk_prob      routed_scaling_factor
    deepseek_v4  sqrtsoftplus  yes / hash  -         norm_topk_prob      routed_scaling_factor
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.contracts.weight_storage import FP32

SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}
# how a group scores [T, G, E/G] -> [T, G], and what its experts' choice becomes when it is dropped
GROUP_SCORES = {
    "top2_sum": (lambda grouped: grouped.topk(2, dim=-1).values.sum(-1), float("-inf")),
    "max": (lambda grouped: grouped.amax(-1), 0.0),
}


@dataclass(frozen=True)
class RouterSpec:
    """One family's routing, resolved from its config (see the module docstring's table)."""

    hidden_size: int
    num_experts: int
    top_k: int
    score: str = "softmax"  # a key of SCORE_FUNCS
    topk_before_score: bool = False  # GPT-OSS: top-k of the logits, then the score over those k
    sorted_topk: bool = True  # the k ids largest first (else in torch's unsorted order)
    correction_bias: bool = False  # `e_score_correction_bias` [E] added to the scores for the choice
    num_groups: int = 1
    topk_group: int = 1  # groups kept; == num_groups: no group limit
    group_score: str = "top2_sum"  # a key of GROUP_SCORES
    renormalize: bool = False
    scale: float = 1.0
    linear_bias: bool = False  # logits get `bias` [E] (GPT-OSS)
    fp32_logits: bool = True  # False: logits in the compute dtype (GPT-OSS's Linear)
    keep_fp32: bool = False  # parameters stay fp32 when the model is cast (transformers' DeepSeek-V2/V3)
    hash_vocab: int = 0  # > 0: ids from `tid2eid [hash_vocab, k]` by token id (DeepSeek-V4 hash layers)

    def __post_init__(self):
        if self.score not in SCORE_FUNCS:
            raise ValueError(f"scoring_func must be one of {sorted(SCORE_FUNCS)}, got {self.score!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score must be one of {sorted(GROUP_SCORES)}, got {self.group_score!r}")


class Router(nn.Module):
    """forward(x [T, H], input_ids [T] | None) -> (topk_ids [T, k] int64, topk_weights [T, k])."""

    param_storage = {"e_score_correction_bias": FP32}  # the checkpoint keeps it fp32

    def __init__(self, spec: RouterSpec):
        super().__init__()
        self.spec, self.top_k, self.num_experts = spec, spec.top_k, spec.num_experts
        self.score_fn = SCORE_FUNCS[spec.score]
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, spec.hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.linear_bias else None
        if spec.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False)
        if spec.hash_vocab:
            tid2eid = torch.zeros(spec.hash_vocab, spec.top_k, dtype=torch.long)
            self.tid2eid = nn.Parameter(tid2eid, requires_grad=False)

    def _apply(self, fn, recurse: bool = True):
        """With `keep_fp32`, float parameters stay fp32 whatever dtype the model is cast to, as
        transformers keeps DeepSeek's `gate.weight` and `e_score_correction_bias` (a bf16 router
        would pick other experts near ties)."""
        super()._apply(fn, recurse)
        if self.spec.keep_fp32:
            for param in self._parameters.values():
                if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                    param.data = param.data.float()
        return self

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.fp32_logits:
            return F.linear(x.float(), self.weight.float())  # [T, E] fp32
        return F.linear(x, self.weight, self.bias)  # [T, E]

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.score_fn(self.logits(x))  # [T, E]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        if spec.topk_before_score:
            top, ids = self.logits(x).topk(self.top_k, dim=-1, sorted=spec.sorted_topk)  # [T, k] each
            return ids, self.score_fn(top) * spec.scale  # [T, k], [T, k]
        scores = self.scores(x)  # [T, E]
        if spec.hash_vocab:
            ids, source = self.hashed(x, input_ids), scores  # [T, k]
        else:
            ids, source = self.chosen(scores)  # [T, k], [T, E]
        weights = source.gather(1, ids)  # [T, k]
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # [T, k]
        return ids, weights * spec.scale  # [T, k], [T, k]

    def chosen(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores [T, E] -> (the top-k ids [T, k], what their weights are read from [T, E])."""
        spec, choice = self.spec, scores
        if spec.correction_bias:
            choice = scores + self.e_score_correction_bias.float()  # [T, E]
        if spec.topk_group < spec.num_groups:
            choice = self.group_limited(choice)  # [T, E]
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=spec.sorted_topk).indices  # [T, k]
        return ids, scores if spec.correction_bias else choice

    def group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's best topk_group groups dropped."""
        group_score, fill = GROUP_SCORES[self.spec.group_score]
        group_scores = group_score(choice.view(choice.shape[0], self.spec.num_groups, -1))  # [T, G]
        best = torch.topk(group_scores, self.spec.topk_group, dim=-1, sorted=False).indices  # [T, g]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        keep = keep.repeat_interleave(self.num_experts // self.spec.num_groups, dim=1)  # [T, E]
        return choice.masked_fill(~keep, fill)  # [T, E]

    def hashed(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """The ids of a hash layer: tid2eid rows of the tokens [T, k]."""
        if input_ids is None:
            raise ValueError("input_ids is required by a hash-routed MoE layer, got None")
        if input_ids.shape != x.shape[:1]:
            raise ValueError(f"input_ids must have shape {tuple(x.shape[:1])}, got {tuple(input_ids.shape)}")
        return self.tid2eid[input_ids].long()  # [T, k]
