"""Prometheus metrics of one server, in a registry of its own (never the global one).

The engine thread records per-request events and engine gauges; the HTTP side records errors
and renders `/metrics`. prometheus-client is thread-safe, so both may write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine, published by the engine thread after each iteration."""

    num_running: int = 0
    num_waiting: int = 0
    num_active: int = 0  # requests the server holds open (added, not yet finished)
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions_total: int = 0
    # speculative decoding since start (`engine.spec_stats.SpecDecodeStats`); zero without a method
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # [i]: how often draft i of a step was accepted
    # prefix caching since start (`engine.prefix_cache.PrefixCacheStats`), in prompt tokens
    prefix_queries: int = 0  # looked up at admission
    prefix_hits: int = 0  # found cached (not recomputed)
    prefix_disk_hits: int = 0  # of those, read from the KV cache directory
    prefix_load_failures: int = 0  # admissions whose saved cache could not be read (recomputed)
    num_cached_blocks: int = 0  # blocks holding a cached prefix, in use or free
    kv_dir_bytes_read: int = 0  # the KV cache directory's bytes read and written since start
    kv_dir_bytes_written: int = 0
    # per cache group (`KVCacheManager.group_usage`): (group, used, total) blocks of each paged group
    # (all share one pool: each total is the pool's) and state slots of each ring group
    paged_groups: tuple[tuple[str, int, int], ...] = ()
    ring_groups: tuple[tuple[str, int, int], ...] = ()


# (EngineStats field, metric, help): the gauges set to the engine's latest snapshot
ENGINE_GAUGES = (
    ("num_running", "deepinfer_num_requests_running", "Requests in the running batch"),
    ("num_waiting", "deepinfer_num_requests_waiting", "Requests waiting (incl. preempted)"),
    ("kv_usage", "deepinfer_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)"),
    ("num_free_blocks", "deepinfer_kv_free_blocks", "Free KV cache blocks"),
    ("num_total_blocks", "deepinfer_kv_total_blocks", "KV cache blocks in all"),
    ("num_cached_blocks", "deepinfer_num_cached_blocks", "KV cache blocks holding a cached prefix (in use or free)"),
)
# (EngineStats field, metric, help): the counters that follow one of the engine's running totals
ENGINE_TOTALS = (
    ("num_preemptions_total", "deepinfer_num_preemptions", "Preemptions since start"),
    ("spec_num_drafts", "deepinfer_spec_decode_num_drafts",
     "Speculative verification steps (one per request per step that carried drafts)"),
    ("spec_num_draft_tokens", "deepinfer_spec_decode_num_draft_tokens", "Draft tokens verified"),
    ("spec_num_accepted_tokens", "deepinfer_spec_decode_num_accepted_tokens", "Draft tokens accepted"),
    ("prefix_queries", "deepinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission"),
    ("prefix_hits", "deepinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache (not recomputed)"),
    ("prefix_disk_hits", "deepinfer_prefix_cache_disk_hits",
     "Prompt tokens of prefix-cache hits read from the KV cache directory"),
    ("prefix_load_failures", "deepinfer_prefix_cache_load_failures",
     "Admissions whose saved cache could not be read (their prompt was recomputed)"),
    ("kv_dir_bytes_read", "deepinfer_kv_cache_dir_bytes_read", "Bytes read from the KV cache directory"),
    ("kv_dir_bytes_written", "deepinfer_kv_cache_dir_bytes_written", "Bytes written to the KV cache directory"),
)


class ServerMetrics:
    """The server's counters, histograms and gauges; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("deepinfer_requests", "Requests by status (finished, aborted, failed, error) "
                                "and finish reason", ["status", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Time from arrival to the "
                              "first output token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds", "Mean time per output "
                              "token after the first, per request", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Time from arrival to the "
                             "end of a request", buckets=LATENCY_BUCKETS, registry=r)
        self.spec_accepted_per_pos = Counter("deepinfer_spec_decode_num_accepted_tokens_per_pos", "Draft "
                                             "tokens accepted at each draft position (0-based)", ["position"],
                                             registry=r)
        self.group_blocks_used = Gauge("deepinfer_kv_group_blocks_used", "KV cache blocks (pages) the requests' "
                                       "block tables of a paged cache group hold", ["group"], registry=r)
        self.group_blocks_total = Gauge("deepinfer_kv_group_blocks_total", "KV cache blocks a paged cache group "
                                        "draws from (one pool shared by all paged groups)", ["group"], registry=r)
        self.ring_slots_used = Gauge("deepinfer_kv_ring_slots_used", "State slots (rings) of a sliding-window "
                                     "cache group held by requests", ["group"], registry=r)
        self.ring_slots_total = Gauge("deepinfer_kv_ring_slots_total", "State slots (rings) of a sliding-window "
                                      "cache group", ["group"], registry=r)
        self.gauges = {stat: Gauge(name, text, registry=r) for stat, name, text in ENGINE_GAUGES}
        self.totals = {stat: Counter(name, text, registry=r) for stat, name, text in ENGINE_TOTALS}
        self._seen: dict[object, int] = {}  # counter (or labelled child) -> the engine total it has reached

    # -- per request ------------------------------------------------------------------------------

    def record_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_tokens(self, num_tokens: int, ttft: float | None) -> None:
        """New output tokens; `ttft` is given with a request's first token."""
        self.generation_tokens.inc(num_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)

    def record_finished(self, finish_reason: str | None, latency: float, tpot: float | None) -> None:
        status = {"abort": "aborted", "error": "failed"}.get(finish_reason, "finished")
        self.requests.labels(status, finish_reason or "none").inc()
        self.e2e.observe(latency)
        if tpot is not None:
            self.tpot.observe(tpot)

    def record_error(self) -> None:
        """A generation request answered with an error (refused or failed)."""
        self.requests.labels("error", "error").inc()

    # -- engine -----------------------------------------------------------------------------------

    def record_engine(self, stats: EngineStats) -> None:
        values = dataclasses.asdict(stats)
        for stat, gauge in self.gauges.items():
            gauge.set(values[stat])
        for stat, counter in self.totals.items():
            self._advance(counter, values[stat])
        for position, total in enumerate(stats.spec_accepted_per_position):
            self._advance(self.spec_accepted_per_pos.labels(str(position)), total)
        for group, used, total in stats.paged_groups:
            self.group_blocks_used.labels(group).set(used)
            self.group_blocks_total.labels(group).set(total)
        for group, used, total in stats.ring_groups:
            self.ring_slots_used.labels(group).set(used)
            self.ring_slots_total.labels(group).set(total)

    def _advance(self, counter, total: int) -> None:
        """Move `counter` up to the engine's running `total` (counters only grow: a total below
        the one seen, as in the empty snapshot after the engine stops, changes nothing)."""
        new = total - self._seen.get(counter, 0)
        if new > 0:
            counter.inc(new)
            self._seen[counter] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
