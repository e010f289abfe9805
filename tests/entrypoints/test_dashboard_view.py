"""The dashboard's cache picture (engine/cache_view.py) and what feeds it: ring rows as the book
draws them, block tables with prefix hits marked, the request chosen, per-group usage, the
gauges /metrics adds, and the feed that builds the picture only while someone watches."""

from __future__ import annotations

import time
from types import SimpleNamespace

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.engine.cache_view import cache_snapshot, ring_picture, ring_rows
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec, RingGroupSpec
from deepinfer.engine.prefix_cache import PrefixSettings
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.serving.dashboard_feed import DashboardFeed
from deepinfer.serving.metrics import EngineStats, ServerMetrics
from deepinfer.serving.tenancy import EVERYONE


def _request(request_id: str, tokens: list[int], arrival: float) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), arrival_time=arrival)


def test_ring_rows_hold_the_last_position_of_each_residue():
    assert ring_rows(0, 5) == [-1] * 5
    assert ring_rows(3, 5) == [0, 1, 2, -1, -1]
    assert ring_rows(7, 5) == [5, 6, 2, 3, 4]  # the module picture: S = 5, positions 0..6
    assert ring_rows(10, 5) == [5, 6, 7, 8, 9]


def test_ring_picture_is_the_books_trace_at_position_134():
    # book §3.4.4: W = 128, S = 134, state 2 owns slots 268..401; position 134 wrote slot 268
    # (replacing position 0) and the window is 7..134
    pic = ring_picture("swa", state_id=2, ring_size=134, window=128, num_written=135)
    assert pic["first_slot"] == 268 and pic["first_slot"] + 133 == 401
    assert pic["rows"][0] == 134 and pic["rows"][1:7] == [1, 2, 3, 4, 5, 6]
    assert pic["window_start"] == 7
    in_window = [p for p in pic["rows"] if p >= pic["window_start"]]
    assert sorted(in_window) == list(range(7, 135))  # W rows in the window, S - W rows left it


def test_block_table_marks_the_prefix_hit_and_cached_blocks():
    kv = KVCacheManager((PagedGroupSpec("full", 4),), num_blocks=16, prefix=PrefixSettings(enabled=True))
    a = _request("a", list(range(10)), arrival=1.0)
    assert kv.allocate_slots("a", 10)
    a.num_computed_tokens = 10
    kv.commit(a)  # its two full blocks are registered
    b = _request("b", list(range(8)) + [99, 98, 97], arrival=2.0)
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots("b", b.num_tokens, hit)
    b.num_cached_tokens = b.num_computed_tokens = 8

    snap = cache_snapshot([b, a], kv, {}, selected="b")
    assert [r["request_id"] for r in snap["running"]] == ["a", "b"]  # oldest first
    (table,) = snap["request"]["paged"]
    a_ids = kv.block_ids("a")[0]
    assert table["block_ids"] == a_ids[:2] + kv.block_ids("b")[0][2:] and len(table["block_ids"]) == 3
    assert table["num_hit_blocks"] == 2 and table["cached"] == [True, True, False]
    assert snap["request"]["rings"] == []
    assert set(snap["request"]) == {"request_id", "num_prompt_tokens", "num_tokens", "num_computed_tokens",
                                    "num_cached_tokens", "owner", "paged", "rings"}  # counts and block ids, no tokens


