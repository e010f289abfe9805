"""StepPlan -> packed input tensors and per-cache-group attention metadata.

Rows on the packed token axis: decode queries first, then one segment per prefill chunk. Every
address comes from `ops/addressing.py`: a token group's store slots and read indices (paged or
ring), and a compressed group's row slots and read indices (one row per m tokens). Models and
attention layers only read what is built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.plan import StepPlan
from deepinfer.model_executor.layers.attention.backend import (
    AttentionMetadata,
    CompressedGroupMetadata,
    GroupMetadata,
    PrefillSegment,
    RequestSpan,
)
from deepinfer.model_executor.layers.ops.addressing import (
    num_rows,
    padded_tables,
    paged_read_index,
    paged_slot,
    ring_slot,
)
from deepinfer.model_executor.layers.ops.decode_metadata import get_kv_index, prepare_decode_metadata

_LONG = dict(dtype=torch.long)


@dataclass
class StepInputs:
    """One step's model inputs: packed ids and positions, the attention metadata, and which
    requests sample: a plain one its last token's row on the packed axis, a verification step
    all its k + 1 rows (`sample_index`, in `sample_rows` order)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_rows: list  # the ScheduledRequests that sample, in logits-row order
    sample_index: torch.Tensor  # [M] packed rows whose logits are computed (M >= len(sample_rows))
    spans: list  # (ScheduledRequest, first packed row) of every request, in packed order


def num_logits_rows(s) -> int:
    """How many logits rows a sampling request s needs: k + 1 for a verification step, else 1."""
    return s.num_tokens if s.verify else 1


def is_decode(s) -> bool:
    """Store-then-read steps: one new token, or a verification step's k+1 tokens."""
    return s.start_pos > 0 and (s.num_tokens == 1 or s.verify)


def _positions(s) -> torch.Tensor:
    return torch.arange(s.start_pos, s.start_pos + s.num_tokens, **_LONG)  # [n]


@dataclass
class _Batch:
    """The plan in packed order: decodes first, then prefill segments, with their offsets."""

    decodes: list
    segments: list
    starts: list[int]  # first packed row of each request (packed order)
    q_pos: torch.Tensor  # [N] decode query positions
    q_req: torch.Tensor  # [N] which decode request each decode query belongs to

    @property
    def ordered(self) -> list:
        return self.decodes + self.segments

    @property
    def segment_starts(self) -> list[int]:
        return self.starts[len(self.decodes):]


def _batch(plan) -> _Batch:
    decodes = [s for s in plan.scheduled if is_decode(s)]
    segments = [s for s in plan.scheduled if not is_decode(s)]
    ends = torch.tensor([s.num_tokens for s in decodes + segments], **_LONG).cumsum(0).tolist()
    q_pos = torch.cat([_positions(s) for s in decodes]) if decodes else torch.empty(0, **_LONG)
    q_req = torch.cat([torch.full((s.num_tokens,), i, **_LONG) for i, s in enumerate(decodes)]) \
        if decodes else torch.empty(0, **_LONG)
    return _Batch(decodes, segments, [0] + ends[:-1], q_pos, q_req)


class _GroupAddressing:
    """One group's addresses for one request (its table = block ids, or its state id)."""

    def __init__(self, group: CacheGroupSpec, unit_index: int):
        self.group, self.unit_index = group, unit_index
        self.ring = group.is_ring
        self.R = group.rows_per_unit

    def unit(self, s):
        return s.state_ids[self.unit_index] if self.ring else s.block_ids[self.unit_index]

    def slots(self, s, rows: torch.Tensor) -> torch.Tensor:
        """Flat slots of rows [n] of request s (token positions, or compressed row ids)."""
        if self.ring:
            return ring_slot(self.unit(s), rows, self.R)
        return paged_slot(torch.tensor(self.unit(s), **_LONG), rows, self.R)

    def load_positions(self, s) -> torch.Tensor:
        first = max(0, s.start_pos - self.group.window + 1) if self.ring else 0
        return torch.arange(first, s.start_pos, **_LONG)  # [n_old]

    def stored_from(self, s) -> int:
        """A chunk longer than the ring stores only its last S rows (each slot written once)."""
        end = s.start_pos + s.num_tokens
        return max(s.start_pos, end - self.R) if self.ring else s.start_pos

    def tables(self, requests) -> torch.Tensor:
        return padded_tables([self.unit(s) for s in requests])  # [n, B]


def _decode_index(addr: _GroupAddressing, batch: _Batch) -> torch.Tensor:
    """Read index rows [N, L] of every decode query, -1 past its visible rows."""
    g = addr.group
    if addr.ring:
        sids = torch.tensor([addr.unit(s) for s in batch.decodes], **_LONG)[batch.q_req]  # [N]
        meta = prepare_decode_metadata(batch.q_pos, sids, g.window, g.rows_per_unit)
        return get_kv_index(meta.offset, meta.swa_len, g.window, g.rows_per_unit)  # [N, W]
    return paged_read_index(addr.tables(batch.decodes)[batch.q_req], batch.q_pos, addr.R)  # [N, L]


