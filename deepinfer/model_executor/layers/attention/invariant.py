"""Batch-invariant attention (DEEPINFER_BATCH_INVARIANT): where each query's keys sit, and the
two implementations of the rule.

Every query, decode or prefill, reduces over its visible keys in blocks of KEY_BLOCK at absolute
position offsets (position x in block x // B), from the block of its first visible key; hidden
columns weigh exactly 0. Two implementations, each giving a query the same bits in decode and in
prefill, in any batch and any chunking (they do not give each other's bits):

    torch   decode reads its index row shifted right by its first key's offset in its block; a
            prefill chunk lays [loaded | chunk] out once and all its queries share it; the
            numerics (`per_query_attention`, `shared_key_attention`) live in
            `layers/batch_invariant.py`. A step's layouts are the same for every layer of a cache
            group: the first layer builds them, the others reuse them (`StepLayouts`).
    C++     `decode_attention` / `prefill_attention` below (ops/invariant_cpu.cpp through
            ops/fused.py): per (query, KV head), the query's keys cut into chunks of 512 at
            absolute positions, each chunk's partial (max, sum of exp, weighted values) in blocks
            of KEY_BLOCK, the partials merged in chunk order by one formula (split across threads
            or not, the same bits); for fp32 queries on the CPU over plain (fp32 / bf16) or int8
            (q8) cache rows; any other call class runs the torch implementation, which these ops
            wrap as their reference. Both ops pick from the same class (q and the cache), so
            decode and prefill never mix them.

A layer's options (attention/layer.py) take part in both: the soft-cap on each scaled logit
(elementwise `tanh`, the same bits at any position), the sink logit in each query's max and as
the first term of its denominator (`per_query_attention` / `shared_key_attention` take both).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from deepinfer.model_executor.layers.invariant_attention import (
    DECODE_PAIR_BUDGET,
    KEY_BLOCK,
    PREFILL_PAIR_BUDGET,
    padded_width,
    per_query_attention,
    query_slices,
    shared_key_attention,
)
from deepinfer.model_executor.layers.ops import fused


def first_visible(q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n] the first position each query sees: p - W + 1 (window), else 0; never below 0."""
    return (q_pos - window + 1).clamp(min=0) if window is not None else torch.zeros_like(q_pos)


@dataclass
class DecodeLayout:
    index: torch.Tensor  # [N, L] slots, each row shifted right by its first key's offset in its block; -1 hidden
    visible: torch.Tensor  # [N, L] index >= 0