def test_the_oldest_running_request_is_shown_unless_another_is_chosen():
    kv = KVCacheManager((PagedGroupSpec("full", 4), RingGroupSpec("swa", 6)), num_blocks=8, num_state_slots=2)
    old, new = _request("old", [1] * 9, arrival=1.0), _request("new", [2] * 3, arrival=5.0)
    for req in (new, old):
        assert kv.allocate_slots(req.request_id, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
    for selected in (None, "gone", "old"):
        pic = cache_snapshot([new, old], kv, {"swa": 4}, selected)["request"]
        assert pic["request_id"] == "old"
    pic = cache_snapshot([new, old], kv, {"swa": 4}, "new")["request"]
    assert pic["request_id"] == "new" and len(pic["paged"][0]["block_ids"]) == 1
    (ring,) = pic["rings"]
    assert ring["state_id"] == kv.state_ids("new")[0] and ring["window"] == 4 and ring["ring_size"] == 6
    assert ring["rows"] == [0, 1, 2, -1, -1, -1] and ring["window_start"] == 0
    old_ring = cache_snapshot([old], kv, {"swa": 4})["request"]["rings"][0]
    assert old_ring["rows"] == [6, 7, 8, 3, 4, 5] and old_ring["window_start"] == 5
    assert cache_snapshot([], kv, {}) == {"running": [], "request": None}


def test_group_usage_counts_shared_blocks_once_per_group():
    specs = (PagedGroupSpec("full", 4), PagedGroupSpec("compressed", 2, compress_ratio=4), RingGroupSpec("swa", 8))
    kv = KVCacheManager(specs, num_blocks=20, num_state_slots=3,
                        prefix=PrefixSettings(enabled=True, num_snapshot_slots=2))
    assert kv.group_usage() == ((("full", 0, 20), ("compressed", 0, 20)), (("swa", 0, 3),))
    assert kv.allocate_slots("a", 16)  # 4 full blocks, 2 compressed blocks, one state slot
    assert kv.allocate_slots("b", 8)  # 2 + 1, another slot
    kv.block_pool.touch(kv._cache("a").block_tables[0][:1])  # a block held twice counts once
    kv._cache("b").block_tables[0].append(kv._cache("a").block_tables[0][0])
    assert kv.group_usage() == ((("full", 6, 20), ("compressed", 3, 20)), (("swa", 2, 3),))
    single = KVCacheManager((PagedGroupSpec("full", 4),), num_blocks=10)
    assert single.allocate_slots("x", 9)
    assert single.group_usage() == ((("full", 3, 10),), ())


def test_metrics_report_blocks_and_ring_slots_per_group():
    metrics = ServerMetrics()
    metrics.record_engine(EngineStats(paged_groups=(("full", 3, 10), ("indexer", 1, 10)),
                                      ring_groups=(("swa", 2, 4),)))
    text = metrics.render().decode()
    for line in ('deepinfer_kv_group_blocks_used{group="full"} 3.0',
                 'deepinfer_kv_group_blocks_total{group="full"} 10.0',
                 'deepinfer_kv_group_blocks_used{group="indexer"} 1.0',
                 'deepinfer_kv_ring_slots_used{group="swa"} 2.0', 'deepinfer_kv_ring_slots_total{group="swa"} 4.0'):
        assert line in text, line


def _fake_engine(running, kv):
    return SimpleNamespace(scheduler=SimpleNamespace(running=running), kv_manager=kv)


def test_the_feed_builds_only_while_watched_and_never_raises():
    groups = [CacheGroupSpec("full", "paged", (0,), 4), CacheGroupSpec("swa", "ring", (1,), 6, window=4)]
    feed = DashboardFeed(groups)
    kv = KVCacheManager((PagedGroupSpec("full", 4), RingGroupSpec("swa", 6)), num_blocks=8, num_state_slots=2)
    req = _request("r", [5] * 5, arrival=1.0)
    assert kv.allocate_slots("r", 5)
    req.num_computed_tokens = 5
    engine = _fake_engine([req], kv)
    feed.publish(engine)
    assert feed.snapshot is None  # nobody watches: nothing built
    first = feed.view(EVERYONE, None)
    assert first["pending"] and first["groups"][1]["window"] == 4
    feed.publish(engine)
    view = feed.view(EVERYONE, "r")
    assert not view["pending"] and view["request"]["rings"][0]["window"] == 4
    assert view["request"]["rings"][0]["rows"] == [0, 1, 2, 3, 4, -1]
    feed.publish(_fake_engine(None, kv))  # a broken picture is logged, not raised
    assert feed.snapshot is None
    feed._watched_until = time.monotonic() - 1
    feed.publish(engine)
    assert feed.snapshot is None
