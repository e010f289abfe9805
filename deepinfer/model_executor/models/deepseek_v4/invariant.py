"""DeepSeek-V4 attention under DEEPINFER_BATCH_INVARIANT: which rows each query reads, and where.

Every query, decode or prefill, goes through one function, `invariant_attention.latent_block_attention`,
over two row lists of its own, so its bits depend on neither the batch nor where its chunk was cut:

- its window: the visible window rows in blocks of KEY_BLOCK at absolute position offsets (the
  decode layout of attention/invariant.py). Decode reads them through its ring index row; a
  prefill query takes them from [loaded | chunk], the chunk's rows as the cache returns them;
- its compressed rows (CSA / HCA layers): every visible row (HCA) or the indexer's picks (CSA), in
  ascending row id, then padding, in blocks of KEY_BLOCK.

The sink joins the one softmax. Queries are done in sub-batches of a bounded number of
(query, row) pairs; each query's result is its own, so the split changes no bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.attention.invariant import decode_layout, first_visible
from deepinfer.model_executor.layers.invariant_attention import (
    DECODE_PAIR_BUDGET,
    latent_block_attention,
    padded_width,
    query_slices,
)
from deepinfer.model_executor.layers.ops.torch_sparse_mla import load_latent


def as_cached_rows(cache, rows: torch.Tensor) -> torch.Tensor:
    """Latent rows [n, D] as a later read of `cache` returns them (MXFP8 / bf16 rows round)."""
    codec = cache.codec
    return codec.decode(codec.encode(rows[:, None, :], None))[:, 0, 0, :].to(rows.dtype)  # [n, D]


def window_local_index(q_pos: torch.Tensor, first_pos: int, window: int) -> torch.Tensor:
    """Each query's visible window rows, oldest first, as indices into rows that hold the
    consecutive positions first_pos, first_pos + 1, ... (-1 past its rows). q_pos [n] -> [n, W']."""
    first = first_visible(q_pos, window)  # [n]
    count = q_pos - first + 1  # [n]
    cols = torch.arange(int(count.max()), device=q_pos.device)  # [W']
    return torch.where(cols < count[:, None], first[:, None] - first_pos + cols, -1)  # [n, W']


def _compressed_part(cache, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [n, L] (ascending row ids, then -1) -> (rows [n, L', D], visible [n, L']), L' whole blocks."""
    index = F.pad(index, (0, padded_width(index.shape[1]) - index.shape[1]), value=-1)  # [n, L']
    return load_latent(cache, index), index >= 0


def decode_attention(q: torch.Tensor, window_cache, window_index: torch.Tensor, q_pos: torch.Tensor, window: int,
                     sink: torch.Tensor, scale: float, rows_cache=None, rows_index: torch.Tensor | None = None):
    """Decode queries q [N, H, D] at q_pos [N]: the ring rows of window_index [N, W] (visible slots
    in position order, then -1) and the compressed rows of rows_index [N, L] (ascending row ids,
    then -1) -> [N, H, D]."""
    layout = decode_layout(window_index, q_pos, window)
    width = layout.index.shape[1] + (rows_index.shape[1] if rows_index is not None else 0)
    out = torch.empty_like(q)  # [N, H, D]
    for sub in query_slices(q.shape[0], width, DECODE_PAIR_BUDGET):
        parts = [(load_latent(window_cache, layout.index[sub]), layout.visible[sub])]
        if rows_index is not None:
            parts.append(_compressed_part(rows_cache, rows_index[sub]))
        out[sub] = latent_block_attention(q[sub], parts, sink, scale)
    return out


def prefill_attention(q: torch.Tensor, window_rows: torch.Tensor, q_pos: torch.Tensor, window: int,
                      sink: torch.Tensor, scale: float, rows_cache=None, rows_index: torch.Tensor | None = None):
    """A chunk's queries q [n, H, D] at consecutive q_pos [n]: window_rows [n_old + n, D] are
    [loaded | chunk] (positions up to the chunk's last, the chunk as cached); rows_index [n, L]
    as in `decode_attention`. Each query reads the same rows in the same layout as a decode read
    would -> [n, H, D]."""
    first_pos = int(q_pos[-1]) + 1 - window_rows.shape[0]
    layout = decode_layout(window_local_index(q_pos, first_pos, window), q_pos, window)
    width = layout.index.shape[1] + (rows_index.shape[1] if rows_index is not None else 0)
    out = torch.empty_like(q)  # [n, H, D]
    for sub in query_slices(q.shape[0], width, DECODE_PAIR_BUDGET):
        visible = layout.visible[sub]  # [n', L]
        parts = [(window_rows[layout.index[sub].clamp(min=0)], visible)]  # [n', L, D]
        if rows_index is not None:
            parts.append(_compressed_part(rows_cache, rows_index[sub]))
        out[sub] = latent_block_attention(q[sub], parts, sink, scale)
    return out
