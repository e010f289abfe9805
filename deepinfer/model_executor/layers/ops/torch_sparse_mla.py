"""Sparse attention over shared K = V latent rows with a sink (DeepSeek-V4), PyTorch reference.

`decode_mla_mqa_sparse` has the contract of the book's decode call (listing 3.12): the queries,
the window cache with one index row per query, optionally an extra cache (compressed rows) with
its own index rows, the softmax scale and the per-head sink. It is non-causal: it applies no mask
of its own, so the index rows decide everything a query reads, and -1 marks padding. A GPU
kernel replacing it keeps this signature. `indexer_scores` is the lightning indexer's score sum
that picks the compressed rows such a call reads. Both are torch hooks of layers/kernel_set.py.
"""

from __future__ import annotations

import torch


def attention_over_parts(q: torch.Tensor, parts, sink_logits: torch.Tensor, scale: float) -> torch.Tensor:
    """One softmax over several row sets plus a per-head sink logit (which contributes no value).

    q [T, H, D]; parts: (rows, valid) pairs with valid [T, L] bool and rows either [L, D], shared by
    all T queries (a prefill chunk's window, HCA rows), or [T, L, D], one list per query (decode
    windows, CSA picks). K = V. No causal mask is applied: `valid` is the mask. A query with no
    valid row and a sink of -inf gets a zero output. -> [T, H, D]
    """
    logits = []
    for rows, valid in parts:
        spec = "thd,ld->thl" if rows.dim() == 2 else "thd,tld->thl"
        part = torch.einsum(spec, q.float(), rows.float()) * scale  # [T, H, L]
        logits.append(part.masked_fill(~valid[:, None, :], float("-inf")))
    sink = sink_logits.float()[None, :, None].expand(q.shape[0], -1, 1)  # [T, H, 1]
    probs = torch.softmax(torch.cat([*logits, sink], dim=-1), dim=-1).nan_to_num(0.0)  # [T, H, sum L + 1]
    out, start = torch.zeros(q.shape, dtype=torch.float32, device=q.device), 0  # [T, H, D]
    for (rows, _), part in zip(parts, logits, strict=True):
        p = probs[..., start:start + part.shape[-1]]  # [T, H, L]
        start += part.shape[-1]
        out += torch.einsum("thl,ld->thd" if rows.dim() == 2 else "thl,tld->thd", p, rows.float())
    return out.to(q.dtype)  # [T, H, D]


def load_latent(cache, index: torch.Tensor) -> torch.Tensor:
    """Rows of a LayerCache holding one K = V latent row per slot: index [...] -> [..., D]."""
    return cache.load(index)[..., 0, 0, :]  # [..., D]


def decode_mla_mqa_sparse(q: torch.Tensor, key_cache, indices_in_kvcache: torch.Tensor, softmax_scale: float,
                          attn_sink: torch.Tensor, key_cache_extra=None,
                          indices_in_kvcache_extra: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D]; indices_in_kvcache [N, L] slots of key_cache (-1: none); optionally
    indices_in_kvcache_extra [N, L2] slots of key_cache_extra. One softmax over both row sets and
    the sink; K = V, so the values are the rows read. -> [N, H, D]"""
    parts = [(load_latent(key_cache, indices_in_kvcache).to(q.dtype), indices_in_kvcache >= 0)]
    if key_cache_extra is not None and indices_in_kvcache_extra is not None:
        rows = load_latent(key_cache_extra, indices_in_kvcache_extra).to(q.dtype)  # [N, L2, D]
        parts.append((rows, indices_in_kvcache_extra >= 0))
    return attention_over_parts(q, parts, attn_sink, softmax_scale)  # [N, H, D]


def indexer_scores(q: torch.Tensor, index_keys: torch.Tensor, weights: torch.Tensor,
                   softmax_scale: float) -> torch.Tensor:
    """I(p, w) = sum_h w_h(p) * ReLU(q_h(p) . K_w) * scale. q [n, h, d], index_keys [R, d] (one
    request's) or [n, R, d] (each query's own request's), weights [n, h] -> scores [n, R] (fp32)."""
    spec = "nhd,rd->nhr" if index_keys.dim() == 2 else "nhd,nrd->nhr"
    dots = torch.einsum(spec, q.float(), index_keys.float())  # [n, h, R]
    dots = torch.relu(dots) * softmax_scale  # [n, h, R]
    return (dots * weights[:, :, None]).sum(dim=1)  # [n, R]
