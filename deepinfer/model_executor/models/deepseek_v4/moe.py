"""DeepSeek-V4 MoE block: a router, stacked routed experts and a shared expert.

Routers (parameter names as in HF checkpoints, under `gate.`):
- `HashRouter` (the first `num_hash_layers` layers): experts come from a frozen table
  `tid2eid [vocab, k]` indexed by token id; the learned `weight [E, H]` only weights them.
- `TopKRouter` (the other layers): experts are the top-k of `score + e_score_correction_bias`;
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
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import all_reduce, tp_rank, tp_size
from deepinfer.model_executor.layers.attention.kernels import FUSED_KERNELS, KernelSet
from deepinfer.model_executor.layers.batch_invariant import linear as invariant_linear
from deepinfer.model_executor.layers.moe import clamped_swiglu
from deepinfer.model_executor.layers.parallel_linear import ShardSpec, computes_expert_slice, expert_piece
from deepinfer.model_executor.models.utils import MergedLinear

SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}


def _finish_weights(scores: torch.Tensor, topk_ids: torch.Tensor, renormalize: bool,
                    scaling: float) -> torch.Tensor:
    weights = scores.gather(1, topk_ids)  # [T, k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # [T, k]
    return weights * scaling  # [T, k]


class _Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.scoring_func not in SCORE_FUNCS:
            raise ValueError(f"scoring_func must be one of {sorted(SCORE_FUNCS)}, got {cfg.scoring_func!r}")
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.score_fn = SCORE_FUNCS[cfg.scoring_func]
        self.renormalize = getattr(cfg, "norm_topk_prob", True)
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.score_fn(F.linear(x.float(), self.weight.float()))  # [T, E]


class TopKRouter(_Router):
    """Score-routed top-k. Parameters: `weight [E, H]`, `e_score_correction_bias [E]` (fp32)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
        scores = self.scores(x)  # [T, E]
        biased = scores + self.e_score_correction_bias.float()  # [T, E]
        topk_ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices  # [T, k]
        return topk_ids, _finish_weights(scores, topk_ids, self.renormalize, self.routed_scaling_factor)


