"""Prefix-cache keys of prompts with pictures: a unit holding (part of) a picture's run keys the
picture's content and place, so equal placeholder tokens never share a block across pictures."""

from __future__ import annotations

from deepinfer.contracts.multimodal import PictureInput
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec
from deepinfer.engine.prefix_cache import PrefixSettings, picture_key
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams

IMG = 99
PROMPT = [1, 2, 3, 4, 5, 6] + [IMG] * 6 + [7, 8, 9, 10, 11, 12, 13]  # units of 4: run [6, 12) over units 1, 2


def _kv() -> KVCacheManager:
    return KVCacheManager((PagedGroupSpec("full", block_size=4),), 16, 0,
                          prefix=PrefixSettings(identity="tiny"), unit=4)


def _hashes(pictures, tokens=PROMPT) -> list[bytes]:
    req = Request("r", list(tokens), SamplingParams(max_tokens=1), pictures=pictures)
    return _kv().block_hashes(req)


def _pic(content: str, offset: int = 6, length: int = 6) -> PictureInput:
    return PictureInput(content, offset, length)


def test_units_holding_a_run_key_its_picture():
    a, b = _hashes((_pic("a"),)), _hashes((_pic("b"),))
    assert len(a) == 4
    assert a[0] == b[0]  # [0, 4): text before the run
    assert a[1] != b[1] and a[2] != b[2]  # [4, 8) and [8, 12) hold the run
    assert a[3] != b[3]  # the chain carries the difference on
    assert _hashes((_pic("a"),)) == a  # the same picture: the same keys


def test_text_units_keep_their_keys():
    assert _hashes(()) == _hashes(()) and _hashes(())[0] == _hashes((_pic("a"),))[0]
    assert _hashes(())[1] != _hashes((_pic("a"),))[1]  # placeholders alone are not the picture


def test_the_runs_place_is_keyed():
    tokens = [1, 2, 3, 4, 5] + [IMG] * 7 + [7, 8, 9, 10, 11, 12, 13]
    moved = _hashes((_pic("a", offset=5, length=7),), tokens)
    assert moved[1] != _hashes((_pic("a"),))[1]


def test_picture_key_names_only_overlapping_runs():
    p = _pic("a")
    assert picture_key((p,), 0, 6) == b"" and picture_key((p,), 12, 16) == b""
    assert picture_key((p,), 11, 12) != b"" and picture_key((p,), 4, 8) == picture_key((p,), 8, 12)
