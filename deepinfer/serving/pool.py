"""The tokenizer pool: parsing, tokenization and chat templating off the event loop, in two lanes.

A job's size is the bytes of the request body it works on (the `bytes` arguments of the call).
Jobs of at most `big_job_bytes` run in the small lane (`max_workers` threads); bigger ones run in a
lane of their own, one thread, at most `max_big_jobs` of them queued or running: more is a 429
(`queue_full`) for the request that would exceed it. So a few large bodies (a 7.5 MB /tokenize)
never hold the workers an ordinary completion needs, and only one of them is worked on at a
time (its memory is bounded by one body, not by every body that arrived).

Each call gets a tokenizer copy of its own for its duration (a Hugging Face tokenizer is not safe
to share between threads; the engine thread and the event loop keep theirs). The copies are made
up front, one per thread. The threads run at a lower CPU priority (nice +WORKER_NICENESS, where the
OS allows), so that on a busy machine the event loop is scheduled ahead of a long tokenization.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from deepinfer.serving.errors import too_busy
from deepinfer.serving.parse import parse_body

WORKER_NICENESS = 5
BIG_JOB_BYTES = 1 << 20  # a body over this is a big job
MAX_BIG_JOBS = 2  # big jobs queued or running; another one is a 429


class _Lane:
    """`max_workers` threads, each taking a tokenizer copy for the duration of a call."""

    def __init__(self, tokenizer, max_workers: int, name: str):
        self.pending = 0  # calls queued or running; touched on the event loop only
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max_workers):
            self._copies.put(copy.deepcopy(tokenizer))
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix=name,
                                            initializer=_lower_thread_priority)

    async def run(self, fn, args):
        self.pending += 1
        try:
            return await asyncio.wrap_future(self._executor.submit(self._call, fn, args))
        finally:
            self.pending -= 1

    def _call(self, fn, args):
        tokenizer = self._copies.get()
        try:
            return fn(tokenizer, *args)
        finally:
            self._copies.put(tokenizer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class TokenizerPool:
    """Two lanes of tokenizer threads (see the module docstring); `pending` counts the calls
    queued or running in both."""

    def __init__(self, tokenizer, max_workers: int, *, big_job_bytes: int = BIG_JOB_BYTES,
                 max_big_jobs: int = MAX_BIG_JOBS, retry_after_s: int = 1):
        if max_workers < 1 or max_big_jobs < 1 or big_job_bytes < 0:
            raise ValueError(f"TokenizerPool: max_workers ({max_workers}) and max_big_jobs ({max_big_jobs}) "
                             f"must be at least 1, big_job_bytes ({big_job_bytes}) at least 0")
        self.big_job_bytes, self.max_big_jobs, self.retry_after_s = big_job_bytes, max_big_jobs, retry_after_s
        self._small = _Lane(tokenizer, max_workers, "deepinfer-tokenize")
        self._big = _Lane(tokenizer, 1, "deepinfer-tokenize-big")

    @property
    def pending(self) -> int:
        return self._small.pending + self._big.pending

    async def run(self, fn, *args):
        """`fn(tokenizer, *args)` on a worker thread of the lane its body's size picks: its result,
        or its exception raised here; a 429 when the big lane is full."""
        size = sum(len(a) for a in args if isinstance(a, bytes | bytearray | memoryview))
        if size <= self.big_job_bytes:
            return await self._small.run(fn, args)
        if self._big.pending >= self.max_big_jobs:
            raise too_busy(f"the server is busy: {self._big.pending} request bodies over {self.big_job_bytes} "
                           f"bytes are being processed (limit {self.max_big_jobs}); this one has {size} bytes; "
                           f"retry later", self.retry_after_s)
        return await self._big.run(fn, args)

    async def parse(self, raw: bytes, model):
        """`raw` parsed and validated into the pydantic `model` on a worker (`serving.parse`)."""
        return await self.run(_parse, raw, model)

    def shutdown(self) -> None:
        self._small.shutdown()
        self._big.shutdown()


def _parse(tokenizer, raw: bytes, model):
    return parse_body(raw, model)


def _lower_thread_priority() -> None:
    """Raise the calling thread's niceness (Linux applies it per thread; elsewhere a no-op)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