class HashRouter(_Router):
    """Token-id-routed. Parameters: `weight [E, H]`, `tid2eid [vocab, k]` (int64 expert ids)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.vocab_size = cfg.vocab_size
        tid2eid = torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long)
        self.tid2eid = nn.Parameter(tid2eid, requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], input_ids [T] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
        if input_ids.shape != x.shape[:1]:
            raise ValueError(f"input_ids must have shape {tuple(x.shape[:1])}, got {tuple(input_ids.shape)}")
        topk_ids = self.tid2eid[input_ids].long()  # [T, k]
        return topk_ids, _finish_weights(self.scores(x), topk_ids, self.renormalize, self.routed_scaling_factor)


class FusedExperts(nn.Module):
    """E routed SwiGLU experts with stacked weights, called like a grouped GEMM.

    Parameters: `gate_up_proj [E, 2I, H]` (gate rows, then up rows), `down_proj [E, H, I]`.
    `forward(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]`. The grouped GEMM is the
    `grouped_moe` hook of the kernel set bound with the caches (attention/kernels.py): the torch
    reference (layers/moe.py: pairs sorted by expert, each active expert once over its contiguous
    rows, an fp32 scatter-add) or two Triton grouped-GEMM launches (ops/triton/moe.py).

    With `expert_parallel_size` ep > 1 the module holds experts [start, start + E/ep) of the
    E (`expert_piece`), ids stay global, and only the pairs of held experts are computed (their
    ids shifted to local ones); the others add nothing to the [T, H] partial output.

    `batch_invariant` (DEEPINFER_BATCH_INVARIANT): `_per_token` instead of the hook, so a token's
    output does not depend on which other tokens share its experts.
    """

    batch_invariant = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, swiglu_limit: float | None,
                 expert_parallel_size: int = 1):
        super().__init__()
        self.num_experts, self.swiglu_limit = num_experts, swiglu_limit
        piece = expert_piece(num_experts, expert_parallel_size)
        self.expert_start, self.num_local = piece.start, piece.length
        self.kernels: KernelSet = FUSED_KERNELS  # the grouped_moe hook: set when the model binds its caches
        self.gate_up_proj = nn.Parameter(torch.zeros(self.num_local, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(self.num_local, hidden_size, intermediate_size))
        if self.num_local < num_experts:
            spec = ShardSpec(0, (piece,))
            self.shard_specs = {"gate_up_proj": spec, "down_proj": spec}

    def owns(self, expert: int) -> bool:
        """Whether this rank holds expert `expert` (a global id)."""
        return self.expert_start <= expert < self.expert_start + self.num_local

    def load_expert_weight(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """Copy one expert's [out, in] matrix into the stacks.

        `proj`: `gate_proj` / `w1`, `up_proj` / `w3`, `down_proj` / `w2` (HF / DeepSeek names).
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must lie in [0, {self.num_experts}), got {expert}")
        if not self.owns(expert):
            return  # another rank's expert: never read
        tensor = tensor if isinstance(tensor, torch.Tensor) else tensor.read()  # a lazy slice: this expert's whole
        e, inter = expert - self.expert_start, self.down_proj.shape[-1]  # the local index
        targets = {"gate_proj": self.gate_up_proj.data[e, :inter], "w1": self.gate_up_proj.data[e, :inter],
                   "up_proj": self.gate_up_proj.data[e, inter:], "w3": self.gate_up_proj.data[e, inter:],
                   "down_proj": self.down_proj.data[e], "w2": self.down_proj.data[e]}
        if proj not in targets:
            raise ValueError(f"proj must be one of {sorted(targets)}, got {proj!r}")
        if targets[proj].shape != tensor.shape:
            raise ValueError(f"expert {expert} {proj} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(targets[proj].shape)}")
        targets[proj].copy_(tensor)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        # a host sync, so checked on the CPU only (the routers' top-k yields ids in range by construction)
        checked = not x.is_cuda and flat_ids.numel()
        if checked and not 0 <= int(flat_ids.min()) <= int(flat_ids.max()) < self.num_experts:
            raise ValueError(f"topk_ids must lie in [0, {self.num_experts}), got {flat_ids.min()}..{flat_ids.max()}")
        if self.batch_invariant:
            return self._per_token(x, topk_ids, topk_weights)  # [T, H]
        if self.num_local < self.num_experts:
            return self._local_pairs(x, topk_ids, topk_weights)  # [T, H]
        return self._all_pairs(x, topk_ids, topk_weights)  # [T, H]

    def _per_token(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Each held expert over its rows through `batch_invariant.linear` (a row's bits do not
        depend on the rows beside it); then per token its weighted expert outputs added in
        ascending expert id (a stable sort of its k ids), in fp32. Other ranks' experts add 0."""
        num_tokens, k = topk_ids.shape
        ids, order = topk_ids.sort(dim=1, stable=True)  # [T, k] each token's experts ascending
        weights = topk_weights.gather(1, order).float()  # [T, k]
        flat = ids.reshape(-1) - self.expert_start  # [T*k] local ids
        outs = torch.zeros(num_tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)  # [T*k, H]
        for e in torch.unique(flat).tolist():
            if not 0 <= e < self.num_local:
                continue
            pairs = torch.nonzero(flat == e).squeeze(-1)  # [P]
            act = clamped_swiglu(invariant_linear(x[pairs // k], self.gate_up_proj[e]), self.swiglu_limit)  # [P, I]
            outs[pairs] = invariant_linear(act, self.down_proj[e]).float()  # [P, H]
        terms = outs.view(num_tokens, k, -1) * weights[..., None]  # [T, k, H]
        total = terms[:, 0]  # [T, H]
        for j in range(1, k):
            total = total + terms[:, j]
        return total.to(x.dtype)  # [T, H]

    def _local_pairs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The partial output [T, H] of the pairs whose expert this rank holds, run as one pair per row."""
        k = topk_ids.shape[1]
        local = topk_ids.reshape(-1) - self.expert_start  # [T*k]
        pairs = torch.nonzero((local >= 0) & (local < self.num_local)).squeeze(-1)  # [P]
        tokens = pairs // k  # [P]
        y = self._all_pairs(x[tokens], local[pairs, None], topk_weights.reshape(-1)[pairs, None])  # [P, H]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        out.index_add_(0, tokens, y.float())
        return out.to(x.dtype)  # [T, H]

    def _all_pairs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k] of held experts (local ids), weights [T, k] -> [T, H]."""
        return self.kernels.grouped_moe(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj,
                                        self.swiglu_limit)  # [T, H]


class SharedExpert(nn.Module):
    """Dense clamped-SwiGLU MLP; HF `gate_proj`/`up_proj` load into the merged `gate_up_proj`."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.swiglu_limit))  # [T, H]


def is_hash_layer(cfg, layer_idx: int) -> bool:
    """Whether layer `layer_idx` routes by token id (`mlp_layer_types`, else `num_hash_layers`)."""
    layer_types = getattr(cfg, "mlp_layer_types", None)
    if layer_types is not None:
        return layer_types[layer_idx] == "hash_moe"
    return layer_idx < getattr(cfg, "num_hash_layers", 0)


class DeepseekV4MoE(nn.Module):
    """The MoE block of layer `layer_idx` (HF: `DeepseekV4SparseMoeBlock`).

    Submodules: `gate` (`HashRouter` or `TopKRouter`), `experts` (`FusedExperts`), `shared_experts`.
    `forward(x [T, H], input_ids [T] | None) -> [T, H]`; hash layers require `input_ids`.
    """

    def __init__(self, cfg, layer_idx: int, expert_parallel_size: int = 1):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' for DeepSeek-V4 experts, got {cfg.hidden_act!r}")
        self.is_hash = is_hash_layer(cfg, layer_idx)
        self.gate = HashRouter(cfg) if self.is_hash else TopKRouter(cfg)
        limit = getattr(cfg, "swiglu_limit", None)
        inter = cfg.moe_intermediate_size
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, inter, limit, expert_parallel_size)
        self.computes_experts = computes_expert_slice(expert_parallel_size)
        self.split, self.adds_shared = tp_size() > 1, tp_rank() == 0  # fixed at construction
        shared_inter = inter * getattr(cfg, "n_shared_experts", 1)
        self.shared_experts = SharedExpert(cfg.hidden_size, shared_inter, limit)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k], topk_weights [T, k]) for the tokens `x [T, H]`."""
        if not self.is_hash:
            return self.gate(x)
        if input_ids is None:
            raise ValueError("input_ids is required by a hash-routed MoE layer, got None")
        return self.gate(x, input_ids)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x, input_ids)  # [T, k], [T, k]
        if not self.split:
            return self.experts(x, topk_ids, topk_weights) + self.shared_experts(x)  # [T, H]
        out = self.experts(x, topk_ids, topk_weights) if self.computes_experts else torch.zeros_like(x)  # [T, H]
        if self.adds_shared:
            out = out + self.shared_experts(x)  # [T, H]
        return all_reduce(out)  # [T, H], summed over the ranks
