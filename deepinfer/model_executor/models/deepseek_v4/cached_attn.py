"""DeepSeek-V4 attention over the engine's caches.

Every layer keeps its latent K = V row per token in the ring group (the window). A CSA or HCA
layer also emits compressed rows into a paged group with a compression ratio (one row per m
tokens), and a CSA layer's indexer emits index keys into a third group. Per step::

    q, q_residual = queries(x)                      [T, H, D], [T, q_lora_rank]
    kv            = kv_rows(x)                      [T, D]          the ring's row, K = V
    window        = each prefill chunk loads its old window rows, then kv is stored in the ring
    compressors   projections for all T tokens at once; then the pooling with each request's state
                  slot (decode requests of one token: all together; other spans one by one)
                  -> store the rows it completes
                  HCA: every visible row;  CSA: the indexer's top-k rows    -> index rows [n, L]
    decode        decode_mla_mqa_sparse(q, ring, window index rows, scale, sinks,
                                        compressed cache, compressed index rows)   (the book's call)
    prefill chunk one softmax over [loaded | chunk] rows (shared, masked by position), the HCA rows
                  (shared, masked) or the CSA picks (per query), and the sink
    out           = output(attention)                                              [T, hidden]

Rows shared by a chunk's queries are kept once with a mask (`attention_over_parts`), never
copied per query, so a long prompt costs logits [n, H, L], not gathered rows [n, L, D].
A compressed row is read back from the cache after it is stored, so a query reads the same
bytes whether its row was written in this step or an earlier one (MXFP8 included). Rows a
query may not see are never gathered: -1 in an index marks padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.model_executor.forward_context import get_forward_context
from deepinfer.model_executor.layers.attention.sparse_mla import decode_mla_mqa_sparse, load_latent
from deepinfer.model_executor.layers.attention.torch_ref import visibility
from deepinfer.model_executor.models.deepseek_v4.attn import SLIDING, DeepseekV4Attention
from deepinfer.model_executor.models.deepseek_v4.compressor import CSA, HCA, CSACompressor, HCACompressor
from deepinfer.model_executor.models.deepseek_v4.indexer import num_visible_rows
from deepinfer.model_executor.models.deepseek_v4.state_bank import StateBank


def paged_slots(table: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of row ids [...] in a block table [blocks]; -1 stays -1."""
    if table.numel() == 0:  # no row yet: every entry is padding
        return torch.full_like(rows, -1)
    return table_slots(table[None], rows.reshape(1, -1), block_size).view(rows.shape)  # [...]


@dataclass
class CompressedRead:
    """The compressed rows a span's queries read: index [n, L] slots (-1: none). `shared_slots`
    [L] is set when every query's column j is that slot or -1 (HCA): the rows are then loaded
    once for the whole span."""

    index: torch.Tensor
    shared_slots: torch.Tensor | None = None

    def part(self, cache, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [L, D] shared or [n, L, D] per query, valid [n, L]) for `attention_over_parts`."""
        slots = self.index if self.shared_slots is None else self.shared_slots
        return load_latent(cache, slots).to(dtype), self.index >= 0


def _store(cache, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [n, D] -> the cache, one latent row per slot."""
    cache.store(slots, rows[:, None, :], None)


