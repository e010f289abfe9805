"""PyTorch reference attention: reads the cache through explicit index rows.

With `batch_invariant=True` (DEEPINFER_BATCH_INVARIANT) every query, decode or prefill, reduces
over exactly its visible keys in fixed blocks (attention/invariant.py), so its bits depend on
neither the batch nor the chunking; otherwise decode and prefill use SDPA (the fast path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    GroupMetadata,
)
from deepinfer.model_executor.layers.attention.invariant import StepLayouts, invariant_decode, invariant_prefill
from deepinfer.model_executor.layers.ops import fused


def decode_attention(cache, q: torch.Tensor, kv_index: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, D], kv_index [N, L] -> [N, H, D]; index -1 contributes nothing."""
    out = fused.decode_attention(cache, q, kv_index, scale)  # one pass over the named rows
    if out is not None:
        return out
    kv = cache.load(kv_index).to(q.dtype)  # [N, L, 2, H_kv, D]
    k = kv[:, :, 0].transpose(1, 2)  # [N, H_kv, L, D]
    v = kv[:, :, 1].transpose(1, 2)  # [N, H_kv, L, D]
    mask = (kv_index >= 0)[:, None, None, :]  # [N, 1, 1, L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # [N, H, 1, D]
    return out.squeeze(2)  # [N, H, D]


def visibility(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, L] True where key position k is visible to query position p: p-W < k <= p."""
    mask = key_pos[None, :] <= q_pos[:, None]  # [n, L]
    if window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    return mask


def prefill_attention(q, k, v, loaded, q_pos, loaded_pos, scale, window):
    """One segment: q [n, H, D] over [loaded rows | chunk rows] -> [n, H, D]."""
    k_all = torch.cat((loaded[:, 0].to(q.dtype), k), dim=0).transpose(0, 1)  # [H_kv, L, D]
    v_all = torch.cat((loaded[:, 1].to(q.dtype), v), dim=0).transpose(0, 1)  # [H_kv, L, D]
    qh = q.transpose(0, 1)  # [H, n, D]
    if loaded.shape[0] == 0 and (window is None or window >= q.shape[0]):
        out = F.scaled_dot_product_attention(qh, k_all, v_all, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = visibility(q_pos, torch.cat((loaded_pos, q_pos)), window)  # [n, L]
        out = F.scaled_dot_product_attention(qh, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [n, H, D]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant
        self.layouts = StepLayouts() if batch_invariant else None

    def forward(self, cache, q, k, v, metadata: AttentionMetadata, group: GroupMetadata,
                scale: float) -> torch.Tensor:
        md, g = metadata, group
        loaded = [cache.load(seg.load_slots) for seg in g.prefills]  # 1. load before store
        rows = g.store_rows
        cache.store(g.store_slots, k if rows is None else k[rows], v if rows is None else v[rows])  # 2.
        nd, invariant = md.num_decode_tokens, self.batch_invariant
        if nd == q.shape[0] and not invariant:  # a decode-only step: no copy into a packed output
            return decode_attention(cache, q, g.decode_index, scale)
        out = torch.empty_like(q)  # [T, H, D]
        if nd:  # 3. decode reads
            out[:nd] = invariant_decode(cache, q[:nd], self.layouts.decode(md, g), scale) if invariant \
                else decode_attention(cache, q[:nd], g.decode_index, scale)
        for i, (seg, old) in enumerate(zip(g.prefills, loaded, strict=True)):  # 4. prefill over [old | chunk]
            s, e = seg.token_start, seg.token_end
            if invariant:
                out[s:e] = invariant_prefill(cache, q[s:e], k[s:e], v[s:e], old, self.layouts.prefill(md, g, i), scale)
            else:
                out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], old, md.positions[s:e],
                                             seg.load_positions, scale, g.window)
        return out
