"""What the engine thread measures for the server: each open request's timing, and the engine's
state after each iteration.

    per open request (`TrackedRequest`, `account`)      after each iteration (`engine_stats`)
    ----------------------------------------------      -------------------------------------
    TTFT at its first token, tokens per step,           scheduler counts, KV usage, speculative
    mean TPOT and latency when it finishes              decoding and prefix-cache counters

Engine thread only: `EngineLoop` keeps the records, accounts for each output of a step and
publishes `engine_stats(...)` as its `stats`, a frozen snapshot the event loop thread reads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from deepinfer.entrypoints.openai.metrics import EngineStats, ServerMetrics
from deepinfer.entrypoints.openai.stats_log import StatsLogger
from deepinfer.outputs import RequestOutput


@dataclass
class TrackedRequest:
    """Engine-thread bookkeeping of one open request (for delivery and metrics)."""

    queue: asyncio.Queue
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_output_tokens: int = 0


def account(tracked: TrackedRequest, out: RequestOutput, now: float, stats_logger: StatsLogger,
            metrics: ServerMetrics | None) -> None:
    """Per-request timing: TTFT at the first token, mean TPOT and latency at the end. Tokens
    count over every completion (n > 1: all samples)."""
    num_new = sum(len(c.delta_token_ids) for c in out.outputs)
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
        metrics.record_finished(out.outputs[0].finish_reason, now - tracked.arrival_time, tpot)


def engine_stats(engine, num_active: int) -> EngineStats:
    """A snapshot of `engine` (its scheduler, KV cache manager and runner) with `num_active`
    requests open in the server."""
    scheduler, kv = engine.scheduler, engine.kv_manager
    spec = scheduler.spec_stats
    spec_fields = dict(  # copied: the engine thread mutates spec_stats
        spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_position=tuple(spec.accepted_per_position))
    return EngineStats(
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        num_active=num_active, kv_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
        num_total_blocks=kv.num_total_blocks, num_preemptions_total=scheduler.num_preemptions_total,
        **spec_fields, **_prefix_fields(engine))


def _prefix_fields(engine) -> dict:
    """The prefix cache's counters (`PrefixCacheStats`) and the cache directory's bytes, when
    the engine has them (a stand-in engine in a test may not)."""
    kv = engine.kv_manager
    stats = getattr(kv, "stats", None)
    disk_stats = getattr(getattr(engine, "runner", None), "disk_stats", None)
    disk = disk_stats() if disk_stats is not None else {}
    fields = dict(num_cached_blocks=getattr(kv, "num_cached_blocks", 0),
                  kv_dir_bytes_read=disk.get("kv_cache_dir_bytes_read", 0),
                  kv_dir_bytes_written=disk.get("kv_cache_dir_bytes_written", 0))
    if stats is not None:
        fields.update(prefix_queries=stats.queries, prefix_hits=stats.hits, prefix_disk_hits=stats.disk_hits,
                      prefix_load_failures=stats.num_load_failures)
    return fields
