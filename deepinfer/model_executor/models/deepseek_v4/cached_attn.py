"""DeepSeek-V4 attention over the engine's caches.

Every layer keeps its latent K = V row per token in the ring group (the window). A CSA or HCA
layer also emits compressed rows into a paged group with a compression ratio (one row per m
tokens), and a CSA layer's indexer emits index keys into a third group. Per step::

    q, q_residual = queries(x)                      [T, H, D], [T, q_lora_rank]
    kv            = kv_rows(x)                      [T, D]          the ring's row, K = V
    window rows   = load old window -> store kv -> read through index rows     [T, W, D]
    per request:  compress_chunk(x of the span, its state slot) -> store new rows
                  HCA: every visible row;  CSA: the indexer's top-k visible rows  [T, L_c, D]
    out           = attend(q, [window | compressed], valid) with the sink -> output(out)

A compressed row is read back from the cache after it is stored, so a query reads the same
bytes whether its row was written in this step or an earlier one (MXFP8 included). Rows a
query may not see are never gathered: -1 in an index marks padding.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.forward_context import get_forward_context
from deepinfer.model_executor.models.deepseek_v4.attn import SLIDING, DeepseekV4Attention
from deepinfer.model_executor.models.deepseek_v4.compressor import CSA, HCA, CSACompressor, HCACompressor
from deepinfer.model_executor.models.deepseek_v4.indexer import num_visible_rows
from deepinfer.model_executor.models.deepseek_v4.state_bank import StateBank


def paged_slots(table: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of row ids [...] in a block table [blocks]; -1 stays -1."""
    if table.numel() == 0:  # no row yet: every entry is padding
        return torch.full_like(rows, -1)
    safe = rows.clamp(min=0)
    slots = table[safe // block_size] * block_size + safe % block_size  # [...]
    return slots.masked_fill(rows < 0, -1)


def _latent(cache, slots: torch.Tensor) -> torch.Tensor:
    """slots [...] -> the K = V latent rows [..., D] in the compute dtype."""
    return cache.load(slots)[..., 0, 0, :]  # [..., D]


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
        rows, valid = self.window_rows(kv, md)  # [T, W, D], [T, W]
        if self.compressor is not None:
            c_rows, c_valid = self.compressed_rows(hidden, q_residual, md)  # [T, L_c, D], [T, L_c]
            rows, valid = torch.cat([rows, c_rows], dim=1), torch.cat([valid, c_valid], dim=1)
        out = self.attend(q, rows, valid)  # [T, H, D]
        return self.output(out, positions)  # [T, hidden]

    # ---- the window (ring group) -------------------------------------------------------------
    def window_rows(self, kv: torch.Tensor, md) -> tuple[torch.Tensor, torch.Tensor]:
        """Load old window rows, store this step's rows, then each query's W rows and validity."""
        g, cache, W = md.groups[self.window_group], self.window_cache, self.sliding_window
        loaded = [_latent(cache, seg.load_slots) for seg in g.prefills]  # 1. load before store
        _store(cache, g.store_slots, kv if g.store_rows is None else kv[g.store_rows])  # 2. store
        rows = kv.new_zeros(kv.shape[0], W, kv.shape[1])  # [T, W, D]
        valid = torch.zeros(kv.shape[0], W, dtype=torch.bool, device=kv.device)  # [T, W]
        nd = md.num_decode_tokens
        if nd:  # 3. decode queries read through their index rows
            rows[:nd], valid[:nd] = _latent(cache, g.decode_index).to(kv.dtype), g.decode_index >= 0
        for seg, old in zip(g.prefills, loaded, strict=True):  # 4. prefill: [old | chunk]
            s, e = seg.token_start, seg.token_end
            rows[s:e], valid[s:e] = self._segment_window(torch.cat([old.to(kv.dtype), kv[s:e]]),
                                                         md.positions[s:e], int(md.positions[s]) - old.shape[0])
        return rows, valid

    def _segment_window(self, combined: torch.Tensor, q_pos: torch.Tensor, first_pos: int):
        """combined [n_old + n, D] rows of positions first_pos.. -> ([n, W, D], [n, W])."""
        offsets = torch.arange(1 - self.sliding_window, 1, device=q_pos.device)  # [W]
        idx = q_pos[:, None] + offsets[None, :] - first_pos  # [n, W]
        return combined[idx.clamp(min=0)], idx >= 0

    # ---- compressed rows (paged groups with a ratio) --------------------------------------------
    def compressed_rows(self, hidden: torch.Tensor, q_residual: torch.Tensor, md):
        """Per request: compress its span, store the new rows, pick what each query reads."""
        pieces = []
        for span in md.spans:
            s, e = span.token_start, span.token_end
            positions = md.positions[s:e]
            row_count = self._compress(self.compressor, "rows", self.rows_cache, self.rows_group,
                                       self.rows_block_size, hidden[s:e], span)
            table = span.block_tables[self.rows_group]
            if self.layer_type == CSA:
                picks = self._select(hidden[s:e], q_residual[s:e], positions, span, row_count)  # [n, k]
            else:
                cols = torch.arange(row_count, device=hidden.device)  # [R]
                seen = num_visible_rows(positions, self.compressor.compress_rate)  # [n]
                picks = cols[None, :].expand(e - s, -1).masked_fill(cols[None, :] >= seen[:, None], -1)  # [n, R]
            slots = paged_slots(table, picks, self.rows_block_size)  # [n, L]
            pieces.append((_latent(self.rows_cache, slots).to(hidden.dtype), picks >= 0))
        return _pad_cat(pieces, self.head_dim, hidden)

    def _compress(self, compressor, name: str, cache, table_index: int, block_size: int, hidden: torch.Tensor,
                  span) -> int:
        """Run one request's span through a compressor; store its new rows. Returns the row count."""
        bank = self.states[name]
        state = bank.read(span.state_ids[0], span.start_pos)
        new_rows, row_ids, state = compressor.compress_chunk(hidden, span.start_pos, state)
        if new_rows.shape[0]:
            slots = paged_slots(span.block_tables[table_index], row_ids, block_size)  # [r]
            _store(cache, slots, new_rows)
        bank.write(span.state_ids[0], state)
        return state.num_rows

    def _select(self, hidden, q_residual, positions, span, row_count: int) -> torch.Tensor:
        """The indexer's top-k visible rows [n, k] (-1 pad), scored against the cached index keys."""
        indexer = self.compressor.indexer
        self._compress(indexer, "index", self.index_cache, self.index_group, self.index_block_size, hidden, span)
        cols = torch.arange(row_count, device=hidden.device)  # [R]
        table = span.block_tables[self.index_group]
        keys = _latent(self.index_cache, paged_slots(table, cols, self.index_block_size))  # [R, d]
        return indexer.select(hidden, q_residual, positions, keys)  # [n, k]


def _pad_cat(pieces, head_dim: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[(rows [n_i, L_i, D], valid [n_i, L_i])] in packed order -> [T, max L, D], [T, max L]."""
    if not pieces:
        return like.new_zeros(0, 0, head_dim), torch.zeros(0, 0, dtype=torch.bool, device=like.device)
    width = max(r.shape[1] for r, _ in pieces)
    rows = [torch.nn.functional.pad(r, (0, 0, 0, width - r.shape[1])) for r, _ in pieces]  # [n_i, L, D]
    valid = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=False) for _, v in pieces]  # [n_i, L]
    return torch.cat(rows), torch.cat(valid)
