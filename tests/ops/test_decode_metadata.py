"""The vectorized decode metadata and kv index equal the book's scalar semantics."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.model_executor.layers.ops import swa_addressing as scalar
from deepinfer.model_executor.layers.ops.decode_metadata import get_kv_index, prepare_decode_metadata


def test_book_trace_w128_s134_state2():
    pos = torch.tensor([127, 128, 133, 134])
    meta = prepare_decode_metadata(pos, torch.full((4,), 2), 128, 134)
    index = get_kv_index(meta.offset, meta.swa_len, 128, 134)
    assert meta.write_slot.tolist() == [395, 396, 401, 268]
    assert index[:, 0].tolist() == [268, 269, 274, 275]  # first read slot
    assert index[:, -1].tolist() == [395, 396, 401, 268]  # last read slot
    assert index[3, -2].item() == 401  # wraps from the end of state 2's block to its start


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(0, 12), st.integers(0, 5),
       st.lists(st.integers(0, 300), min_size=1, max_size=8))
def test_vectorized_equals_scalar(window, extra, state, positions):
    ring = window + extra
    pos = torch.tensor(positions)
    sids = torch.full_like(pos, state)
    meta = prepare_decode_metadata(pos, sids, window, ring)
    index = get_kv_index(meta.offset, meta.swa_len, window, ring)
    for i, p in enumerate(positions):
        ref = scalar.decode_metadata(p, state, window, ring)
        assert (meta.swa_len[i], meta.window_start[i], meta.offset[i], meta.write_slot[i]) == \
            (ref.swa_len, ref.window_start, ref.offset, ref.write_slot)
        assert index[i].tolist() == scalar.read_index_row(p, state, window, ring)
