"""Gated activations over a merged [gate | up] projection."""

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.ops import fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = fused.silu_and_mul(x)
    if out is not None:
        return out
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up  # [T, I]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.gelu(gate, approximate="tanh") * up  # [T, I]
