"""One engine thread serving every HTTP connection, and its bridge to asyncio.

The LLMEngine is not thread-safe, so only the engine thread touches it:

    event loop thread                                   engine thread
    -----------------                                   -------------
    add() / abort() --> commands (deque + Condition) --> drain commands: add_request / abort_request
                                                         step()      (every running request, one batch)
    RequestHandle's asyncio.Queue <---------------------- call_soon_threadsafe(deliver, step's outputs)
    add()'s future <------------------------------------- call_soon_threadsafe(set_result / set_exception)

The thread sleeps on the Condition while there is neither a command nor an unfinished request.
Requests from many connections join the running batch at the next step (continuous batching).
An abort is applied before the next step, so an aborted request never computes another token
and its blocks return to the pool at once.

A request failed by a fault inside a step comes out of `engine.step()` as a finished output
(finish_reason "error", `error` set) and is delivered and counted like any other. `step()` raises
only for a fatal fault: the thread then fails every open request (EngineClosedError), and calls
`on_fatal(exc)` once, so the server can exit instead of answering 503 forever.

The asyncio side of a request (`RequestHandle`) and the callbacks `deliver` / `resolve` are in
`request_stream.py`; per-request timing and the published `EngineStats` in `loop_metrics.py`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.serving.loop_metrics import TrackedRequest, account, engine_stats
from deepinfer.serving.metrics import EngineStats, ServerMetrics
from deepinfer.serving.request_stream import RequestHandle, deliver, resolve
from deepinfer.serving.stats_log import StatsLogger

logger = logging.getLogger("deepinfer.server")


class EngineClosedError(RuntimeError):
    """The engine takes no new requests: the server is shutting down or the engine failed."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    future: asyncio.Future
    arrival_time: float
    cache_salt: str | None = None
    lora_request: object = None  # a LoRARequest (None: the base model)
    scheduling: dict | None = None  # priority, client_id (LLMEngine.add_request)


@dataclass
class _Abort:
    request_id: str | None  # None: every request


