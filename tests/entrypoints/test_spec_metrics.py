"""Speculative-decoding counters on /metrics: deltas of EngineStats snapshots, the engine loop's
snapshot of `scheduler.spec_stats`, and the app of `deepinfer serve` (in this process) after a
repetitive completion."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from app_server import AppServer

from deepinfer import LLM, SamplingParams
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.serving.engine_loop import EngineLoop
from deepinfer.serving.loop_metrics import STATS_FROM_METRICS, engine_stats
from deepinfer.serving.metrics import EngineStats, ServerMetrics

DRAFTS = "deepinfer_spec_decode_num_drafts_total"
DRAFT_TOKENS = "deepinfer_spec_decode_num_draft_tokens_total"
ACCEPTED = "deepinfer_spec_decode_num_accepted_tokens_total"
PER_POS = "deepinfer_spec_decode_num_accepted_tokens_per_pos_total"


def _value(metrics: ServerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _counters(metrics: ServerMetrics, num_positions: int = 3) -> tuple:
    return (_value(metrics, DRAFTS), _value(metrics, DRAFT_TOKENS), _value(metrics, ACCEPTED),
            [_value(metrics, PER_POS, position=str(i)) for i in range(num_positions)])


def test_spec_counters_move_by_the_deltas_of_snapshots():
    metrics = ServerMetrics()
    assert _counters(metrics) == (0.0, 0.0, 0.0, [None, None, None])
    metrics.record_engine(EngineStats(spec_num_drafts=3, spec_num_draft_tokens=9, spec_num_accepted_tokens=5,
                                      spec_accepted_per_position=(3, 2)))
    assert _counters(metrics) == (3.0, 9.0, 5.0, [3.0, 2.0, None])
    metrics.record_engine(EngineStats(spec_num_drafts=5, spec_num_draft_tokens=15, spec_num_accepted_tokens=8,
                                      spec_accepted_per_position=(4, 3, 1)))
    assert _counters(metrics) == (5.0, 15.0, 8.0, [4.0, 3.0, 1.0])
    metrics.record_engine(EngineStats(spec_num_drafts=5, spec_num_draft_tokens=15, spec_num_accepted_tokens=8,
                                      spec_accepted_per_position=(4, 3, 1)))  # nothing new
    assert _counters(metrics) == (5.0, 15.0, 8.0, [4.0, 3.0, 1.0])
    metrics.record_engine(EngineStats())  # the empty snapshot after the engine stops: counters stay
    assert _counters(metrics) == (5.0, 15.0, 8.0, [4.0, 3.0, 1.0])
    text = metrics.render().decode()
    assert f'{PER_POS}{{position="2"}} 1.0' in text and f"{DRAFTS} 5.0" in text


def test_spec_counters_leave_preemptions_alone():
    metrics = ServerMetrics()
    metrics.record_engine(EngineStats(num_preemptions_total=2, spec_num_drafts=7))
    metrics.record_engine(EngineStats(num_preemptions_total=3, spec_num_drafts=7))
    assert _value(metrics, "deepinfer_num_preemptions_total") == 3.0
    assert _value(metrics, DRAFTS) == 7.0


def _fake_engine(spec_stats: SpecDecodeStats):
    """An engine whose metrics are its scheduler's spec counters, read afresh at each call."""
    return SimpleNamespace(get_metrics=lambda: {"num_free_blocks": 4, "num_total_blocks": 4, **spec_stats.as_dict()})


def test_engine_loop_publishes_a_copy_of_the_schedulers_spec_stats():
    spec, metrics = SpecDecodeStats(), ServerMetrics()
    loop = EngineLoop(_fake_engine(spec), metrics)
    spec.observe(4, 2)
    spec.observe(4, 0)
    loop._publish_stats()
    assert (loop.stats.spec_num_drafts, loop.stats.spec_num_draft_tokens, loop.stats.spec_num_accepted_tokens,
            loop.stats.spec_accepted_per_position) == (2, 8, 2, (1, 1, 0, 0))
    spec.observe(4, 3)  # the engine goes on; the published snapshot does not change under the reader
    assert loop.stats.spec_accepted_per_position == (1, 1, 0, 0)
    loop._publish_stats()
    assert _counters(metrics, 4) == (3.0, 12.0, 5.0, [2.0, 2.0, 1.0, 0.0])


def test_engine_stats_are_the_engines_own_metrics(tiny_checkpoint, tmp_path):
    """The server's snapshot reads every field from `LLMEngine.get_metrics`, nothing on its own."""
    with LLM(tiny_checkpoint("llama"), max_model_len=128, kv_cache_dir=str(tmp_path), speculative_method="ngram",
             num_speculative_tokens=2) as llm:
        llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * 2, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        metrics, stats = llm.get_metrics(), engine_stats(llm.engine, 3)
    assert set(STATS_FROM_METRICS.values()) <= set(metrics), "a key the engine does not report"
    got = {name: getattr(stats, name) for name in STATS_FROM_METRICS}
    want = {name: metrics[key] for name, key in STATS_FROM_METRICS.items()}
    want["spec_accepted_per_position"] = tuple(want["spec_accepted_per_position"])
    assert got == want and stats.num_active == 3
    assert stats.prefix_queries > 0 and stats.num_running == 0 and stats.num_total_blocks > 0


# A continuation the prompt's n-grams predict (" 16, 17, 18, ..."): drafts are accepted whatever the
# numerics (an instruction to repeat a line got prose back, accepted or not by chance).
COUNTING_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,"


def _metrics_after(server: AppServer, name: str, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once `name` is nonzero (the engine thread publishes right after the last step)."""
    deadline = time.monotonic() + timeout
    while (m := server.metrics())[name] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return m


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_server_metrics_count_drafts_after_a_completion():
    with AppServer("--speculative-method", "ngram", "--num-speculative-tokens", "3") as server:
        assert server.metrics()[DRAFTS] == 0
        r = server.client.post("/v1/completions", json={"prompt": COUNTING_PROMPT, "max_tokens": 32,
                                                         "temperature": 0})
        assert r.status_code == 200, r.text
        m = _metrics_after(server, ACCEPTED)
    assert m[DRAFTS] > 0 and m[DRAFT_TOKENS] >= m[DRAFTS]
    assert 0 < m[ACCEPTED] <= m[DRAFT_TOKENS]
    per_pos = {k: v for k, v in m.items() if k.startswith(PER_POS + "{")}
    assert len(per_pos) <= 3 and sum(per_pos.values()) == m[ACCEPTED]
    assert per_pos[f'{PER_POS}{{position="0"}}'] > 0
