"""Ring addressing (listings 3.9, 3.10) and overwrite hazards (§3.5) on the book's numbers."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.model_executor.layers.ops.swa_addressing import (
    DecodeMetadata,
    StoreHazard,
    check_ring_fits_drafts,
    decode_metadata,
    kv_index_row,
    logical_range,
    overwrite_free_ring_size,
    overwritten_rows_per_query,
    prefill_store_hazards,
    read_index_row,
    read_slot_bounds,
    required_swa_block_size,
    ring_fits_drafts,
    state_slots,
    write_slot,
)

W, S = 128, 134


@pytest.mark.parametrize(("pos", "span", "bounds", "write"), [
    (127, (0, 127), (268, 395), 395),
    (128, (1, 128), (269, 396), 396),
    (133, (6, 133), (274, 401), 401),
    (134, (7, 134), (275, 268), 268),
])
def test_book_ring_trace(pos, span, bounds, write):
    assert logical_range(pos, W) == span
    assert read_slot_bounds(pos, 2, W, S) == bounds
    assert write_slot(2, pos, S) == write


def test_state_two_owns_slots_268_to_401():
    assert state_slots(2, S) == range(268, 402)


def test_read_row_at_the_ring_boundary_wraps_to_the_block_start():
    row = read_index_row(134, 2, W, S)
    assert row == list(range(275, 402)) + [268]


def test_decode_metadata_fields():
    assert decode_metadata(134, 2, W, S) == DecodeMetadata(
        swa_len=128, window_start=7, offset=275, length=128, write_slot=268)
    assert decode_metadata(5, 2, W, S) == DecodeMetadata(6, 0, 268, 6, 273)


def test_exercise_state_three_at_position_134():
    first, last = read_slot_bounds(134, 3, W, S)
    assert (first, last, write_slot(3, 134, S)) == (409, 402, 402)
    row = [i for i in read_index_row(134, 3, W, S) if i != -1]
    assert not set(row) & set(state_slots(2, S))


def test_partial_window_pads_with_minus_one():
    row = read_index_row(2, 0, 4, 6)
    assert row == [0, 1, 2, -1]


def test_kv_index_row_wraps_inside_the_block_of_its_offset():
    # offset 9 lies in state 1 of a ring of 6 (slots 6..11): 9, 10, 11, then 6, 7.
    assert kv_index_row(offset=9, length=5, window_size=5, swa_block_size=6) == [9, 10, 11, 6, 7]
    assert kv_index_row(offset=9, length=2, window_size=5, swa_block_size=6) == [9, 10, -1, -1, -1]


@pytest.mark.parametrize(("call", "match"), [
    (lambda: decode_metadata(10, 0, 128, 100), "swa_block_size=100.*window_size=128"),
    (lambda: decode_metadata(-1, 0, 4, 6), "pos.*-1"),
    (lambda: decode_metadata(3, -2, 4, 6), "state_id.*-2"),
    (lambda: read_index_row(3, 0, 0, 6), "window_size.*0"),
    (lambda: kv_index_row(0, 7, 4, 6), "length=7"),
    (lambda: prefill_store_hazards(3, 5, 6, 4), "chunk_end=4"),
])
def test_bad_inputs_name_field_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- hazard (a): verification stores k + 1 rows before reading ---------------------------------

@pytest.mark.parametrize(("ring", "counts"), [
    (128, [5, 4, 3, 2, 1, 0]),
    (133, [0, 0, 0, 0, 0, 0]),
    (134, [0, 0, 0, 0, 0, 0]),
])
def test_book_overwrite_counts(ring, counts):
    assert overwritten_rows_per_query(W, ring, num_drafts=5) == counts


def test_overwrite_bounds():
    assert overwrite_free_ring_size(128, 5) == 133
    assert required_swa_block_size(128, 5) == 134
    assert ring_fits_drafts(128, 134, 5) and not ring_fits_drafts(128, 133, 5)


def test_check_ring_fits_drafts_names_w_s_and_k():
    check_ring_fits_drafts(128, 134, 5)
    with pytest.raises(ValueError) as info:
        check_ring_fits_drafts(128, 133, 5)
    assert all(part in str(info.value) for part in ("W=128", "S=133", "k=5", "134"))


# --- hazard (b): a prefill chunk stored before the old window is loaded ------------------------

def test_book_prefill_chunk_through_7():
    hazards = prefill_store_hazards(window_size=3, swa_block_size=5, chunk_start=4, chunk_end=7)
    assert hazards == [StoreHazard(0, 0, 5, ()), StoreHazard(1, 1, 6, ()), StoreHazard(2, 2, 7, (4,))]
    assert [(h.position, h.needed_by) for h in hazards if h.harmful] == [(2, (4,))]


def test_book_prefill_chunk_through_6_is_harmless():
    assert not any(h.harmful for h in prefill_store_hazards(3, 5, 4, 6))


def test_exercise_prefill_chunk_through_8():
    # Position 3 (slot 3) is destroyed by the store of 8; queries 4 and 5 still read it.
    harmful = [h for h in prefill_store_hazards(3, 5, 4, 8) if h.harmful]
    assert harmful == [StoreHazard(2, 2, 7, (4,)), StoreHazard(3, 3, 8, (4, 5))]


def test_prefill_hazards_use_the_state_block():
    assert prefill_store_hazards(3, 5, 4, 7, state_id=2)[-1] == StoreHazard(2, 12, 7, (4,))


# --- properties ---------------------------------------------------------------------------------

rings = st.integers(1, 64).flatmap(lambda w: st.tuples(st.just(w), st.integers(w, w + 40)))


@given(ring=rings, state_id=st.integers(0, 50), pos=st.integers(0, 2000))
def test_read_row_stays_in_the_state_block(ring, state_id, pos):
    window, size = ring
    block = state_slots(state_id, size)
    row = read_index_row(pos, state_id, window, size)
    assert len(row) == window
    assert all(i == -1 or i in block for i in row)


@given(ring=rings, state_id=st.integers(0, 50), pos=st.integers(0, 2000))
def test_partial_windows_count_valid_columns(ring, state_id, pos):
    window, size = ring
    row = read_index_row(pos, state_id, window, size)
    valid = min(pos + 1, window)
    assert sum(i != -1 for i in row) == valid
    assert row[valid:] == [-1] * (window - valid)


@given(ring=rings, state_id=st.integers(0, 50), pos=st.integers(0, 2000))
def test_read_row_is_the_window_write_slots(ring, state_id, pos):
    window, size = ring
    row = read_index_row(pos, state_id, window, size)
    first = max(0, pos - window + 1)
    assert [i for i in row if i != -1] == [write_slot(state_id, q, size) for q in range(first, pos + 1)]
    assert read_slot_bounds(pos, state_id, window, size) == (row[0], write_slot(state_id, pos, size))


@given(size=st.integers(1, 200), a=st.integers(0, 100), b=st.integers(0, 100),
       p=st.integers(0, 5000), q=st.integers(0, 5000))
def test_no_slot_is_shared_between_states(size, a, b, p, q):
    if a != b:
        assert write_slot(a, p, size) != write_slot(b, q, size)
        assert not set(state_slots(a, size)) & set(state_slots(b, size))


@settings(max_examples=60)
@given(window=st.integers(1, 40), extra=st.integers(-10, 10), drafts=st.integers(0, 8))
def test_small_rings_are_detected(window, extra, drafts):
    size = max(1, window + drafts + 1 + extra)
    fits = size >= window + drafts + 1
    assert ring_fits_drafts(window, size, drafts) is fits
    if fits:
        check_ring_fits_drafts(window, size, drafts)
    else:
        with pytest.raises(ValueError) as info:
            check_ring_fits_drafts(window, size, drafts)
        assert all(f"{name}={value} " in str(info.value) for name, value in (("W", window), ("S", size)))
        assert f"k={drafts}:" in str(info.value)


@settings(max_examples=60)
@given(window=st.integers(1, 40), extra=st.integers(0, 12), drafts=st.integers(0, 8))
def test_overwrite_counts_match_the_derived_bound(window, extra, drafts):
    # In steady state query p+i loses max(0, W + k - S - i) rows; none once S >= W + k.
    size = max(1, window + extra - 4)
    counts = overwritten_rows_per_query(window, size, drafts)
    assert counts == [max(0, min(window, window + drafts - size - i)) for i in range(drafts + 1)]
    assert (not any(counts)) == (size >= overwrite_free_ring_size(window, drafts))


@settings(max_examples=60)
@given(window=st.integers(1, 12), extra=st.integers(0, 6), start=st.integers(0, 40), n=st.integers(1, 30))
def test_prefill_hazards_agree_with_a_direct_check(window, extra, start, n):
    size, end = window + extra, start + n - 1
    hazards = prefill_store_hazards(window, size, start, end)
    old = range(max(0, start - size), start)
    written = {q % size for q in range(start, end + 1)}
    assert [h.position for h in hazards] == sorted(o for o in old if o % size in written)
    for h in hazards:
        assert h.needed_by == tuple(q for q in range(start, end + 1) if q - window + 1 <= h.position)
