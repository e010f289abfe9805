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
    decode        kernels.sparse_mla(q, ring, window index rows, scale, sinks,
                                     compressed cache, compressed index rows)   (the book's call,
                                     decode_mla_mqa_sparse, on the bound kernel set)
    prefill chunk one softmax over [loaded | chunk] rows (shared, masked by position), the HCA rows
                  (shared, masked) or the CSA picks (per query), and the sink
    out           = output(attention)                                              [T, hidden]

Rows shared by a chunk's queries are kept once with a mask (`attention_over_parts`), never
copied per query, so a long prompt costs logits [n, H, L], not gathered rows [n, L, D].
A compressed row is read back from the cache after it is stored, so a query reads the same
bytes whether its row was written in this step or an earlier one (MXFP8 included). Rows a
query may not see are never gathered: -1 in an index marks padding.

Verification spans (k + 1 tokens of which only a prefix may be accepted): the compressor state
they start from and their projections are kept for the step; `keep_verified` then replays the
kept prefix from that state, so the state ends as if only the accepted tokens had been computed.
Rows the rejected tokens completed stay in the paged cache past the request's row count, where
the accepted continuation overwrites them before any query can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from deepinfer.model_executor.forward_context import get_forward_context
from deepinfer.model_executor.layers.kernel_set import CPU_KERNELS, KernelSet
from deepinfer.model_executor.layers.ops.torch_attention import visibility
from deepinfer.model_executor.layers.ops.torch_sparse_mla import load_latent
from deepinfer.model_executor.models.deepseek_v4 import invariant
from deepinfer.model_executor.models.deepseek_v4.attn import SLIDING, DeepseekV4Attention
from deepinfer.model_executor.models.deepseek_v4.compressor import (
    CSA,
    HCA,
    CompressorState,
    CSACompressor,
    HCACompressor,
)
from deepinfer.model_executor.models.deepseek_v4.state_bank import StateBank


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


@dataclass
class _Verified:
    """A verification span's compressor input: the state it started from and its projections."""

    name: str
    compressor: object
    span: object  # RequestSpan
    state: CompressorState
    projected: tuple  # kv, score [n, C]