class CachedV4Attention(DeepseekV4Attention):
    """One V4 layer's attention with its compressor; the model runner binds the caches."""

    def __init__(self, config, layer_idx: int):
        layer_type = config.layer_types[layer_idx]
        super().__init__(config, layer_type)
        self.layer_idx, self.layer_type = layer_idx, layer_type
        self.sliding_window = config.sliding_window
        self.num_kv_heads = 1
        if layer_type not in (SLIDING, CSA, HCA):
            raise ValueError(f"layer_types[{layer_idx}]={layer_type!r}; expected {SLIDING}, {CSA} or {HCA}")
        self.compressor = CSACompressor(config) if layer_type == CSA else \
            HCACompressor(config) if layer_type == HCA else None
        self.window_cache = self.rows_cache = self.index_cache = None  # LayerCaches, bound later
        self.window_group = self.rows_group = self.index_group = None  # metadata / block-table indices
        self.rows_block_size = self.index_block_size = 0  # rows per block of those groups
        self.states: dict[str, StateBank] = {}  # compressor name -> per-slot state

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata
        q, q_residual = self.queries(hidden, positions)  # [T, H, D], [T, q_lora_rank]
        kv = self.kv_rows(hidden, positions)  # [T, D]
        chunk_windows = self.store_window(kv, md)
        extra, reads = self.compressed_reads(hidden, q_residual, md) if self.compressor is not None else (None, {})
        out = torch.empty_like(q)  # [T, H, D]
        nd = md.num_decode_tokens
        if nd:  # decode queries: everything through index rows, batched
            if extra is None and reads:
                extra = _pad_cat([reads[sp.token_start].index for sp in md.spans if sp.token_start < nd])  # [N, L_c]
            out[:nd] = decode_mla_mqa_sparse(q[:nd], self.window_cache, md.groups[self.window_group].decode_index,
                                             self.scale, self.sinks, self.rows_cache, extra)
        for seg, window in zip(md.groups[self.window_group].prefills, chunk_windows, strict=True):
            s, e = seg.token_start, seg.token_end
            parts = [window] + ([reads[s].part(self.rows_cache, hidden.dtype)] if reads else [])
            out[s:e] = self.attend_parts(q[s:e], parts)
        return self.output(out, positions)  # [T, hidden]

    # ---- the window (ring group) -------------------------------------------------------------
    def store_window(self, kv: torch.Tensor, md) -> list:
        """Load each prefill chunk's old window rows, then store this step's rows (in that order).
        Returns per chunk the rows [n_old + n, D] of [loaded | chunk], which its queries share, and
        their visibility [n, n_old + n]. Decode queries read the ring later, through index rows."""
        g, cache = md.groups[self.window_group], self.window_cache
        loaded = [load_latent(cache, seg.load_slots) for seg in g.prefills]  # 1. load before store
        _store(cache, g.store_slots, kv if g.store_rows is None else kv[g.store_rows])  # 2. store
        chunks = []
        for seg, old in zip(g.prefills, loaded, strict=True):
            s, e = seg.token_start, seg.token_end
            key_pos = torch.cat([seg.load_positions, md.positions[s:e]])  # [n_old + n]
            visible = visibility(md.positions[s:e], key_pos, self.sliding_window)  # [n, n_old + n]
            chunks.append((torch.cat([old.to(kv.dtype), kv[s:e]]), visible))
        return chunks

    # ---- compressed rows (paged groups with a ratio) --------------------------------------------
    def compressed_reads(self, hidden: torch.Tensor, q_residual: torch.Tensor, md):
        """Compress every request's new tokens, store the rows they complete, and say which
        compressed rows each query reads. Returns (decode index [N, L] or None, {first packed row
        of a span: `CompressedRead`}): when every decode request has one token, they are done
        together (`decode_batch`); other spans one by one."""
        reads = {}
        rows_in = self.compressor.project(hidden, md.positions)  # kv, score [T, C]: one matmul per step
        index_in = self._index_inputs(hidden, q_residual, md.positions) if self.layer_type == CSA else None
        nb = _one_token_decodes(md)
        decode_index = self.decode_batch(rows_in, index_in, md, nb) if nb else None
        for span in md.spans[nb:]:
            s, e = span.token_start, span.token_end
            positions = md.positions[s:e]
            row_count = self._compress(self.compressor, "rows", self.rows_cache, self.rows_group,
                                       self.rows_block_size, [t[s:e] for t in rows_in], span)
            table = span.block_tables[self.rows_group]
            if self.layer_type == CSA:
                picks = self._select([t[s:e] for t in index_in], positions, span, row_count)  # [n, k]
                reads[s] = CompressedRead(paged_slots(table, picks, self.rows_block_size))
            else:  # HCA: every visible row; the same slots for all queries of the span
                cols = torch.arange(row_count, device=hidden.device)  # [R]
                slots = paged_slots(table, cols, self.rows_block_size)  # [R]
                seen = num_visible_rows(positions, self.compressor.compress_rate)  # [n]
                index = slots[None, :].expand(e - s, -1).masked_fill(cols[None, :] >= seen[:, None], -1)  # [n, R]
                reads[s] = CompressedRead(index, slots)
        return decode_index, reads

    def decode_batch(self, rows_in, index_in, md, n: int) -> torch.Tensor:
        """The first n spans, one decode token each, in one pass: compress (state slots in a
        batch), store completed rows, then the index rows [n, L] each query reads."""
        spans = md.spans[:n]
        slot_ids, positions = [sp.state_ids[0] for sp in spans], [sp.start_pos for sp in spans]
        tables = md.span_tables[self.rows_group][:n]  # [n, B]
        self._step_batch(self.compressor, "rows", self.rows_cache, tables, self.rows_block_size, slot_ids,
                         positions, [t[:n] for t in rows_in])
        seen = num_visible_rows(md.positions[:n], self.compressor.compress_rate)  # [n] = each one's row count
        cols = torch.arange(max((p + 1) // self.compressor.compress_rate for p in positions),
                            device=seen.device)[None, :].expand(n, -1)  # [n, R]
        if self.layer_type == CSA:
            kv, score, q, weights = (t[:n] for t in index_in)
            index_tables = md.span_tables[self.index_group][:n]  # [n, B_i]
            self._step_batch(self.compressor.indexer, "index", self.index_cache, index_tables, self.index_block_size,
                             slot_ids, positions, (kv, score))
            keys = load_latent(self.index_cache, table_slots(index_tables, cols, self.index_block_size))  # [n, R, d]
            picks = self.compressor.indexer.select_with(q, weights, md.positions[:n], keys)  # [n, k]
        else:
            picks = cols.masked_fill(cols >= seen[:, None], -1)  # [n, R]
        return table_slots(tables, picks, self.rows_block_size)  # [n, L]

    def _step_batch(self, compressor, name: str, cache, tables, block_size: int, slot_ids, positions,
                    projected) -> None:
        rows, which, row_ids = self.states[name].step_tokens(compressor, slot_ids, positions, *projected)
        if rows.shape[0]:
            _store(cache, table_slots(tables[which], row_ids[:, None], block_size)[:, 0], rows)

    def _index_inputs(self, hidden, q_residual, positions) -> tuple[torch.Tensor, ...]:
        """The indexer's per-token inputs for the whole step: its compressor's kv and score
        [T, C], its queries [T, h, d] and head weights [T, h]."""
        indexer = self.compressor.indexer
        kv, score = indexer.project(hidden, positions)
        return kv, score, indexer.queries(q_residual, positions), indexer.scorer.head_weights(hidden)

    def _compress(self, compressor, name: str, cache, table_index: int, block_size: int, projected, span) -> int:
        """Pool one request's projected span (kv, score) with its state; store the rows it
        completes. Returns the request's row count."""
        bank = self.states[name]
        state = bank.read(span.state_ids[0], span.start_pos)
        new_rows, row_ids, state = compressor.compress_projected(*projected, span.start_pos, state)
        if new_rows.shape[0]:
            slots = paged_slots(span.block_tables[table_index], row_ids, block_size)  # [r]
            _store(cache, slots, new_rows)
        bank.write(span.state_ids[0], state)
        return state.num_rows

    def _select(self, index_in, positions, span, row_count: int) -> torch.Tensor:
        """The indexer's top-k visible rows [n, k] (-1 pad), scored against the cached index keys."""
        indexer = self.compressor.indexer
        kv, score, q, weights = index_in
        self._compress(indexer, "index", self.index_cache, self.index_group, self.index_block_size, (kv, score), span)
        cols = torch.arange(row_count, device=q.device)  # [R]
        table = span.block_tables[self.index_group]
        keys = load_latent(self.index_cache, paged_slots(table, cols, self.index_block_size))  # [R, d]
        return indexer.select_with(q, weights, positions, keys)  # [n, k]


def table_slots(tables: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of row ids [n, L] in each query's block table tables [n, B]; -1 stays -1."""
    safe = rows.clamp(min=0)  # [n, L]
    slots = tables.gather(1, safe // block_size) * block_size + safe % block_size  # [n, L]
    return slots.masked_fill(rows < 0, -1)


def _one_token_decodes(md) -> int:
    """N when the N decode queries are N requests of one token each (the batched path), else 0."""
    n = md.num_decode_tokens
    if n and len(md.spans) >= n and all(sp.token_end - sp.token_start == 1 for sp in md.spans[:n]):
        return n
    return 0


def _pad_cat(indexes: list[torch.Tensor]) -> torch.Tensor:
    """Index rows [n_i, L_i] of consecutive spans -> [sum n_i, max L_i], padded with -1."""
    width = max(i.shape[1] for i in indexes)
    return torch.cat([F.pad(i, (0, width - i.shape[1]), value=-1) for i in indexes])  # [N, L]
