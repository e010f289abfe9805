"""PyTorch reference attention kernels: the torch hooks of attention/kernels.py.

Each reads the cache through explicit index rows (decode) or attends over [loaded rows | chunk
rows] with a position mask (prefill); no causal mask is applied to a cache read, -1 marks padding.
The fused C++ and Triton kernels replace `store_rows` and `decode_attention` with the same
contracts; prefill runs here on every kernel set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from deepinfer.model_executor.layers.attention.layer_cache import LayerCache


def store_rows(cache: LayerCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """k, v [M, H_kv, D] (v None: a shared K = V row) -> the rows of flat slots [M]."""
    cache.store(slots, k, v)


def decode_attention(cache: LayerCache, q: torch.Tensor, kv_index: torch.Tensor, scale: float,
                     lens: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D], kv_index [N, L] -> [N, H, D]; index -1 contributes nothing (`lens`, a bound on
    each row's named columns, is not needed here)."""
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