def decode_layout(kv_index: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> DecodeLayout:
    """kv_index [N, L0] (each query's visible slots in position order, then -1), q_pos [N]."""
    return decode_layout_from(kv_index, first_visible(q_pos, window))


def decode_layout_from(kv_index: torch.Tensor, first: torch.Tensor) -> DecodeLayout:
    """kv_index [N, L0] whose column c holds position first[n] + c (first [N])."""
    shift = first % KEY_BLOCK  # [N]
    width = kv_index.shape[1]
    cols = torch.arange(padded_width(width + int(shift.max())), device=kv_index.device) - shift[:, None]  # [N, L]
    inside = (cols >= 0) & (cols < width)  # [N, L]
    index = torch.where(inside, kv_index.gather(1, cols.clamp(0, max(width - 1, 0))), -1)  # [N, L]
    return DecodeLayout(index, index >= 0)


@dataclass
class PrefillLayout:
    left: int  # zero rows before the first row of [loaded | chunk] (its position's offset in its block)
    width: int  # L: rows after padding, a multiple of KEY_BLOCK
    visible: torch.Tensor  # [n, L] column c holds position base + c
    first_block: torch.Tensor  # [n] block of each query's first visible key


def prefill_layout(q_pos: torch.Tensor, loaded_pos: torch.Tensor, window: int | None) -> PrefillLayout:
    """A chunk at positions q_pos [n] over loaded rows at loaded_pos [n_old] (consecutive, before it)."""
    start = int(loaded_pos[0]) if loaded_pos.numel() else int(q_pos[0])  # position of the first row
    base = start - start % KEY_BLOCK  # block boundary at or before it
    width = padded_width(int(q_pos[-1]) + 1 - base)
    key_pos = base + torch.arange(width, device=q_pos.device)  # [L]
    first = first_visible(q_pos, window)  # [n]
    visible = (key_pos >= first[:, None]) & (key_pos <= q_pos[:, None])  # [n, L]
    first_block = torch.div(first - base, KEY_BLOCK, rounding_mode="floor")  # [n]
    return PrefillLayout(start - base, width, visible, first_block)


def invariant_decode(cache, q: torch.Tensor, layout: DecodeLayout, scale: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D]: each query over its own cache rows -> [N, H, D]."""
    out = torch.empty_like(q)  # [N, H, D]
    for rows in query_slices(q.shape[0], layout.index.shape[1], DECODE_PAIR_BUDGET):
        kv = cache.load(layout.index[rows])  # [n, L, 2, H_kv, D]
        out[rows] = per_query_attention(q[rows], kv, layout.visible[rows], scale, softcap, sinks)
    return out


def as_cached(cache, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [n, H_kv, D] as a later read of the cache returns them -> [n, 2, H_kv, D]."""
    return cache.codec.decode(cache.codec.encode(k, v))


def invariant_prefill(cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, loaded: torch.Tensor,
                      layout: PrefillLayout, scale: float, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D], k, v [n, H_kv, D] of a chunk, loaded [n_old, 2, H_kv, D] -> [n, H, D]. The
    chunk's rows are taken as the cache returns them, so a later decode read sees the same bits."""
    chunk = as_cached(cache, k, v)  # [n, 2, H_kv, D]
    right = layout.width - layout.left - loaded.shape[0] - chunk.shape[0]
    rows = torch.cat((chunk.new_zeros(layout.left, *chunk.shape[1:]), loaded.to(chunk.dtype), chunk,
                      chunk.new_zeros(right, *chunk.shape[1:])))  # [L, 2, H_kv, D]
    out = torch.empty_like(q)  # [n, H, D]
    for sub in query_slices(q.shape[0], layout.width, PREFILL_PAIR_BUDGET):
        out[sub] = shared_key_attention(q[sub], rows, layout.visible[sub], layout.first_block[sub], scale, softcap,
                                        sinks)
    return out


def torch_decode_attention(cache, q: torch.Tensor, index: torch.Tensor, first: torch.Tensor, scale: float,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention`'s torch implementation: q [N, H, D], index [N, L] (column c at position
    first[n] + c, -1 hidden), first [N] -> [N, H, D]."""
    return invariant_decode(cache, q, decode_layout_from(index, first), scale, softcap, sinks)


def torch_prefill_attention(cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, loaded: torch.Tensor,
                            positions: torch.Tensor, start: int, window: int | None, scale: float,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`prefill_attention`'s torch implementation: a chunk at positions [n] over loaded rows at
    start .. start + n_old - 1 -> [n, H, D]."""
    loaded_pos = torch.arange(start, start + loaded.shape[0], device=positions.device)  # [n_old]
    layout = prefill_layout(positions, loaded_pos, window)
    return invariant_prefill(cache, q, k, v, loaded, layout, scale, softcap, sinks)


# The C++ kernels where they serve the call class, else the torch implementations above.
decode_attention = fused.invariant_decode_attention_op(torch_decode_attention)
prefill_attention = fused.invariant_prefill_attention_op(torch_prefill_attention)


def _dead_ref():
    return None


class StepLayouts:
    """The layouts of the step in flight, per (cache group, segment): built once, used by every layer."""

    def __init__(self):
        self._step = _dead_ref  # a weak reference to the AttentionMetadata they belong to
        self._layouts: dict[tuple[int, int], DecodeLayout | PrefillLayout | torch.Tensor] = {}

    def _current(self, metadata) -> dict:
        """The step's layouts. The step is held weakly: once its metadata is gone (the step is over),
        its layouts go too, so an idle engine keeps nothing of its last batch."""
        if self._step() is not metadata:
            layouts: dict = {}
            self._step, self._layouts = weakref.ref(metadata, lambda _: layouts.clear()), layouts
        return self._layouts

    def first(self, metadata, group) -> torch.Tensor:
        """[N_decode] the first position each decode query sees (its index row's column 0)."""
        layouts, key = self._current(metadata), (id(group), -2)
        if key not in layouts:
            layouts[key] = first_visible(metadata.positions[:metadata.num_decode_tokens], group.window)
        return layouts[key]

    def decode(self, metadata, group) -> DecodeLayout:
        layouts, key = self._current(metadata), (id(group), -1)
        if key not in layouts:
            nd = metadata.num_decode_tokens
            layouts[key] = decode_layout(group.decode_index, metadata.positions[:nd], group.window)
        return layouts[key]

    def prefill(self, metadata, group, i: int) -> PrefillLayout:
        layouts, key = self._current(metadata), (id(group), i)
        if key not in layouts:
            seg = group.prefills[i]
            q_pos = metadata.positions[seg.token_start:seg.token_end]  # [n]
            layouts[key] = prefill_layout(q_pos, seg.load_positions, group.window)
        return layouts[key]
