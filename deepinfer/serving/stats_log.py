"""The server's periodic throughput line, as vLLM's: every few seconds while there is work,

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 8 reqs, Waiting: 3 reqs, KV cache usage: 41.2%

and nothing while the server is idle. The engine thread feeds it; it only counts and logs.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("deepinfer.server")

DEFAULT_INTERVAL_S = 5.0


class StatsLogger:
    """Counts prompt tokens admitted and tokens generated, and logs their rates once per
    `interval_s` (None or <= 0: never) while requests are open. When the engine goes idle the
    partial window is logged at once (its last tokens are not lost), then nothing until the next
    request, whose window starts at its arrival (idle time does not dilute the rates)."""

    def __init__(self, interval_s: float | None = DEFAULT_INTERVAL_S, now: float | None = None):
        self.interval_s = interval_s
        self.window_start = time.monotonic() if now is None else now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.idle = True

    def record_prompt(self, num_tokens: int, now: float | None = None) -> None:
        if self.idle:  # the first request after idle time opens the window
            self.window_start, self.idle = time.monotonic() if now is None else now, False
        self.num_prompt_tokens += num_tokens

    def record_generation(self, num_tokens: int) -> None:
        self.num_generation_tokens += num_tokens

    def maybe_log(self, stats, now: float) -> str | None:
        """Log (and return) the window's line when `interval_s` has passed, or when the engine
        has just gone idle with tokens in the window; `stats` is an EngineStats."""
        if not self.interval_s or self.interval_s <= 0:
            return None
        idle = not (stats.num_running or stats.num_waiting)
        counted = self.num_prompt_tokens or self.num_generation_tokens
        if now - self.window_start < self.interval_s and not (idle and counted):
            return None
        line = None
        if counted or not idle:
            seconds = max(now - self.window_start, 1e-6)
            line = (f"Avg prompt throughput: {self.num_prompt_tokens / seconds:.1f} tokens/s, "
                    f"Avg generation throughput: {self.num_generation_tokens / seconds:.1f} tokens/s, "
                    f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                    f"KV cache usage: {100 * stats.kv_usage:.1f}%")
            logger.info("%s", line)
        self.window_start, self.num_prompt_tokens, self.num_generation_tokens = now, 0, 0
        self.idle = idle
        return line
