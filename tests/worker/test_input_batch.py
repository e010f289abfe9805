"""The step's metadata, built with whole-batch tensor ops, equals a per-token scalar reference
(`swa_addressing` for rings, `paged_slot` on Python lists for paged groups) on random plans of
decodes, verification steps, first chunks and later chunks, including chunks longer than a ring."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.plan import ScheduledRequest, StepPlan
from deepinfer.model_executor.layers.ops import swa_addressing as scalar
from deepinfer.model_executor.layers.ops.addressing import paged_slot
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.input_batch import build_step_inputs, group_addressing, is_decode

CPU = torch.device("cpu")


@st.composite
def plans(draw):
    block, window = draw(st.sampled_from([2, 4, 16])), draw(st.integers(1, 12))
    ring = window + draw(st.integers(5, 8))  # S >= W + k + 1 for the up to 4 drafts below
    ratio = draw(st.sampled_from([1, 2, 4]))
    groups = [CacheGroupSpec("full", "paged", (0,), block), CacheGroupSpec("swa", "ring", (1,), ring, window)]
    if ratio > 1:
        groups.append(CacheGroupSpec("csa", "paged", (2,), block, None, compress_ratio=ratio))
    requests = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["decode", "verify", "prefill", "chunk"]))
        start = 0 if kind == "prefill" else draw(st.integers(1, 60))
        n = {"decode": 1, "verify": draw(st.integers(2, 5))}.get(kind) or draw(st.integers(1, 25))
        tables = tuple(draw(st.lists(st.integers(0, 99), min_size=-(-(start + n) // block),
                                     max_size=-(-(start + n) // block) + 1)) for g in groups if not g.is_ring)
        params = SamplingParams() if draw(st.booleans()) else None
        requests.append(ScheduledRequest(f"r{i}", [i] * n, start, tables, (draw(st.integers(0, 7)),),
                                         sampling_params=params, verify=kind == "verify"))
    return groups, requests


def _paged(table: list[int], row: int, block: int) -> int:
    return paged_slot(table, row, block)


def _packed(requests):
    """(request, first packed row) in packed order: decodes first, then the chunks."""
    ordered = [s for s in requests if is_decode(s)] + [s for s in requests if not is_decode(s)]
    starts = [sum(s.num_tokens for s in ordered[:i]) for i in range(len(ordered))]
    return list(zip(ordered, starts, strict=True))


def _check_token_group(g, md, group, packed):
    ring = group.is_ring
    decodes = [(s, start) for s, start in packed if is_decode(s)]
    rows, slots, index = [], [], []
    for s, start in packed:
        first = max(s.start_pos, s.start_pos + s.num_tokens - group.rows_per_unit) if ring else s.start_pos
        for p in range(first, s.start_pos + s.num_tokens):
            rows.append(start + p - s.start_pos)
            slots.append(scalar.write_slot(s.state_ids[0], p, group.rows_per_unit) if ring
                         else _paged(s.block_ids[0], p, group.rows_per_unit))
    width = max((s.start_pos + s.num_tokens for s, _ in decodes), default=0)
    for s, _ in decodes:
        for p in range(s.start_pos, s.start_pos + s.num_tokens):
            if ring:
                index.append(scalar.read_index_row(p, s.state_ids[0], group.window, group.rows_per_unit))
            else:
                index.append([_paged(s.block_ids[0], c, group.rows_per_unit) if c <= p else -1 for c in range(width)])
    assert g.store_slots.tolist() == slots
    assert (g.store_rows.tolist() if g.store_rows is not None else list(range(md.num_tokens))) == rows
    assert (g.decode_index.tolist() if g.decode_index is not None else []) == index
    chunks = [(s, start) for s, start in packed if not is_decode(s)]
    assert len(g.prefills) == len(chunks)
    for seg, (s, start) in zip(g.prefills, chunks, strict=True):
        old = list(range(max(0, s.start_pos - group.window + 1) if ring else 0, s.start_pos))
        assert (seg.token_start, seg.token_end, seg.load_positions.tolist()) == (start, start + s.num_tokens, old)
        assert seg.load_slots.tolist() == [scalar.write_slot(s.state_ids[0], p, group.rows_per_unit) if ring
                                           else _paged(s.block_ids[0], p, group.rows_per_unit) for p in old]


def _check_compressed_group(g, group, packed):
    m, block = group.compress_ratio, group.rows_per_unit
    for i, (s, _) in enumerate(packed):
        table, end = s.block_ids[1], s.start_pos + s.num_tokens
        rows = [_paged(table, r, block) for r in range(end // m)]
        assert g.span_rows[i].tolist() == rows
        assert g.store_slots[i].tolist() == rows[s.start_pos // m:]
        assert g.span_index[i].tolist() == [[rows[c] if c < (p + 1) // m else -1 for c in range(end // m)]
                                            for p in range(s.start_pos, end)]


@settings(max_examples=150, deadline=None)
@given(plans())
def test_vectorized_metadata_equals_the_scalar_reference(plan):
    groups, requests = plan
    inputs = build_step_inputs(StepPlan(requests), group_addressing(groups), CPU)
    packed = _packed(requests)
    md = inputs.attn_metadata
    assert inputs.input_ids.tolist() == [t for s, _ in packed for t in s.token_ids]
    assert md.positions.tolist() == [p for s, _ in packed for p in range(s.start_pos, s.start_pos + s.num_tokens)]
    assert md.num_decode_tokens == sum(s.num_tokens for s, _ in packed if is_decode(s))
    assert inputs.sample_index.tolist() == [r for s, start in packed if s.do_sample
                                            for r in range(start + s.num_tokens - (s.num_tokens if s.verify else 1),
                                                           start + s.num_tokens)]
    assert [(sp.token_start, sp.start_pos) for sp in md.spans] == [(start, s.start_pos) for s, start in packed]
    _check_token_group(md.groups[0], md, groups[0], packed)
    _check_token_group(md.groups[1], md, groups[1], packed)
    if len(groups) > 2:
        _check_compressed_group(md.groups[2], groups[2], packed)
