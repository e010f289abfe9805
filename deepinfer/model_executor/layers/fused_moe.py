"""Routed experts and the shared expert as modules, for every MoE family.

`FusedExperts` holds E SwiGLU experts as stacks and runs them through the `grouped_moe` hook of
the kernel set bound with the caches (layers/moe.py's torch reference or ops/triton/moe.py), with
expert parallelism (a rank holds a contiguous slice of the experts) and a batch-invariant path.
`SharedExpert` is the dense SwiGLU MLP some families add to every token.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.layers.attention.kernels import FUSED_KERNELS, KernelSet
from deepinfer.model_executor.layers.batch_invariant import linear as invariant_linear
from deepinfer.model_executor.layers.moe import clamped_swiglu
from deepinfer.model_executor.layers.parallel_linear import MergedLinear, ShardSpec, expert_piece


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
