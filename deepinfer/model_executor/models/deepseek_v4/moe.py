"""DeepSeek-V4 MoE block: a router, stacked routed experts and a shared expert.

Routers (layers/router.py; parameter names as in HF checkpoints, under `gate.`):
- hash layers (the first `num_hash_layers` layers): experts come from a frozen table
  `tid2eid [vocab, k]` indexed by token id; the learned `weight [E, H]` only weights them.
- the other layers: experts are the top-k of `score + e_score_correction_bias`;
  the bias steers the choice only, the weights come from the unbiased scores.
Both score with `scoring_func` (V4: sqrt(softplus(logits))), renormalise the k weights to sum to 1
when `norm_topk_prob`, then multiply by `routed_scaling_factor`. Logits are computed in fp32.

Experts (`experts.gate_up_proj [E, 2I, H]` with gate rows first, `experts.down_proj [E, H, I]`)
run a SwiGLU whose gate is clamped to `<= swiglu_limit` and whose up projection to
`[-swiglu_limit, swiglu_limit]`; the shared expert (`shared_experts.{gate,up,down}_proj`) does the same.

Expert parallelism (expert_parallel_size ep over tensor_parallel_size n ranks; activations are
replicated): the router runs on every rank; rank r holds experts [s·E/ep, (s+1)·E/ep), s = r // (n/ep),
and computes only the (token, expert) pairs of those. With ep < n the n/ep holders of a slice hold
it alike and only the first computes (the others add zero: correct, not faster). The shared
expert stays whole and is added on rank 0 only; one all_reduce sums the partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.distributed.parallel_state import all_reduce, tp_rank, tp_size
from deepinfer.model_executor.layers.fused_moe import FusedExperts, SharedExpert
from deepinfer.model_executor.layers.parallel_linear import computes_expert_slice
from deepinfer.model_executor.layers.router import Router, RouterSpec
from deepinfer.model_executor.models.deepseek_v4.config import DeepseekV4ConfigFields


def v4_router(cfg, hashed: bool) -> RouterSpec:
    """A score-routed layer's router (`e_score_correction_bias` steers the top-k) or a hash layer's
    (`tid2eid` picks the experts); both weight them by `scoring_func` of their logits."""
    renormalize = DeepseekV4ConfigFields.of(cfg).norm_topk_prob
    return RouterSpec(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, score=cfg.scoring_func,
                      sorted_topk=False, correction_bias=not hashed, renormalize=renormalize,
                      scale=cfg.routed_scaling_factor, hash_vocab=cfg.vocab_size if hashed else 0)


def is_hash_layer(cfg, layer_idx: int) -> bool:
    """Whether layer `layer_idx` routes by token id (`mlp_layer_types`, else `num_hash_layers`)."""
    fields = DeepseekV4ConfigFields.of(cfg)
    if fields.mlp_layer_types is not None:
        return fields.mlp_layer_types[layer_idx] == "hash_moe"
    return layer_idx < fields.num_hash_layers


class DeepseekV4MoE(nn.Module):
    """The MoE block of layer `layer_idx` (HF: `DeepseekV4SparseMoeBlock`); `score_routed` makes it
    route by score whatever the layer (the MTP block's).

    Submodules: `gate` (a `Router`, hash or score routed), `experts` (`FusedExperts`), `shared_experts`.
    `forward(x [T, H], input_ids [T] | None) -> [T, H]`; hash layers require `input_ids`.
    """

    def __init__(self, cfg, layer_idx: int, expert_parallel_size: int = 1, score_routed: bool = False):
        super().__init__()
        fields = DeepseekV4ConfigFields.of(cfg)
        if fields.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for DeepSeek-V4 experts, got {fields.hidden_act!r}")
        self.is_hash = not score_routed and is_hash_layer(cfg, layer_idx)
        self.gate = Router(v4_router(cfg, self.is_hash))
        limit = fields.swiglu_limit
        inter = cfg.moe_intermediate_size
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, inter, limit, expert_parallel_size)
        self.computes_experts = computes_expert_slice(expert_parallel_size)
        self.split, self.adds_shared = tp_size() > 1, tp_rank() == 0  # fixed at construction
        shared_inter = inter * fields.n_shared_experts
        self.shared_experts = SharedExpert(cfg.hidden_size, shared_inter, limit)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k], topk_weights [T, k]) for the tokens `x [T, H]`."""
        return self.gate(x, input_ids if self.is_hash else None)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x, input_ids)  # [T, k], [T, k]
        if not self.split:
            return self.experts(x, topk_ids, topk_weights) + self.shared_experts(x)  # [T, H]
        out = self.experts(x, topk_ids, topk_weights) if self.computes_experts else torch.zeros_like(x)  # [T, H]
        if self.adds_shared:
            out = out + self.shared_experts(x)  # [T, H]
        return all_reduce(out)  # [T, H], summed over the ranks
