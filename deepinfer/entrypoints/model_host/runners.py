"""The loaded models of a model host: one `deepinfer serve` child per model, started on demand.

    acquire(model)               the model's runner once it answers /health (started if needed);
                                 requests for a model being loaded wait for it, at most
                                 `max_waiting` of them (then 503)
    release(runner, keep_alive)  a request is done: the runner expires `keep_alive` seconds later
                                 (0: as soon as no request is in flight; negative: never)
    expire()                     the reaper's round: unload every idle runner past its expiry

Room. Before a model starts, the least recently used idle runners are unloaded until fewer than
`max_loaded` are loaded and the new one's estimated bytes fit `memory_budget` beside the others'
(a loaded runner counts its process's resident memory, a starting one its files' size plus
`RUNTIME_BYTES`). A runner with requests in flight, or still loading, is never unloaded: when
nothing can be unloaded the request waits until a runner goes idle, at most `load_timeout_s` (then
503).

Turns. While a model waits for room, new requests for the loaded models wait behind it (first come,
first served, as Ollama's queue does): the busy model drains, goes idle and makes room, where
admitting its new requests would keep it busy and starve the waiting model.

The event loop is the only writer; children are started and stopped in threads, so a model that
loads never stalls another model's stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

import httpx

from deepinfer.serving.errors import ServingError, service_unavailable

logger = logging.getLogger("deepinfer.server")
RUNTIME_BYTES = 600 << 20  # a child's own memory beside its weights (Python, torch, the KV cache)
HEALTH_POLL_S = 0.2
_DURATION = re.compile(r"^(?P<value>-?\d+(\.\d+)?)(?P<unit>ms|s|m|h)?$")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive_seconds(value, field: str = "keep_alive") -> float:
    """Ollama's keep_alive: seconds as a number, or a duration "30s" / "5m" / "1h" / "1h30m"-free
    simple form; negative keeps the model loaded for ever (inf), 0 unloads it after the answer.
    ValueError naming `field` and the value otherwise."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{field} must be a number of seconds or a duration such as '5m', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).strip())
        if match is None:
            raise ValueError(f"{field} must be a number of seconds or a duration such as '5m', got {str(value)[:80]!r}")
        seconds = float(match["value"]) * _UNITS[match["unit"]]
    if seconds != seconds:
        raise ValueError(f"{field} must be a number of seconds, got {value!r}")
    return float("inf") if seconds < 0 else seconds


