"""A step's picture rows: the slices of each run its chunks hold, encoder outputs cached by content."""

from __future__ import annotations

import pytest
import torch

from deepinfer.contracts.multimodal import PictureInput
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.worker.picture_cache import PictureCache
from deepinfer.worker.picture_rows import PictureRows, picture_slices

HIDDEN = 3


class Encoder:
    """encode_pictures: picture rows [length, HIDDEN] whose values name the picture and the row."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def encode_pictures(self, pictures):
        self.calls.append([p.content_hash for p in pictures])
        return [torch.full((p.length, HIDDEN), float(int(p.content_hash))) + torch.arange(p.length)[:, None]
                for p in pictures]


def _sched(rid: str, start: int, num: int, pictures) -> ScheduledRequest:
    return ScheduledRequest(rid, [0] * num, start, ([],), pictures=tuple(pictures))


def test_chunks_take_slices_of_runs():
    a, b = PictureInput("100", 2, 5), PictureInput("200", 9, 4)  # runs [2, 7) and [9, 13)
    spans = [(_sched("x", 0, 4, [a, b]), 0), (_sched("x2", 4, 7, [a, b]), 4), (_sched("y", 20, 1, [a]), 11)]
    assert picture_slices(spans) == [(a, 2, 0, 2), (a, 4, 2, 5), (b, 9, 0, 2)]  # b's [11, 13) is a later chunk's


def test_rows_and_embeds_of_a_step():
    encoder = Encoder()
    rows = PictureRows(encoder, torch.device("cpu"))
    a = PictureInput("100", 2, 5)
    built = rows.build([(_sched("x", 3, 3, [a]), 7)])  # prompt [3, 6): run rows 1..3 at packed 7..9
    assert built[0].tolist() == [7, 8, 9]
    assert built[1][:, 0].tolist() == [101.0, 102.0, 103.0]
    assert rows.build([(_sched("x", 6, 4, [a]), 0)])[1][:, 0].tolist() == [104.0]  # the run's last row
    assert encoder.calls == [["100"]]  # encoded once for both chunks
    assert rows.build([(_sched("x", 30, 1, [a]), 0)]) is None  # a decode step holds no placeholder


def test_missing_pictures_encode_in_one_call_and_the_cache_is_bounded():
    encoder, cache = Encoder(), PictureCache(max_entries=2)
    pics = [PictureInput(str(h), 0, 2) for h in (1, 2, 3)]
    cache.rows(pics[:2], encoder.encode_pictures)
    cache.rows(pics[:1], encoder.encode_pictures)  # 1 read last: 2 is the least recent
    cache.rows(pics[2:], encoder.encode_pictures)
    assert encoder.calls == [["1", "2"], ["3"]]
    assert "1" in cache and "2" not in cache and "3" in cache and len(cache) == 2


def test_an_encoder_output_of_the_wrong_length_is_refused():
    class Short:
        def encode_pictures(self, pictures):
            return [torch.zeros(1, HIDDEN) for _ in pictures]

    with pytest.raises(ValueError, match="placeholder run of length 2"):
        PictureCache().rows([PictureInput("1", 0, 2)], Short().encode_pictures)
