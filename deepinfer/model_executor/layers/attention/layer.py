"""Attention layer: binds one layer's cache view to the step's backend and metadata, and the
cache groups a stack of such layers declares (Llama family, Gemma 3)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.contracts.model import BoundCaches
from deepinfer.model_executor.forward_context import get_forward_context


class Attention(nn.Module):
    """q [T, H, D], k/v [T, H_kv, D] -> [T, H*D]. The cache view is bound by the cache engine.

    `sliding_window` = W: a query at p sees positions p-W+1 .. p (W rows, itself included); such a
    layer keeps its rows in a ring of S >= W + k + 1 rows per request. None: full attention.

    Two options, both off by default and honoured by every backend and kernel set:

        softcap   logits soft-capped before the softmax: s = cap * tanh(q.k * scale / cap) (Gemma 2)
        sinks     [H] a learned logit per query head that joins each query's softmax denominator as
                  exp(sink - max) and adds no value: out = sum_j p_j v_j, p normalised over the
                  keys and the sink (GPT-OSS). The model assigns its parameter, `attn.sinks =
                  self.sinks`: a reference, not a parameter of this module (no second state-dict entry)
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.softcap = check_softcap(softcap)
        self.sinks: torch.Tensor | None = None  # [H] the owner's parameter, or None
        self.kv_cache = None  # this layer's LayerCache, bound by the model runner
        self.group_index = 0  # which cache group's metadata this layer reads
        self.backend = None  # set by the model runner

    def __setattr__(self, name: str, value) -> None:
        if name == "sinks":  # kept as a plain reference: the owning module registers the parameter
            if value is not None and tuple(value.shape) != (self.num_heads,):
                raise ValueError(f"sinks must have one logit per query head ({self.num_heads}), "
                                 f"got shape {tuple(value.shape)}")
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata
        group = md.groups[self.group_index]
        out = self.backend.forward(self.kv_cache, q, k, v, md, group, self.scale, self.softcap,
                                   self.sinks)  # [T, H, D]
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)  # [T, H*D]


def check_softcap(softcap: float | None) -> float | None:
    """A soft-cap value as the kernels take it: None (no capping) or a positive float."""
    if softcap is None:
        return None
    if not softcap > 0:
        raise ValueError(f"attention softcap must be a positive number or None, got {softcap!r}")
    return float(softcap)


def attention_cache_groups(layers: list[Attention]) -> list[CacheGroupSpec]:
    """Full-attention layers -> one paged group "full"; sliding layers -> one ring group per
    window ("swa", or "swa<W>" when windows differ). Rows hold K|V of the layer's KV heads."""
    full = tuple(i for i, a in enumerate(layers) if a.sliding_window is None)
    windows = sorted({a.sliding_window for a in layers if a.sliding_window is not None})
    groups = [CacheGroupSpec("full", PAGED, full, row=_row_of(layers[full[0]]))] if full else []
    for w in windows:
        ids = tuple(i for i, a in enumerate(layers) if a.sliding_window == w)
        name = "swa" if len(windows) == 1 else f"swa{w}"
        groups.append(CacheGroupSpec(name, RING, ids, window=w, row=_row_of(layers[ids[0]])))
    return groups


def _row_of(layer: Attention) -> RowSpec:
    return RowSpec(layer.num_kv_heads, layer.head_dim)


def bind_attention_caches(layers: list[Attention], caches: BoundCaches) -> None:
    """Each layer gets its cache view, the index of its group's metadata, and the backend."""
    for gi, views in enumerate(caches.layer_caches):
        for layer_id, view in views.items():
            layers[layer_id].kv_cache, layers[layer_id].group_index = view, gi
            layers[layer_id].backend = caches.backend
