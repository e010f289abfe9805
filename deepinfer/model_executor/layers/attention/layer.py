"""Attention layer: binds one layer's cache view to the step's backend and metadata."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.forward_context import get_forward_context


class Attention(nn.Module):
    """q [T, H, D], k/v [T, H_kv, D] -> [T, H*D]. The cache view is bound by the cache engine.

    `sliding_window` = W: a query at p sees positions p-W+1 .. p (W rows, itself included); such a
    layer keeps its rows in a ring of S >= W + k + 1 rows per request. None: full attention.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.kv_cache = None  # this layer's LayerCache, bound by the model runner
        self.group_index = 0  # which cache group's metadata this layer reads
        self.backend = None  # set by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata
        group = md.groups[self.group_index]
        out = self.backend.forward(self.kv_cache, q, k, v, md, group, self.scale)  # [T, H, D]
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)  # [T, H*D]
