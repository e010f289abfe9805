"""MLA over the engine's caches: one latent row per token per layer in a paged group.

Per step (the book's order: a prefill chunk loads the rows it reads before this step stores)::

    q_nope, q_pe, rows = project(x)                     [T, H, dn], [T, H, dr], [T, r + dr]
    loaded             = each prefill chunk's cached rows (its earlier positions)   1. load
    store rows at the step's slots                                                  2. store
    decode queries     absorbed: kernels.sparse_mla over the index rows             3. read (MQA)
    prefill chunks     unabsorbed over [loaded | chunk] rows, masked by position
    out                = o_proj(attention)                  [T, hidden]

The decode index rows and the prefill loads come from the step's metadata (worker/input_batch.py):
a decode query's index row names exactly the rows it may read, so no causal mask is applied. A
chunk's own rows enter its attention as a later read would return them (`as_cached`): with MXFP8
or bf16 rows a query sees the same values whether its keys were stored this step or earlier.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.forward_context import get_forward_context
from deepinfer.model_executor.layers.kernel_set import CPU_KERNELS, KernelSet
from deepinfer.model_executor.layers.ops.torch_attention import visibility
from deepinfer.model_executor.layers.ops.torch_sparse_mla import load_latent
from deepinfer.model_executor.models.deepseek_v3.mla import MLAAttention


def as_cached(cache, rows: torch.Tensor) -> torch.Tensor:
    """Latent rows [n, D] as a later read of `cache` returns them (MXFP8 / bf16 rows round)."""
    codec = cache.codec
    if not codec.fp8 and codec.row_dtype == rows.dtype:
        return rows
    return codec.decode(codec.encode(rows[:, None, :], None))[:, 0, 0, :].to(rows.dtype)  # [n, D]


class CachedMLAAttention(MLAAttention):
    """One layer's MLA over its cache view; `bind` gives it the view, its group's metadata index
    and the kernel set (the row store and the sparse MLA decode run there)."""

    def __init__(self, cfg, layer_idx: int, rotary):
        super().__init__(cfg, rotary)
        self.layer_idx = layer_idx
        # what the cache holds per token, as `deepinfer info` reports it: ONE K = V head of row_dim values
        self.num_kv_heads, self.head_dim = 1, self.row_dim
        self.cache = None  # LayerCache, bound later
        self.group: int | None = None  # index of its group in the step's metadata
        self.kernels: KernelSet = CPU_KERNELS
        # the decode hook's per-head sink logit: -inf, so the softmax is over the rows alone
        self.register_buffer("no_sink", torch.full((self.num_heads,), float("-inf")), persistent=False)

    def bind(self, cache, group: int, kernels: KernelSet) -> None:
        self.cache, self.group, self.kernels = cache, group, kernels

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata
        g = md.groups[self.group]
        q_nope, q_pe, rows = self.project(x, positions)  # [T, H, dn], [T, H, dr], [T, D]
        loaded = [load_latent(self.cache, seg.load_slots).to(x.dtype) for seg in g.prefills]  # 1. load
        stored = rows if g.store_rows is None else rows[g.store_rows]
        self.kernels.store_rows(self.cache, g.store_slots, stored[:, None, :], None)  # 2. store
        out = x.new_empty(x.shape[0], self.num_heads, self.v_dim)  # [T, H, dv]
        nd = md.num_decode_tokens
        if nd:  # 3. decode queries read through their index rows
            out[:nd] = self.absorbed(q_nope[:nd], q_pe[:nd], self.cache, g.decode_index, self.kernels, self.no_sink)
        for seg, old in zip(g.prefills, loaded, strict=True):
            s, e = seg.token_start, seg.token_end
            out[s:e] = self.prefill(q_nope[s:e], q_pe[s:e], old, as_cached(self.cache, rows[s:e]),
                                    seg.load_positions, md.positions[s:e])
        return self.output(out)  # [T, hidden]

    def prefill(self, q_nope, q_pe, old: torch.Tensor, new: torch.Tensor, old_pos: torch.Tensor,
                q_pos: torch.Tensor) -> torch.Tensor:
        """One chunk's queries over [loaded rows | its own rows]; query p sees keys at positions <= p."""
        if old.shape[0] == 0:
            return self.unabsorbed(q_nope, q_pe, new, None)  # [n, H, dv]
        visible = visibility(q_pos, torch.cat([old_pos, q_pos]), None)  # [n, n_old + n]
        return self.unabsorbed(q_nope, q_pe, torch.cat([old, new]), visible)  # [n, H, dv]
