"""Gated activations over a merged [gate | up] projection."""

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.ops import fused


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up  # [T, I]


silu_and_mul = fused.silu_and_mul_op(torch_silu_and_mul)  # the C++ kernel for 2-d fp32 CPU x, else torch


def torch_gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> gelu_tanh(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.gelu(gate, approximate="tanh") * up  # [T, I]


# the C++ kernel for 2-d fp32 CPU x, else torch: F.gelu rounds a thread chunk's tail differently, the
# kernel gives every element the same bits at any position (the batch-invariant CPU path needs that)
gelu_tanh_and_mul = fused.gelu_tanh_and_mul_op(torch_gelu_tanh_and_mul)
