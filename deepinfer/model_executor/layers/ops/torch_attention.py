"""PyTorch reference attention kernels: the torch hooks of layers/kernel_set.py (beside their
Triton twins in ops/triton/; the attention backends reach them through their kernel set).

Each reads the cache through explicit index rows (decode) or attends over [loaded rows | chunk
rows] with a position mask (prefill); no causal mask is applied to a cache read, -1 marks padding.
The fused C++ and Triton kernels replace `store_rows` and `decode_attention` with the same
contracts; prefill runs here on every kernel set.

Without options both run SDPA. With a soft-cap or sinks (attention/layer.py) they run
`softmax_attention`: the logits, capped, masked, a sink column appended per head, a float32
softmax, the sink column dropped, the weights times the values.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class RowCache(Protocol):
    """What these kernels ask of a layer's cache view (`attention/layer_cache.LayerCache`, which
    sits above ops/ and is not imported here)."""

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None: ...

    def load(self, index: torch.Tensor) -> torch.Tensor: ...


def store_rows(cache: RowCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """k, v [M, H_kv, D] (v None: a shared K = V row) -> the rows of flat slots [M]."""
    cache.store(slots, k, v)


def decode_attention(cache: RowCache, q: torch.Tensor, kv_index: torch.Tensor, scale: float,
                     lens: torch.Tensor | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D], kv_index [N, L] -> [N, H, D]; index -1 contributes nothing (`lens`, a bound on
    each row's named columns, is not needed here)."""
    kv = cache.load(kv_index).to(q.dtype)  # [N, L, 2, H_kv, D]
    k = kv[:, :, 0].transpose(1, 2)  # [N, H_kv, L, D]
    v = kv[:, :, 1].transpose(1, 2)  # [N, H_kv, L, D]
    mask = (kv_index >= 0)[:, None, None, :]  # [N, 1, 1, L]
    if softcap is not None or sinks is not None:
        out = softmax_attention(q.unsqueeze(2), k, v, mask, scale, softcap, sinks)  # [N, H, 1, D]
    else:
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=True)  # [N, H, 1, D]
    return out.squeeze(2)  # [N, H, D]


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, M, D], k, v [B, H_kv, L, D], mask [B, 1, M, L] (True: visible) -> [B, H, M, D].
    Query head h reads KV head h // (H / H_kv); a query that sees no key gets zeros."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, L, D]
    scores = (q @ k.transpose(-1, -2)).float() * scale  # [B, H, M, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [B, H, M, 1]
        scores = torch.cat((scores, sink), dim=-1)  # [B, H, M, L + 1]
    probs = torch.softmax(scores, dim=-1)  # [B, H, M, L (+1)]
    if sinks is not None:
        probs = probs[..., :-1]
    return (probs.to(v.dtype) @ v).nan_to_num_(0.0)  # [B, H, M, D]


def visibility(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None,
               horizons: torch.Tensor | None = None) -> torch.Tensor:
    """[n, L] True where key position k is visible to query position p: p-W < k <= h, where h = p
    (causal) or, with `horizons` [n], the query's own horizon h >= p (a picture's run, seen whole)."""
    top = q_pos if horizons is None else horizons  # [n]
    mask = key_pos[None, :] <= top[:, None]  # [n, L]
    if window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    return mask


def prefill_attention(q, k, v, loaded, q_pos, loaded_pos, scale, window, softcap=None, sinks=None, horizons=None):
    """One segment: q [n, H, D] over [loaded rows | chunk rows] -> [n, H, D]. `horizons` [n] (None:
    causal): the last position each query sees, >= its own; keys past it must be in the chunk."""
    k_all = torch.cat((loaded[:, 0].to(q.dtype), k), dim=0).transpose(0, 1)  # [H_kv, L, D]
    v_all = torch.cat((loaded[:, 1].to(q.dtype), v), dim=0).transpose(0, 1)  # [H_kv, L, D]
    qh = q.transpose(0, 1)  # [H, n, D]
    if softcap is not None or sinks is not None:
        mask = visibility(q_pos, torch.cat((loaded_pos, q_pos)), window, horizons)  # [n, L]
        out = softmax_attention(qh[None], k_all[None], v_all[None], mask[None, None], scale, softcap, sinks)
        return out[0].transpose(0, 1)  # [n, H, D]
    if horizons is None and loaded.shape[0] == 0 and (window is None or window >= q.shape[0]):
        out = F.scaled_dot_product_attention(qh, k_all, v_all, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = visibility(q_pos, torch.cat((loaded_pos, q_pos)), window, horizons)  # [n, L]
        out = F.scaled_dot_product_attention(qh, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [n, H, D]
