"""StepPlan -> packed input tensors and per-cache-group attention metadata.

Rows on the packed token axis: decode queries first, then one segment per prefill chunk. Every
address comes from `ops/addressing.py`: a token group's store slots and read indices (paged or
ring), and a compressed group's row slots and read indices (one row per m tokens). Models and
attention layers only read what is built here.

Built on the CPU from one pass over the plan's Python ints, with whole-batch tensor ops: no
tensor per request (except each prefill chunk's loads and DeepSeek-V4's per-span rows, which the
contract lists per request) and no host sync; then moved to the device at once: one copy of
one packed, pinned buffer (attention/transfer.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.plan import StepPlan, is_decode
from deepinfer.model_executor.layers.attention.backend import (
    AttentionMetadata,
    CompressedGroupMetadata,
    GroupMetadata,
    PrefillSegment,
    RequestSpan,
    move_step,
)
from deepinfer.model_executor.layers.ops.addressing import (
    num_rows,
    padded_tables,
    paged_read_index,
    paged_slot,
    paged_slots,
    ring_slot,
    visible_rows,
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
    lora_slots: torch.Tensor | None = None  # [T] each row's LoRA slot (-1: none); None: no adapter this step
    # a picture model's step: (rows [P], embeds [P, hidden]) taking pictures' encoder output (worker/picture_rows.py)
    picture_rows: tuple[torch.Tensor, torch.Tensor] | None = None


def num_logits_rows(s) -> int:
    """How many logits rows a sampling request s needs: k + 1 for a verification step, else 1."""
    return s.num_tokens if s.verify else 1


@dataclass
class _Batch:
    """The plan in packed order: decodes first, then prefill segments. The per-row tensors are
    built once, with whole-batch ops, from one pass over the plan's Python ints.

        ordered   d0   d1   d2   | seg0 (n=4)      | seg1 (n=2)
        starts    0    1    2      3                 7              (then T = 9)
        owner     0    1    2      3   3   3   3     4   4
        positions p0   p1   p2     s0 s0+1 ..        s1 s1+1
    """

    decodes: list
    segments: list
    starts: list[int]  # first packed row of each request (packed order), then T
    owner: torch.Tensor  # [T] which request (index into `ordered`) each packed row belongs to
    positions: torch.Tensor  # [T] position of each packed row
    num_decode_tokens: int  # rows [0, N) are decode queries

    @property
    def ordered(self) -> list:
        return self.decodes + self.segments

    @property
    def q_pos(self) -> torch.Tensor:
        return self.positions[:self.num_decode_tokens]  # [N] decode query positions

    @property
    def q_req(self) -> torch.Tensor:
        return self.owner[:self.num_decode_tokens]  # [N] which decode request each query belongs to

    @property
    def segment_starts(self) -> list[int]:
        return self.starts[len(self.decodes):-1]


def _owners(starts: list[int]) -> torch.Tensor:
    """[T] the request of each packed row: a 1 where each later request starts, summed.
    (torch.repeat_interleave does the same but takes ~8 ms on this CPU build, even for T = 32.)"""
    num_tokens = starts[-1]
    marks = torch.zeros(num_tokens, **_LONG)  # [T]
    later = torch.tensor([st for st in starts[1:-1] if st < num_tokens], **_LONG)  # [n - 1]
    return marks.index_add_(0, later, torch.ones_like(later)).cumsum_(0)  # [T]


def _batch(plan) -> _Batch:
    decodes = [s for s in plan.scheduled if is_decode(s)]
    segments = [s for s in plan.scheduled if not is_decode(s)]
    ordered = decodes + segments
    counts = [s.num_tokens for s in ordered]
    starts = list(itertools.accumulate(counts, initial=0))
    num_tokens = starts[-1]
    owner = _owners(starts)  # [T]
    shift = torch.tensor([s.start_pos - start for s, start in zip(ordered, starts, strict=False)], **_LONG)  # [n]
    positions = shift[owner] + torch.arange(num_tokens)  # [T]
    return _Batch(decodes, segments, starts, owner, positions, sum(counts[:len(decodes)]))


class _GroupAddressing:
    """One group's addresses (its table = block ids, or its state id) for the requests of a batch."""

    def __init__(self, group: CacheGroupSpec, unit_index: int):
        self.group, self.unit_index = group, unit_index
        self.ring = group.is_ring
        self.R = group.rows_per_unit

    def unit(self, s):
        return s.state_ids[self.unit_index] if self.ring else s.block_ids[self.unit_index]

    def units(self, requests) -> torch.Tensor:
        """[n] state ids (ring) or [n, B] 0-padded block tables (paged) of `requests`."""
        if self.ring:
            return torch.tensor([self.unit(s) for s in requests], **_LONG)  # [n]
        return padded_tables([self.unit(s) for s in requests])  # [n, B]

    def slots(self, s, rows: torch.Tensor) -> torch.Tensor:
        """Flat slots of rows [n] of one request s (token positions, or compressed row ids)."""
        if self.ring:
            return ring_slot(self.unit(s), rows, self.R)  # [n]
        return paged_slot(torch.tensor(self.unit(s), **_LONG), rows, self.R)  # [n]

    def packed_slots(self, units: torch.Tensor, owner: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Flat slots of rows [m] of requests owner [m] (indices into `units`, from `units()`)."""
        if self.ring:
            return ring_slot(units[owner], rows, self.R)  # [m]
        return paged_slots(units, owner, rows, self.R)  # [m]

    def load_positions(self, s) -> torch.Tensor:
        first = max(0, s.start_pos - self.group.window + 1) if self.ring else 0
        return torch.arange(first, s.start_pos, **_LONG)  # [n_old]

    def stored_from(self, s) -> int:
        """A chunk longer than the ring stores only its last S rows (each slot written once)."""
        end = s.start_pos + s.num_tokens
        return max(s.start_pos, end - self.R) if self.ring else s.start_pos


def _decode_index(addr: _GroupAddressing, batch: _Batch, units: torch.Tensor) -> torch.Tensor:
    """Read index rows [N, L] of every decode query, -1 past its visible rows."""
    g = addr.group
    if addr.ring:
        meta = prepare_decode_metadata(batch.q_pos, units[batch.q_req], g.window, g.rows_per_unit)
        return get_kv_index(meta.offset, meta.swa_len, g.window, g.rows_per_unit)  # [N, W]
    width = max(s.start_pos + s.num_tokens for s in batch.decodes)  # rows the last query sees
    return paged_read_index(units[batch.q_req], batch.q_pos, addr.R, width=width)  # [N, L]


def _store_rows(addr: _GroupAddressing, batch: _Batch) -> torch.Tensor | None:
    """Packed rows a ring group stores when some chunk is longer than its ring (None: all rows)."""
    skipped = [addr.stored_from(s) - s.start_pos for s in batch.segments]
    if not any(skipped):
        return None
    first = torch.tensor([0] * len(batch.decodes) + skipped, **_LONG)  # [n] rows skipped per request
    offset = torch.arange(batch.starts[-1]) - torch.tensor(batch.starts[:-1], **_LONG)[batch.owner]  # [T]
    return (offset >= first[batch.owner]).nonzero()[:, 0]  # [M]


def _prefill_segment(addr: _GroupAddressing, s, start: int, units: torch.Tensor, i: int) -> PrefillSegment:
    """One chunk's packed rows and the cached rows it attends to (read before its store)."""
    old = addr.load_positions(s)  # [n_old]
    slots = ring_slot(addr.unit(s), old, addr.R) if addr.ring else paged_slot(units[i], old, addr.R)  # [n_old]
    return PrefillSegment(start, start + s.num_tokens, slots, old)


def _token_group(addr: _GroupAddressing, batch: _Batch) -> GroupMetadata:
    """Store slots, decode read indices and prefill loads of a full-attention or ring group."""
    units = addr.units(batch.ordered)  # [n] or [n, B]
    rows = _store_rows(addr, batch) if addr.ring else None
    owner, positions = (batch.owner, batch.positions) if rows is None else (batch.owner[rows], batch.positions[rows])
    first = len(batch.decodes)
    prefills = [_prefill_segment(addr, s, start, units, first + j)
                for j, (s, start) in enumerate(zip(batch.segments, batch.segment_starts, strict=True))]
    paged_decodes = batch.decodes and not addr.ring
    return GroupMetadata(window=addr.group.window if addr.ring else None,
                         store_slots=addr.packed_slots(units, owner, positions), store_rows=rows,
                         decode_index=_decode_index(addr, batch, units) if batch.decodes else None,
                         prefills=prefills,
                         decode_lens=visible_rows(batch.q_pos, 1) if paged_decodes else None)  # [N]


def _compressed_group(addr: _GroupAddressing, batch: _Batch, num_decode_spans: int) -> CompressedGroupMetadata:
    """Row slots, the slots of rows completed this step, and per-query read indices of a paged
    group with one row per m tokens (query p reads rows 0 .. (p+1)//m - 1). The contract is
    per span, so this loops over the requests (DeepSeek-V4 only)."""
    m = addr.group.compress_ratio
    tables = addr.units(batch.ordered)  # [n, B]
    span_rows, store_slots, span_index = [], [], []
    for i, (s, start) in enumerate(zip(batch.ordered, batch.starts, strict=False)):
        end = s.start_pos + s.num_tokens
        rows = paged_slot(tables[i], torch.arange(num_rows(end, m), **_LONG), addr.R)  # [R]
        span_rows.append(rows)
        store_slots.append(rows[num_rows(s.start_pos, m):])  # [r]
        table = tables[i:i + 1].expand(s.num_tokens, -1)  # [n, B]
        span_index.append(paged_read_index(table, batch.positions[start:start + s.num_tokens], addr.R, m,
                                           width=num_rows(end, m)))  # [n, R]
    decode_rows = None
    if num_decode_spans:
        width = max(num_rows(s.start_pos + 1, m) for s in batch.decodes[:num_decode_spans])
        decode_rows = paged_read_index(tables[:num_decode_spans], batch.q_pos[:num_decode_spans], addr.R, m,
                                       width=width)  # [N, L]
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
             for s, start in zip(batch.ordered, batch.starts, strict=False)]
    return AttentionMetadata(positions=batch.positions, num_decode_tokens=batch.num_decode_tokens, groups=groups,
                             spans=spans, num_decode_spans=nb)