def _token_group(addr: _GroupAddressing, batch: _Batch) -> GroupMetadata:
    """Store slots, decode read indices and prefill loads of a full-attention or ring group."""
    store_rows, store_slots, prefills = [], [], []
    if batch.decodes:
        store_rows.append(torch.arange(len(batch.q_pos), **_LONG))
        store_slots.append(torch.cat([addr.slots(s, _positions(s)) for s in batch.decodes]))
    for s, start in zip(batch.segments, batch.segment_starts, strict=True):
        stored = torch.arange(addr.stored_from(s), s.start_pos + s.num_tokens, **_LONG)  # [m]
        store_rows.append(start + stored - s.start_pos)
        store_slots.append(addr.slots(s, stored))
        old = addr.load_positions(s)
        prefills.append(PrefillSegment(start, start + s.num_tokens, addr.slots(s, old), old))
    rows = torch.cat(store_rows)
    all_rows = rows.numel() == sum(s.num_tokens for s in batch.ordered)
    return GroupMetadata(window=addr.group.window if addr.ring else None, store_slots=torch.cat(store_slots),
                         store_rows=None if all_rows else rows,
                         decode_index=_decode_index(addr, batch) if batch.decodes else None, prefills=prefills)


def _compressed_group(addr: _GroupAddressing, batch: _Batch, num_decode_spans: int) -> CompressedGroupMetadata:
    """Row slots, the slots of rows completed this step, and per-query read indices of a paged
    group with one row per m tokens (query p reads rows 0 .. (p+1)//m - 1)."""
    m = addr.group.compress_ratio
    span_rows, store_slots, span_index = [], [], []
    for s in batch.ordered:
        end = s.start_pos + s.num_tokens
        rows = addr.slots(s, torch.arange(num_rows(end, m), **_LONG))  # [R]
        span_rows.append(rows)
        store_slots.append(rows[num_rows(s.start_pos, m):])  # [r]
        table = addr.tables([s]).expand(s.num_tokens, -1)  # [n, B]
        span_index.append(paged_read_index(table, _positions(s), addr.R, m))  # [n, R]
    decode_rows = None
    if num_decode_spans:
        decodes = batch.decodes[:num_decode_spans]
        decode_rows = paged_read_index(addr.tables(decodes), batch.q_pos[:num_decode_spans], addr.R, m)  # [N, L]
    return CompressedGroupMetadata(m, span_rows, store_slots, span_index, decode_rows)


def group_addressing(groups: list[CacheGroupSpec]) -> list[_GroupAddressing]:
    """Paged groups take block_ids[0], [1], ... in order; ring groups take state_ids likewise."""
    counters = {True: 0, False: 0}
    out = []
    for g in groups:
        out.append(_GroupAddressing(g, counters[g.is_ring]))
        counters[g.is_ring] += 1
    return out


def _one_token_decodes(batch: _Batch) -> int:
    """N when the decode queries are N requests of one token each (batched together), else 0."""
    return len(batch.decodes) if batch.decodes and all(s.num_tokens == 1 for s in batch.decodes) else 0


def build_attention_metadata(batch: _Batch, addressing: list[_GroupAddressing]) -> AttentionMetadata:
    """Metadata for every group (token groups and compressed groups) and the request spans."""
    nb = _one_token_decodes(batch)
    groups = [_compressed_group(a, batch, nb) if a.group.compress_ratio > 1 else _token_group(a, batch)
              for a in addressing]
    spans = [RequestSpan(start, start + s.num_tokens, s.start_pos, tuple(s.state_ids), s.verify)
             for s, start in zip(batch.ordered, batch.starts, strict=True)]
    positions = torch.cat([_positions(s) for s in batch.ordered])  # [T]
    return AttentionMetadata(positions=positions, num_decode_tokens=int(batch.q_pos.numel()), groups=groups,
                             spans=spans, num_decode_spans=nb)


def build_group_metadata(scheduled: list, addressing: list[_GroupAddressing]) -> tuple[AttentionMetadata, list]:
    """Metadata of `addressing`'s groups alone for requests `scheduled` (e.g. a draft module's
    own ring), and the order the requests take on the packed axis (decodes first)."""
    batch = _batch(StepPlan(list(scheduled)))
    return build_attention_metadata(batch, addressing), list(zip(batch.ordered, batch.starts, strict=True))


def build_step_inputs(plan, addressing: list[_GroupAddressing], device: torch.device) -> StepInputs:
    """The plan's packed ids and positions, every group's metadata, and the rows that sample."""
    batch = _batch(plan)
    md = build_attention_metadata(batch, addressing)
    ids = [t for s in batch.ordered for t in s.token_ids]
    spans = list(zip(batch.ordered, batch.starts, strict=True))
    rows = [s for s, _ in spans if s.do_sample]
    end = {id(s): start + s.num_tokens for s, start in spans}
    sample_index = torch.tensor([i for s in rows for i in range(end[id(s)] - num_logits_rows(s), end[id(s)])],
                                **_LONG)  # [M]
    if device.type != "cpu":
        md, sample_index = md.to(device), sample_index.to(device, non_blocking=True)
    return StepInputs(torch.tensor(ids, **_LONG).to(device), md.positions, md, rows, sample_index, spans)