class CachedV4Attention(DeepseekV4Attention):
    """One V4 layer's attention with its compressor; the model runner binds the caches."""

    def __init__(self, config, layer_idx: int, layer_type: str | None = None):
        """`layer_type` defaults to `config.layer_types[layer_idx]` (an MTP block passes SLIDING)."""
        layer_type = layer_type or config.layer_types[layer_idx]
        super().__init__(config, layer_type)
        self.layer_idx, self.layer_type = layer_idx, layer_type
        self.sliding_window = config.sliding_window
        self.num_kv_heads = 1
        if layer_type not in (SLIDING, CSA, HCA):
            raise ValueError(f"layer {layer_idx} has layer type {layer_type!r}; expected {SLIDING}, {CSA} or {HCA}")
        self.compressor = CSACompressor(config) if layer_type == CSA else \
            HCACompressor(config) if layer_type == HCA else None
        self.window_cache = self.rows_cache = self.index_cache = None  # LayerCaches, bound later
        self.window_group = self.rows_group = self.index_group = None  # indices into the step's group metadata
        self.states: dict[str, StateBank] = {}  # compressor name -> per-slot state
        self.kernels: KernelSet = CPU_KERNELS  # store, sparse MLA (and the indexer's scores): set by bind_kernels
        self._verified: list[_Verified] = []  # this step's verification spans
        self.batch_invariant = False  # DEEPINFER_BATCH_INVARIANT: set by `set_batch_invariant`

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata
        self._verified = []
        q, q_residual = self.queries(hidden, positions)  # [T, H, D], [T, q_lora_rank]
        kv = self.kv_rows(hidden, positions)  # [T, D]
        chunk_windows = self.store_window(kv, md)
        extra, reads = self.compressed_reads(hidden, q_residual, md) if self.compressor is not None else (None, {})
        out = torch.empty_like(q)  # [T, H, D]
        nd = md.num_decode_tokens
        if nd:  # decode queries: everything through index rows, batched
            if extra is None and reads:
                extra = _pad_cat([reads[sp.token_start].index for sp in md.spans if sp.token_start < nd])  # [N, L_c]
            out[:nd] = self._decode(q[:nd], md, extra)
        for seg, window in zip(md.groups[self.window_group].prefills, chunk_windows, strict=True):
            s, e = seg.token_start, seg.token_end
            if self.batch_invariant:
                out[s:e] = invariant.prefill_attention(q[s:e], window[0], md.positions[s:e], self.sliding_window,
                                                       self.sinks, self.scale, self.rows_cache,
                                                       reads[s].index if reads else None)
                continue
            parts = [window] + ([reads[s].part(self.rows_cache, hidden.dtype)] if reads else [])
            out[s:e] = self.attend_parts(q[s:e], parts)
        return self.output(out, positions)  # [T, hidden]

    def _decode(self, q: torch.Tensor, md, extra: torch.Tensor | None) -> torch.Tensor:
        """Decode queries q [N, H, D] over their ring rows and compressed rows `extra` [N, L_c]."""
        index = md.groups[self.window_group].decode_index  # [N, W]
        if self.batch_invariant:
            return invariant.decode_attention(q, self.window_cache, index, md.positions[:q.shape[0]],
                                              self.sliding_window, self.sinks, self.scale, self.rows_cache, extra)
        return self.kernels.sparse_mla(q, self.window_cache, index, self.scale, self.sinks, self.rows_cache, extra)

    def set_batch_invariant(self, on: bool) -> None:
        """DEEPINFER_BATCH_INVARIANT: every query reads its rows through `invariant` (the same bits
        in decode and prefill, alone or batched), and the output projection, the compressors and
        the indexer take their invariant forms."""
        self.batch_invariant = self.o_a_proj.batch_invariant = on
        if self.compressor is not None:
            self.compressor.batch_invariant = on
        if self.layer_type == CSA:
            self.compressor.indexer.batch_invariant = self.compressor.indexer.scorer.batch_invariant = on

    def bind_kernels(self, kernels: KernelSet) -> None:
        """Run this layer's row stores, sparse MLA decode and (CSA) indexer scores on `kernels`."""
        self.kernels = kernels
        if self.layer_type == CSA:
            self.compressor.indexer.scorer.kernels = kernels

    def _store(self, cache, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [n, D] -> the cache, one latent row per slot."""
        self.kernels.store_rows(cache, slots, rows[:, None, :], None)

    # ---- the window (ring group) -------------------------------------------------------------
    def store_window(self, kv: torch.Tensor, md) -> list:
        """Load each prefill chunk's old window rows, then store this step's rows (in that order).
        Returns per chunk the rows [n_old + n, D] of [loaded | chunk], which its queries share, and
        their visibility [n, n_old + n]. Decode queries read the ring later, through index rows."""
        g, cache = md.groups[self.window_group], self.window_cache
        loaded = [load_latent(cache, seg.load_slots) for seg in g.prefills]  # 1. load before store
        self._store(cache, g.store_slots, kv if g.store_rows is None else kv[g.store_rows])  # 2. store
        chunks = []
        for seg, old in zip(g.prefills, loaded, strict=True):
            s, e = seg.token_start, seg.token_end
            key_pos = torch.cat([seg.load_positions, md.positions[s:e]])  # [n_old + n]
            visible = visibility(md.positions[s:e], key_pos, self.sliding_window)  # [n, n_old + n]
            new = invariant.as_cached_rows(cache, kv[s:e]) if self.batch_invariant else kv[s:e]  # [n, D]
            chunks.append((torch.cat([old.to(kv.dtype), new]), visible))
        return chunks

    # ---- compressed rows (paged groups with a ratio) --------------------------------------------
    def compressed_reads(self, hidden: torch.Tensor, q_residual: torch.Tensor, md):
        """Compress every request's new tokens, store the rows they complete, and say which
        compressed rows each query reads. Returns (decode index [N, L] or None, {first packed row
        of a span: `CompressedRead`}): when every decode request has one token, they are done
        together (`decode_batch`); other spans one by one. Every slot comes from the metadata."""
        reads = {}
        rows_md = md.groups[self.rows_group]
        rows_in = self.compressor.project(hidden, md.positions)  # kv, score [T, C]: one matmul per step
        index_in = self._index_inputs(hidden, q_residual, md.positions) if self.layer_type == CSA else None
        nb = md.num_decode_spans
        decode_index = self.decode_batch(rows_in, index_in, md, nb) if nb else None
        for i in range(nb, len(md.spans)):
            span = md.spans[i]
            s, e = span.token_start, span.token_end
            self._compress(self.compressor, "rows", self.rows_cache, rows_md.store_slots[i],
                           [t[s:e] for t in rows_in], span)
            if self.layer_type == CSA:
                index_md = md.groups[self.index_group]
                picks = self._select([t[s:e] for t in index_in], md.positions[s:e], span, index_md, i)  # [n, k]
                reads[s] = CompressedRead(rows_of(rows_md.span_rows[i], picks))  # [n, k]
            else:  # HCA: every visible row; the same slots for all queries of the span
                reads[s] = CompressedRead(rows_md.span_index[i], rows_md.span_rows[i])
        return decode_index, reads

    def decode_batch(self, rows_in, index_in, md, n: int) -> torch.Tensor:
        """The first n spans, one decode token each, in one pass: compress (state slots in a
        batch), store completed rows, then the index rows [n, L] each query reads."""
        spans = md.spans[:n]
        slot_ids, positions = [sp.state_ids[0] for sp in spans], [sp.start_pos for sp in spans]
        rows = md.groups[self.rows_group].decode_rows  # [n, L] every row each request sees
        self._step_batch(self.compressor, "rows", self.rows_cache, rows, slot_ids, positions, [t[:n] for t in rows_in])
        if self.layer_type != CSA:
            return rows  # HCA reads every visible row
        kv, score, q, weights = (t[:n] for t in index_in)
        keys_at = md.groups[self.index_group].decode_rows  # [n, L]
        self._step_batch(self.compressor.indexer, "index", self.index_cache, keys_at, slot_ids, positions, (kv, score))
        keys = load_latent(self.index_cache, keys_at)  # [n, L, d]
        picks = self.compressor.indexer.select_with(q, weights, md.positions[:n], keys)  # [n, k]
        return rows_of(rows, picks)  # [n, k]

    def _step_batch(self, compressor, name: str, cache, rows: torch.Tensor, slot_ids, positions, projected) -> None:
        """One token per request through the state bank; completed rows go to their slots in rows [n, L]."""
        new_rows, which, row_ids = self.states[name].step_tokens(compressor, slot_ids, positions, *projected)
        if new_rows.shape[0]:
            self._store(cache, rows[which, row_ids], new_rows)

    def _index_inputs(self, hidden, q_residual, positions) -> tuple[torch.Tensor, ...]:
        """The indexer's per-token inputs for the whole step: its compressor's kv and score
        [T, C], its queries [T, h, d] and head weights [T, h]."""
        indexer = self.compressor.indexer
        kv, score = indexer.project(hidden, positions)
        return kv, score, indexer.queries(q_residual, positions), indexer.scorer.head_weights(hidden)

    def _compress(self, compressor, name: str, cache, slots: torch.Tensor, projected, span) -> None:
        """Pool one request's projected span (kv, score) with its state; store the rows it
        completes at `slots` [r] (the metadata's slots of those rows)."""
        bank = self.states[name]
        state = bank.read(span.state_ids[0], span.start_pos)
        if span.verify:
            self._verified.append(_Verified(name, compressor, span, _cloned(state), tuple(projected)))
        new_rows, _, state = compressor.compress_projected(*projected, span.start_pos, state)
        if new_rows.shape[0] != slots.numel():
            raise RuntimeError(f"layer {self.layer_idx} {name}: the compressor completed {new_rows.shape[0]} rows, "
                               f"the step's metadata has {slots.numel()} slots for them")
        if new_rows.shape[0]:
            self._store(cache, slots, new_rows)
        bank.write(span.state_ids[0], state)

    def keep_verified(self, kept: dict[int, int]) -> None:
        """Rewind each verification span's compressor state to its kept prefix: the state it
        started from, advanced by the kept tokens' projections only (`kept`: first packed row of
        a span -> tokens kept)."""
        for v in self._verified:
            n = kept.get(v.span.token_start)
            if n is None or n == v.span.token_end - v.span.token_start:
                continue
            kv, score = (t[:n] for t in v.projected)
            _, _, state = v.compressor.compress_projected(kv, score, v.span.start_pos, v.state)
            self.states[v.name].write(v.span.state_ids[0], state)
        self._verified = []

    def _select(self, index_in, positions, span, index_md, i: int) -> torch.Tensor:
        """The indexer's top-k visible rows [n, k] (row ids, -1 pad), scored against the cached index keys."""
        indexer = self.compressor.indexer
        kv, score, q, weights = index_in
        self._compress(indexer, "index", self.index_cache, index_md.store_slots[i], (kv, score), span)
        keys = load_latent(self.index_cache, index_md.span_rows[i])  # [R, d]
        return indexer.select_with(q, weights, positions, keys)  # [n, k]


def _cloned(state: CompressorState) -> CompressorState:
    """A copy that the bank's later writes cannot change (read() returns views of the bank)."""
    return replace(state, kv=state.kv.clone(), score=state.score.clone(), prev_a_kv=state.prev_a_kv.clone(),
                   prev_a_score=state.prev_a_score.clone())


def rows_of(slots: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """The slots of picked row ids: slots [L] or [n, L] (row c's slot at column c), picks [n, k]
    (-1: none) -> [n, k], -1 kept."""
    if slots.shape[-1] == 0:  # no row yet: every pick is padding
        return torch.full_like(picks, -1)
    safe = picks.clamp(min=0)  # [n, k]
    taken = slots[safe] if slots.dim() == 1 else slots.gather(1, safe)  # [n, k]
    return taken.masked_fill(picks < 0, -1)


def _pad_cat(indexes: list[torch.Tensor]) -> torch.Tensor:
    """Index rows [n_i, L_i] of consecutive spans -> [sum n_i, max L_i], padded with -1."""
    width = max(i.shape[1] for i in indexes)
    return torch.cat([F.pad(i, (0, width - i.shape[1]), value=-1) for i in indexes])  # [N, L]