class EngineLoop:
    """Runs `engine.step()` on a dedicated thread while there is work; see the module picture."""

    def __init__(self, engine, metrics: ServerMetrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.on_fatal = on_fatal  # called once, on the engine thread, after a fatal fault
        self.stats = EngineStats()
        self.dashboard = None  # a DashboardFeed (dashboard.py): its cache picture, published with the stats
        self.stats_logger = StatsLogger()  # the periodic throughput line (interval_s None: off)
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort] = deque()
        self._num_pending_adds = 0
        self._num_open = 0  # added and not finished, counted under the lock
        self._accepting = True
        self._stopping = False
        self._closed = False
        self._engine_closed = False
        self._tracked: dict[str, TrackedRequest] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- control (event loop thread) -------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; open requests fail with EngineClosedError."""
        with self._cond:
            self._accepting, self._stopping = False, True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def close_engine(self) -> None:
        """After `stop()`: close the engine once (save what the KV cache directory lacks, stop its
        writer), on the calling thread. Skipped while the engine thread still runs a step: the
        engine is not thread-safe (the log says so)."""
        if self._engine_closed:
            return
        if self._thread is not None and self._thread.is_alive():
            logger.warning("the engine thread has not stopped; the engine is not closed (the KV cache "
                           "directory may miss the latest blocks)")
            return
        self._engine_closed = True
        try:
            self.engine.close()
        except Exception:
            logger.exception("closing the engine failed (the KV cache directory may miss the latest blocks)")

    def stop_accepting(self) -> None:
        """New requests are refused from now on; those in flight go on."""
        self._accepting = False

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the engine plus those not yet handed to it."""
        return self.stats.num_waiting + self._num_pending_adds

    @property
    def num_active(self) -> int:
        """Requests handed in and not yet finished (also those not yet in the engine)."""
        return self._num_open

    # -- requests (event loop thread) ------------------------------------------------------------

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  arrival_time: float | None = None, cache_salt: str | None = None,
                  lora_request=None, **scheduling) -> RequestHandle:
        """Hand a request to the engine; raises the engine's ValueError if it refuses it.
        Requests share cached prefixes only when their `cache_salt` is equal (and their LoRA
        adapters' content: `lora_request`, None for the base model). `scheduling`: `priority`
        and `client_id`, as `LLMEngine.add_request` takes them."""
        if not self._accepting:
            raise EngineClosedError("the server is shutting down")
        queue: asyncio.Queue = asyncio.Queue()
        future = self._loop.create_future()
        self._submit(_Add(request_id, prompt_ids, params, queue, future,
                          arrival_time if arrival_time is not None else time.monotonic(), cache_salt, lora_request,
                          scheduling))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestHandle(request_id, len(prompt_ids), queue, self)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); applied before the next engine step."""
        self._submit(_Abort(request_id), quiet=True)

    def abort_all(self) -> None:
        self._submit(_Abort(None), quiet=True)

    async def wait_idle(self, timeout: float, poll_s: float = 0.02) -> bool:
        """Wait until no request is open; False when `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self.num_active > 0:
            if time.monotonic() >= deadline or not self.alive:
                return False
            await asyncio.sleep(poll_s)
        return True

    def _submit(self, command: _Add | _Abort, quiet: bool = False) -> None:
        with self._cond:
            if self._closed:
                if quiet:
                    return
                raise EngineClosedError("the engine is not running")
            self._commands.append(command)
            self._num_pending_adds += isinstance(command, _Add)
            self._num_open += isinstance(command, _Add)
            self._cond.notify()

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (commands := self._next_commands()) is not None:
                self._step(commands)
        except BaseException as exc:  # a fatal fault: the engine is in an unknown state, fail everything
            logger.exception("engine step failed; the server stops taking requests")
            self.error = exc
        finally:
            self._close()
        if self.error is not None:
            self._notify_fatal(self.error)

    def _step(self, commands: list[_Add | _Abort]) -> None:
        """Apply the commands, run one engine step and post its outputs. A method of its own so
        that nothing of the step (its outputs, their token lists) outlives it while the thread
        waits for work."""
        aborted = self._apply(commands)
        batch = []
        if aborted or self.engine.has_unfinished_requests():
            batch = self._publish(self.engine.step(), time.monotonic())
        self._publish_stats()  # before the outputs go out: an answered client sees its blocks freed
        if batch:
            self._post(deliver, batch)
        self.stats_logger.maybe_log(self.stats, time.monotonic())

    def _notify_fatal(self, exc: BaseException) -> None:
        if self.on_fatal is None:
            return
        try:
            self.on_fatal(exc)
        except Exception:
            logger.exception("the on_fatal callback raised")

    def _next_commands(self) -> list[_Add | _Abort] | None:
        """Wait for work; None when stopping."""
        with self._cond:
            while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            self._num_pending_adds -= sum(isinstance(c, _Add) for c in commands)
            return commands

    def _apply(self, commands: list[_Add | _Abort]) -> bool:
        """Apply adds and aborts in order; True if something was aborted."""
        aborted = False
        for command in commands:
            if isinstance(command, _Add):
                self._add(command)
                continue
            ids = list(self._tracked) if command.request_id is None else [command.request_id]
            for request_id in ids:
                aborted |= self.engine.abort_request(request_id)
        return aborted

    def _add(self, command: _Add) -> None:
        salt = {} if command.cache_salt is None else {"cache_salt": command.cache_salt}
        if command.lora_request is not None:
            salt["lora_request"] = command.lora_request
        salt.update(command.scheduling or {})
        try:
            self.engine.add_request(command.prompt_ids, command.params, command.request_id, **salt)
        except Exception as exc:  # a refusal (ValueError) goes back to the caller
            self._count_closed(1)
            self._post(resolve, command.future, exc)
            return
        self._tracked[command.request_id] = TrackedRequest(command.queue, command.arrival_time)
        self.stats_logger.record_prompt(len(command.prompt_ids), time.monotonic())
        if self.metrics is not None:
            self.metrics.record_admitted(len(command.prompt_ids))
        self._post(resolve, command.future, None)

    def _publish(self, outputs: list[RequestOutput], now: float) -> list:
        """Account the step's outputs and forget finished requests; returns the (queue, output) pairs
        to deliver."""
        batch, num_finished = [], 0
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            account(tracked, out, now, self.stats_logger, self.metrics)
            batch.append((tracked.queue, out))
            if out.finished:
                del self._tracked[out.request_id]
                num_finished += 1
        self._count_closed(num_finished)
        return batch

    def _publish_stats(self) -> None:
        self.stats = engine_stats(self.engine, len(self._tracked))
        if self.metrics is not None:
            self.metrics.record_engine(self.stats)
        if self.dashboard is not None:
            self.dashboard.publish(self.engine)

    def _close(self) -> None:
        """Refuse further commands; fail pending adds and open requests."""
        with self._cond:
            self._closed, self._accepting = True, False
            pending = [c for c in self._commands if isinstance(c, _Add)]
            self._commands.clear()
            self._num_pending_adds = self._num_open = 0
        error = EngineClosedError("the engine stopped" if self.error is None
                                  else f"the engine failed: {self.error!r}")
        for command in pending:
            self._post(resolve, command.future, error)
        batch = [(tracked.queue, error) for tracked in self._tracked.values()]
        self._tracked.clear()
        self._post(deliver, batch)
        self.stats = EngineStats()

    def _count_closed(self, num: int) -> None:
        if num:
            with self._cond:
                self._num_open -= num

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
