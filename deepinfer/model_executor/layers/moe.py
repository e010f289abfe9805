"""Routed experts as a grouped GEMM, PyTorch reference (the torch hook `grouped_moe` of
layers/kernel_set.py; ops/triton/moe.py is the Triton one, with the same contract).

Experts are clamped-SwiGLU MLPs with stacked weights: `gate_up [E, 2I, H]` (gate rows, then up
rows) and `down [E, H, I]`. The (token, slot) pairs are sorted by expert, each active expert runs
once over its contiguous rows, and the weighted outputs are scatter-added in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up  # [..., I]


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """x [T, H], topk_ids [T, k] (experts 0 .. E-1 of these stacks), topk_weights [T, k] -> [T, H]."""
    T, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = flat_ids.argsort(stable=True)  # [T*k] pairs grouped by expert
    token_idx = order // k  # [T*k]
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()  # E
    hidden = _grouped_mlp(x[token_idx], counts, gate_up, down, swiglu_limit)  # [T*k, H]
    weights = topk_weights.reshape(-1)[order].float().unsqueeze(-1)  # [T*k, 1]
    out = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, H]
    out.index_add_(0, token_idx, hidden.float() * weights)
    return out.to(x.dtype)  # [T, H]


def _grouped_mlp(x_sorted: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                 swiglu_limit: float | None) -> torch.Tensor:
    """Rows of `x_sorted [R, H]` grouped by expert (`counts[e]` rows each) -> [R, H]."""
    out = torch.empty_like(x_sorted)  # [R, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = x_sorted[start:start + count]  # [n, H]
        act = clamped_swiglu(F.linear(rows, gate_up[expert]), swiglu_limit)  # [n, I]
        out[start:start + count] = F.linear(act, down[expert])  # [n, H]
        start += count
    return out