@dataclasses.dataclass
class Runner:
    """One loaded (or loading) model: its child process and where it listens."""

    name: str
    path: str
    url: str
    process: subprocess.Popen | None = None
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    gone: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # unloaded or exited
    failure: str | None = None  # why it failed to load
    unloaded_early: bool = False  # unloaded before it was ready (a delete, the server stopping)
    in_flight: int = 0
    waiting: int = 0
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    expires_at: float = float("inf")
    started_at: float = dataclasses.field(default_factory=time.time)
    estimate: int = 0  # bytes, until the process's own figure is known

    @property
    def loaded(self) -> bool:
        return self.ready.is_set() and not self.gone.is_set()

    def memory(self) -> int:
        """The process's resident bytes once it runs (its estimate before)."""
        if self.process is None or not self.ready.is_set():
            return self.estimate
        try:
            with open(f"/proc/{self.process.pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return max(self.estimate, int(line.split()[1]) * 1024)
        except (OSError, ValueError):
            pass
        return self.estimate


@dataclasses.dataclass
class HostLimits:
    max_loaded: int = 3
    memory_budget: int | None = None  # bytes; None: no budget
    keep_alive_s: float = 300.0
    load_timeout_s: float = 600.0
    max_waiting: int = 256


class RunnerPool:
    """The runners by model name. `start(model, port) -> Popen` starts a child serving `model` on
    127.0.0.1:port; `free_port()` picks the port."""

    def __init__(self, limits: HostLimits, start: Callable, free_port: Callable[[], int]):
        self.limits, self._start, self._free_port = limits, start, free_port
        self.runners: dict[str, Runner] = {}
        self.idle = asyncio.Condition()  # notified when a runner goes idle or away
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
        self.loads = self.evictions = 0
        self.waiting_for_room: list[str] = []  # models that wait to load, oldest first

    async def acquire(self, model) -> Runner:
        """The model's runner, ready, with this request counted in flight."""
        await self._wait_for_turn(model.name)
        runner = self.runners.get(model.name)
        if runner is None or runner.gone.is_set():
            runner = await self._start_runner(model)
        if not runner.ready.is_set():
            if runner.waiting >= self.limits.max_waiting:
                raise service_unavailable(f"{runner.waiting} requests wait for model {model.name!r} to load; "
                                          "retry later")
            runner.waiting += 1
            try:
                await self._wait_ready(runner)
            finally:
                runner.waiting -= 1
        runner.in_flight += 1
        return runner

    async def release(self, runner: Runner, keep_alive: float | None, touch: bool = True) -> None:
        """A request on `runner` is over; `touch`: it was a use, which sets the expiry (the default
        keep-alive when `keep_alive` is None) and the recency eviction goes by."""
        runner.in_flight -= 1
        if touch:
            runner.last_used = time.monotonic()
            seconds = self.limits.keep_alive_s if keep_alive is None else keep_alive
            runner.expires_at = runner.last_used + seconds
            if runner.in_flight == 0 and seconds == 0:  # after the answer is sent, not before
                asyncio.get_running_loop().call_soon(asyncio.ensure_future, self._unload_idle(runner))
        async with self.idle:
            self.idle.notify_all()

    async def unload(self, name: str, why: str) -> bool:
        """Stop model `name`'s child (it drains what is in flight); False when it is not loaded."""
        runner = self.runners.pop(name, None)
        if runner is None:
            return False
        runner.gone.set()
        if not runner.ready.is_set():  # wakes the requests waiting for it to load
            runner.failure, runner.unloaded_early = f"model {name!r} was unloaded while it loaded ({why})", True
            runner.ready.set()
        logger.info("unloading model %r (%s)", name, why)
        await asyncio.to_thread(stop_child, runner.process)
        async with self.idle:
            self.idle.notify_all()
        return True

    async def _unload_idle(self, runner: Runner) -> None:
        if runner.in_flight == 0 and self.runners.get(runner.name) is runner:
            await self.unload(runner.name, "keep_alive 0")

    async def expire(self) -> None:
        """Unload every idle runner past its expiry, and forget children that exited."""
        now = time.monotonic()
        for runner in list(self.runners.values()):
            if runner.process is not None and runner.process.poll() is not None and runner.ready.is_set():
                await self.unload(runner.name, f"its process exited with status {runner.process.returncode}")
            elif runner.loaded and runner.in_flight == 0 and now >= runner.expires_at:
                await self.unload(runner.name, "keep_alive expired")

    async def stop_all(self) -> None:
        for name in list(self.runners):
            await self.unload(name, "the server stops")
        await self.client.aclose()

    def loaded(self) -> list[Runner]:
        return [r for r in self.runners.values() if not r.gone.is_set()]

    # -- starting ------------------------------------------------------------------------------------

    async def _start_runner(self, model) -> Runner:
        estimate = model.size + RUNTIME_BYTES
        await self._make_room(model.name, estimate)
        current = self.runners.get(model.name)  # another request started it while this one waited
        if current is not None and not current.gone.is_set():
            return current
        port = self._free_port()
        runner = Runner(model.name, model.path, f"http://127.0.0.1:{port}", estimate=estimate)
        self.runners[model.name] = runner
        self.loads += 1
        logger.info("loading model %r from %s", model.name, model.path)
        try:
            runner.process = await asyncio.to_thread(self._start, model, port)
        except OSError as exc:
            self._failed(runner, f"its process could not start ({exc})")
            raise
        if runner.gone.is_set():  # unloaded (a delete, the server stopping) while the process started
            await asyncio.to_thread(stop_child, runner.process)
            raise service_unavailable(runner.failure)  # unload() said why
        asyncio.ensure_future(self._watch_start(runner))
        return runner

    async def _make_room(self, name: str, estimate: int) -> None:
        """Unload least recently used idle runners until `estimate` more bytes and one more model fit;
        wait for a runner to go idle when none is (503 after load_timeout_s). Meanwhile `name` is in
        `waiting_for_room`, which holds new requests for the loaded models back."""
        if self._fits(name, estimate):
            return
        self.waiting_for_room.append(name)
        try:
            await self._evict_until_fits(name, estimate)
        finally:
            self.waiting_for_room.remove(name)
            async with self.idle:
                self.idle.notify_all()

    async def _evict_until_fits(self, name: str, estimate: int) -> None:
        deadline = time.monotonic() + self.limits.load_timeout_s
        while not self._fits(name, estimate):
            idle = sorted((r for r in self.loaded() if r.ready.is_set() and r.in_flight == 0 and r.waiting == 0
                           and r.name != name), key=lambda r: r.last_used)
            if idle:
                self.evictions += 1
                await self.unload(idle[0].name, f"making room for model {name!r}")
                continue
            if not self.loaded():
                return  # nothing loaded: one model always gets its chance, whatever its estimate
            left = deadline - time.monotonic()
            if left <= 0:
                raise service_unavailable(f"no room to load model {name!r}: every loaded model is busy "
                                          f"(--max-loaded-models {self.limits.max_loaded}); retry later")
            await self._idle_or(left)

    async def _wait_for_turn(self, name: str) -> None:
        """Wait until no other model waits for room (503 after load_timeout_s)."""
        deadline = time.monotonic() + self.limits.load_timeout_s
        while any(other != name for other in self.waiting_for_room):
            left = deadline - time.monotonic()
            if left <= 0:
                raise service_unavailable(f"model {name!r} waits its turn behind models that load; retry later")
            await self._idle_or(left)

    async def _idle_or(self, left: float) -> None:
        """Until a runner goes idle or away, or a model got its room; a second at most."""
        async with self.idle:
            try:
                await asyncio.wait_for(self.idle.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass

    def _fits(self, name: str, estimate: int) -> bool:
        others = [r for r in self.loaded() if r.name != name]
        if len(others) >= self.limits.max_loaded:
            return False
        budget = self.limits.memory_budget
        return budget is None or sum(r.memory() for r in others) + estimate <= budget

    async def _watch_start(self, runner: Runner) -> None:
        """Poll the child's /health until it answers 200 (ready) or its process exits (failed)."""
        deadline = time.monotonic() + self.limits.load_timeout_s
        while not runner.gone.is_set():
            if runner.process.poll() is not None:
                return self._failed(runner, f"its process exited with status {runner.process.returncode} "
                                            "while loading (the server log says why)")
            if time.monotonic() > deadline:
                await asyncio.to_thread(stop_child, runner.process)
                return self._failed(runner, f"it did not answer within {self.limits.load_timeout_s:g} s")
            try:
                if (await self.client.get(f"{runner.url}/health")).status_code == 200:
                    logger.info("model %r loaded in %.1f s", runner.name, time.time() - runner.started_at)
                    runner.ready.set()
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(HEALTH_POLL_S)

    def _failed(self, runner: Runner, why: str) -> None:
        runner.failure = f"model {runner.name!r} failed to load: {why}"
        logger.error("%s", runner.failure)
        if self.runners.get(runner.name) is runner:
            del self.runners[runner.name]
        runner.gone.set()
        runner.ready.set()  # wakes the waiters, who read `failure`

    async def _wait_ready(self, runner: Runner) -> None:
        try:
            await asyncio.wait_for(runner.ready.wait(), timeout=self.limits.load_timeout_s + 5)
        except TimeoutError:
            raise service_unavailable(f"model {runner.name!r} is still loading; retry later") from None
        if runner.failure is not None:  # unloaded while it loaded: worth a retry; else it failed
            raise service_unavailable(runner.failure) if runner.unloaded_early else ServingError(
                500, runner.failure, "server_error")


def stop_child(process: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """SIGTERM (the child drains as `deepinfer serve` does), SIGKILL after `grace_s`."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def memory_budget(text: str | None) -> int | None:
    """--models-memory: "auto" (90% of the memory available now), "none", or a size such as 12GiB."""
    if text is None or text == "auto":
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.9)
        except (ValueError, OSError):
            return None
    if text == "none":
        return None
    from deepinfer.config import parse_size

    return parse_size(text, "--models-memory")
