"""What the engine thread measures for the server: each open request's timing, and the engine's
state after each iteration.

    per open request (`TrackedRequest`, `account`)      after each iteration (`engine_stats`)
    ----------------------------------------------      -------------------------------------
    TTFT at its first token, tokens per step,           `LLMEngine.get_metrics()`: scheduler
    mean TPOT and latency when it finishes              counts, KV usage, speculative decoding,
                                                        prefix-cache and cache-directory counters;
                                                        `KVCacheManager.group_usage()`: blocks and
                                                        state slots per cache group

Engine thread only: `EngineLoop` keeps the records, accounts for each output of a step and
publishes `engine_stats(...)` as its `stats`, a frozen snapshot the event loop thread reads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from deepinfer.outputs import EmbeddingRequestOutput, RequestOutput
from deepinfer.serving.metrics import EngineStats, ServerMetrics
from deepinfer.serving.stats_log import StatsLogger


@dataclass
class TrackedRequest:
    """Engine-thread bookkeeping of one open request (for delivery and metrics)."""

    queue: asyncio.Queue
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_output_tokens: int = 0


def account(tracked: TrackedRequest, out: RequestOutput | EmbeddingRequestOutput, now: float,
            stats_logger: StatsLogger, metrics: ServerMetrics | None) -> None:
    """Per-request timing: TTFT at the first token, mean TPOT and latency at the end. Tokens
    count over every completion (n > 1: all samples); an embedding has none, only its latency."""
    completions = out.outputs if isinstance(out, RequestOutput) else []
    num_new = sum(len(c.delta_token_ids) for c in completions)
    ttft = None
    if num_new:
        if tracked.first_token_time is None:
            tracked.first_token_time, ttft = now, now - tracked.arrival_time
        tracked.last_token_time = now
        tracked.num_output_tokens += num_new
        stats_logger.record_generation(num_new)
    if metrics is None:
        return
    if num_new:
        metrics.record_tokens(num_new, ttft)
    if out.finished:
        tpot = None
        if tracked.num_output_tokens > 1:
            tpot = ((tracked.last_token_time - tracked.first_token_time)
                    / (tracked.num_output_tokens - 1))
        reason = completions[0].finish_reason if completions else out.finish_reason
        metrics.record_finished(reason, now - tracked.arrival_time, tpot)


# EngineStats field <- its `LLMEngine.get_metrics` key; a key the engine does not report (the cache
# directory's, without one) leaves the field at zero
STATS_FROM_METRICS = {
    "num_running": "num_requests_running", "num_waiting": "num_requests_waiting",
    "kv_usage": "kv_cache_usage", "num_free_blocks": "num_free_blocks", "num_total_blocks": "num_total_blocks",
    "num_preemptions_total": "num_preemptions",
    "spec_num_drafts": "spec_decode_num_drafts", "spec_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_accepted_per_position": "spec_decode_num_accepted_tokens_per_pos",
    "prefix_queries": "prefix_cache_queries", "prefix_hits": "prefix_cache_hits",
    "prefix_disk_hits": "prefix_cache_disk_hits", "prefix_load_failures": "prefix_cache_load_failures",
    "num_cached_blocks": "num_cached_blocks",
    "kv_dir_bytes_read": "kv_cache_dir_bytes_read", "kv_dir_bytes_written": "kv_cache_dir_bytes_written",
}


def engine_stats(engine, num_active: int) -> EngineStats:
    """A snapshot of `engine.get_metrics()` (the engine's one source of counters) with
    `num_active` requests open in the server."""
    metrics = engine.get_metrics()  # a fresh dict: later steps do not change it
    fields = {name: metrics[key] for name, key in STATS_FROM_METRICS.items() if key in metrics}
    if "spec_accepted_per_position" in fields:
        fields["spec_accepted_per_position"] = tuple(fields["spec_accepted_per_position"])
    kv = getattr(engine, "kv_manager", None)  # a stand-in engine in tests may have none
    if kv is not None:
        fields["paged_groups"], fields["ring_groups"] = kv.group_usage()
    return EngineStats(num_active=num_active, **fields)
