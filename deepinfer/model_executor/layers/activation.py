"""Gated activations over a merged [gate | up] projection, and the gated MLP built on them."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model_executor.layers.ops import fused
from deepinfer.model_executor.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedLinear,
    even_piece,
    row_parallel_linear,
)


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


class GatedMLP(nn.Module):
    """down(act(gate_up(x))): SwiGLU with `silu_and_mul`, GeGLU with `gelu_tanh_and_mul`, the experts'
    clamped SwiGLU with `moe.clamped_swiglu`. HF `gate_proj` | `up_proj` load into the merged
    `gate_up_proj` (models/utils.py), `down_proj` as named.

    `split`: the intermediate size split over the tensor-parallel ranks (gate|up by rows, down by
    columns, whose row-parallel layer all_reduces); else every projection held whole on every rank."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable = silu_and_mul,
                 bias: bool = False, split: bool = True, what: str = "intermediate_size"):
        super().__init__()
        self.act = act
        if split:
            piece = even_piece(intermediate_size, what)
            self.gate_up_proj = ColumnParallelLinear(hidden_size, [piece, piece], bias=bias)
            self.down_proj = row_parallel_linear(intermediate_size, hidden_size, bias, what)
        else:
            self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
            self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, hidden]
