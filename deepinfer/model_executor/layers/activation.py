"""Gated activations over a merged [gate | up] projection."""

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.ops import fused


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up  # [T, I]


silu_and_mul = fused.silu_and_mul_op(torch_silu_and_mul)  # the C++ kernel for 2-d fp32 CPU x, else torch


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.gelu(gate, approximate="tanh") * up  # [T, I]
