"""StepPlan -> packed input tensors and per-cache-group attention metadata.

Rows on the packed token axis: decode queries first, then one segment per prefill chunk.
Addresses are flat slots: a paged group's slot is block_table[p // bs] * bs + p % bs; a ring
group's is state_id * S + p % S (book listing 3.9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model_executor.layers.attention.backend import (
    AttentionMetadata,
    GroupMetadata,
    PrefillSegment,
    RequestSpan,
)
from deepinfer.model_executor.layers.ops.decode_metadata import get_kv_index, prepare_decode_metadata
from deepinfer.worker.cache_engine import CacheGroupSpec

_LONG = dict(dtype=torch.long)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_rows: list  # the ScheduledRequests that sample, in logits-row order
    sample_index: torch.Tensor  # [N] row of each one's last token on the packed axis


def is_decode(s) -> bool:
    """Store-then-read steps: one new token, or a verification step's k+1 tokens."""
    return s.start_pos > 0 and (s.num_tokens == 1 or s.verify)


def _positions(s) -> torch.Tensor:
    return torch.arange(s.start_pos, s.start_pos + s.num_tokens, **_LONG)  # [n]


class _GroupAddressing:
    """Flat slots of one group for one request (table = block ids, or the state id)."""

    def __init__(self, group: CacheGroupSpec, unit_index: int):
        self.group, self.unit_index = group, unit_index
        self.ring = group.kind == "ring"
        self.R = group.rows_per_unit

    def unit(self, s):
        return s.state_ids[self.unit_index] if self.ring else s.block_ids[self.unit_index]

    def slots(self, s, positions: torch.Tensor) -> torch.Tensor:
        if self.ring:
            return self.unit(s) * self.R + positions % self.R
        table = torch.tensor(self.unit(s), **_LONG)
        return table[positions // self.R] * self.R + positions % self.R

    def load_positions(self, s) -> torch.Tensor:
        first = max(0, s.start_pos - self.group.window + 1) if self.ring else 0
        return torch.arange(first, s.start_pos, **_LONG)  # [n_old]

    def stored_from(self, s) -> int:
        """A chunk longer than the ring stores only its last S rows (each slot written once)."""
        end = s.start_pos + s.num_tokens
        return max(s.start_pos, end - self.R) if self.ring else s.start_pos


def _decode_index(addr: _GroupAddressing, decodes, q_pos: torch.Tensor, q_req: torch.Tensor):
    """Read index rows [N, L] of every decode query, -1 past its visible rows."""
    g = addr.group
    if addr.ring:
        sids = torch.tensor([addr.unit(s) for s in decodes], **_LONG)[q_req]  # [N]
        meta = prepare_decode_metadata(q_pos, sids, g.window, g.rows_per_unit)
        return get_kv_index(meta.offset, meta.swa_len, g.window, g.rows_per_unit)  # [N, W]
    tables = [addr.unit(s) for s in decodes]
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], **_LONG)[q_req]  # [N, blocks]
    cols = torch.arange(int(q_pos.max()) + 1, **_LONG)  # [L]
    index = tables.gather(1, (cols // addr.R).expand(len(q_pos), -1)) * addr.R + cols % addr.R  # [N, L]
    return index.masked_fill(cols[None, :] > q_pos[:, None], -1)  # [N, L]


def _group_metadata(addr: _GroupAddressing, decodes, segments, q_pos, q_req, offsets) -> GroupMetadata:
    store_rows, store_slots, prefills = [], [], []
    if decodes:
        store_rows.append(torch.arange(len(q_pos), **_LONG))
        store_slots.append(torch.cat([addr.slots(s, _positions(s)) for s in decodes]))
    for s, start in zip(segments, offsets, strict=True):
        first = addr.stored_from(s)
        stored = torch.arange(first, s.start_pos + s.num_tokens, **_LONG)  # [m]
        store_rows.append(start + stored - s.start_pos)
        store_slots.append(addr.slots(s, stored))
        old = addr.load_positions(s)
        prefills.append(PrefillSegment(start, start + s.num_tokens, addr.slots(s, old), old))
    rows = torch.cat(store_rows)
    all_rows = rows.numel() == int(q_pos.numel()) + sum(s.num_tokens for s in segments)
    return GroupMetadata(window=addr.group.window if addr.ring else None, store_slots=torch.cat(store_slots),
                         store_rows=None if all_rows else rows,
                         decode_index=_decode_index(addr, decodes, q_pos, q_req) if decodes else None,
                         prefills=prefills)


def group_addressing(groups: list[CacheGroupSpec]) -> list[_GroupAddressing]:
    """Paged groups take block_ids[0], [1], ... in order; ring groups take state_ids likewise."""
    counters = {"paged": 0, "ring": 0}
    out = []
    for g in groups:
        out.append(_GroupAddressing(g, counters[g.kind]))
        counters[g.kind] += 1
    return out


def build_step_inputs(plan, addressing: list[_GroupAddressing], device: torch.device) -> StepInputs:
    decodes = [s for s in plan.scheduled if is_decode(s)]
    segments = [s for s in plan.scheduled if not is_decode(s)]
    ordered = decodes + segments
    q_pos = torch.cat([_positions(s) for s in decodes]) if decodes else torch.empty(0, **_LONG)
    q_req = torch.cat([torch.full((s.num_tokens,), i, **_LONG) for i, s in enumerate(decodes)]) \
        if decodes else torch.empty(0, **_LONG)
    ends = torch.tensor([s.num_tokens for s in ordered], **_LONG).cumsum(0).tolist()
    offsets = ends[len(decodes) - 1:-1] if decodes else [0] + ends[:-1]
    groups = [None if a.group.compress_ratio > 1 else _group_metadata(a, decodes, segments, q_pos, q_req, offsets)
              for a in addressing]
    starts = [0] + ends[:-1]
    compressed = any(a.group.compress_ratio > 1 for a in addressing)
    spans = [] if not compressed else [RequestSpan(start, end, s.start_pos, tuple(s.state_ids),
                         tuple(torch.tensor(t, **_LONG) for t in s.block_ids))
             for s, start, end in zip(ordered, starts, ends, strict=True)]
    positions = torch.cat([_positions(s) for s in ordered])
    ids = [t for s in ordered for t in s.token_ids]
    rows = [(s, end - 1) for s, end in zip(ordered, ends, strict=True) if s.do_sample]
    md = AttentionMetadata(positions=positions, num_decode_tokens=int(q_pos.numel()), groups=groups, spans=spans,
                           span_tables=_padded_tables(ordered) if compressed else ())
    inputs = StepInputs(torch.tensor(ids, **_LONG), positions, md, [s for s, _ in rows],
                        torch.tensor([i for _, i in rows], **_LONG))
    return inputs if device.type == "cpu" else _to_device(inputs, device)


def _padded_tables(ordered) -> tuple[torch.Tensor, ...]:
    """Every request's block table of each paged group as one [num_requests, max blocks] tensor (0-padded)."""
    out = []
    for g in range(len(ordered[0].block_ids)):
        width = max(1, max(len(s.block_ids[g]) for s in ordered))
        out.append(torch.tensor([s.block_ids[g] + [0] * (width - len(s.block_ids[g])) for s in ordered], **_LONG))
    return tuple(out)


def _to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    to = lambda t: None if t is None else t.to(device, non_blocking=True)
    md = inputs.attn_metadata
    for span in md.spans:
        span.block_tables = tuple(to(t) for t in span.block_tables)
    md.span_tables = tuple(to(t) for t in md.span_tables)
    for g in (g for g in md.groups if g is not None):
        g.store_slots, g.store_rows, g.decode_index = to(g.store_slots), to(g.store_rows), to(g.decode_index)
        for seg in g.prefills:
            seg.load_slots, seg.load_positions = to(seg.load_slots), to(seg.load_positions)
    md.positions = to(md.positions)
    return StepInputs(to(inputs.input_ids), md.positions, md, inputs.sample_rows, to(inputs.sample_index))
