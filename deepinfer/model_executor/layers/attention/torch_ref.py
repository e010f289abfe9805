"""PyTorch reference attention over the paged cache, read through explicit index rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.attention.backend import AttentionBackend, AttentionMetadata


def store_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv_cache[slot] = (k, v) for every new row. kv_cache [slots, 2, H_kv, D]."""
    kv_cache.index_copy_(0, slot_mapping, torch.stack((k, v), dim=1).to(kv_cache.dtype))  # [T, 2, H_kv, D]


def load_kv(kv_cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows at `index` ([...]); -1 entries read slot 0 and must be masked by the caller."""
    return kv_cache[index.clamp(min=0)]  # [..., 2, H_kv, D]


def decode_attention(kv_cache, q, kv_index, scale):
    """q [B, H, D], kv_index [B, L] -> [B, H, D]; index -1 contributes nothing."""
    kv = load_kv(kv_cache, kv_index).to(q.dtype)  # [B, L, 2, H_kv, D]
    k = kv[:, :, 0].transpose(1, 2)  # [B, H_kv, L, D]
    v = kv[:, :, 1].transpose(1, 2)  # [B, H_kv, L, D]
    mask = (kv_index >= 0)[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # [B, H, 1, D]
    return out.squeeze(2)  # [B, H, D]


def prefill_attention(q, k, v, loaded, q_positions, loaded_positions, scale):
    """One segment: q [n, H, D] over [loaded rows | chunk rows]; a key is visible iff its
    position <= the query's (the segment's rows are positions start..start+n-1)."""
    k_all = torch.cat((loaded[:, 0].to(q.dtype), k), dim=0).transpose(0, 1)  # [H_kv, L, D]
    v_all = torch.cat((loaded[:, 1].to(q.dtype), v), dim=0).transpose(0, 1)  # [H_kv, L, D]
    qh = q.transpose(0, 1)  # [H, n, D]
    if loaded.shape[0] == 0:
        out = F.scaled_dot_product_attention(qh, k_all, v_all, is_causal=True, scale=scale, enable_gqa=True)
    else:
        key_pos = torch.cat((loaded_positions, q_positions))  # [L]
        mask = key_pos[None, :] <= q_positions[:, None]  # [n, L]
        out = F.scaled_dot_product_attention(qh, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [n, H, D]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, kv_cache, q, k, v, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        md = metadata
        loaded = [load_kv(kv_cache, seg.load_index) for seg in md.prefills]  # 1. load before store
        store_kv(kv_cache, md.slot_mapping, k, v)  # 2. store
        out = torch.empty_like(q)  # [T, H, D]
        nd = md.num_decode_tokens
        if nd:
            out[:nd] = decode_attention(kv_cache, q[:nd], md.decode_kv_index, scale)  # 3. decode reads
        for seg, old in zip(md.prefills, loaded, strict=True):  # 4. prefill over [old | chunk]
            s, e = seg.token_start, seg.token_end
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], old, md.positions[s:e],
                                         seg.load_positions, scale)
        return out
