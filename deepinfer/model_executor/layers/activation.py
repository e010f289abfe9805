"""Gated activations over a merged [gate | up] projection."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up  # [T, I]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.gelu(gate, approximate="tanh") * up  # [T, I]