def build_group_metadata(scheduled: list, addressing: list[_GroupAddressing]) -> tuple[AttentionMetadata, list]:
    """Metadata of `addressing`'s groups alone for requests `scheduled` (e.g. a draft module's
    own ring), and the order the requests take on the packed axis (decodes first)."""
    batch = _batch(StepPlan(list(scheduled)))
    return build_attention_metadata(batch, addressing), list(zip(batch.ordered, batch.starts, strict=False))


class PassMetadata:
    """A drafting pass's metadata builder (contracts/drafting.py `PassMetadata`): one-request spans
    -> `build_group_metadata` over `addressing` (the drafter's groups), moved to `device`."""

    def __init__(self, addressing: list[_GroupAddressing], device: torch.device):
        self.addressing, self.device = addressing, device

    def __call__(self, scheduled: list) -> tuple[AttentionMetadata, list]:
        md, order = build_group_metadata(scheduled, self.addressing)
        return (md if self.device.type == "cpu" else md.to(self.device)), order


def build_step_inputs(plan, addressing: list[_GroupAddressing], device: torch.device,
                      pack: bool | None = None) -> StepInputs:
    """The plan's packed ids and positions, every group's metadata, and the rows that sample.

    On any device but the CPU (or with `pack=True`) every tensor travels in one host-to-device
    copy and is a view of one buffer there (`move_step`); on the CPU they stay as built."""
    batch = _batch(plan)
    md = build_attention_metadata(batch, addressing)
    ids = torch.tensor([t for s in batch.ordered for t in s.token_ids], **_LONG)  # [T]
    spans = list(zip(batch.ordered, batch.starts, strict=False))
    rows = [s for s, _ in spans if s.do_sample]
    sample_index = torch.tensor([i for s, start in spans if s.do_sample
                                 for i in range(start + s.num_tokens - num_logits_rows(s), start + s.num_tokens)],
                                **_LONG)  # [M]
    lora_slots = _lora_slots(batch)  # [T] or None
    extra = [ids, sample_index] + ([lora_slots] if lora_slots is not None else [])
    if pack is None:
        pack = device.type != "cpu"
    if pack:
        md, extra = move_step(md, extra, device, force=True)
    return StepInputs(extra[0], md.positions, md, rows, extra[1], spans, extra[2] if lora_slots is not None else None)


def _lora_slots(batch: _Batch) -> torch.Tensor | None:
    """[T] the LoRA slot of each packed row (-1: no adapter); None when no request has one."""
    per_request = [s.lora_slot for s in batch.ordered]
    if all(slot < 0 for slot in per_request):
        return None
    return torch.tensor(per_request, **_LONG)[batch.owner]  # [T]
