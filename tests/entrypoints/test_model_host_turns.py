"""The model host's RunnerPool with stand-in children: a model that waits for room gets its turn
while the loaded model has work coming in, and a model that is loading is never unloaded for another."""

from __future__ import annotations

import asyncio
import itertools
import threading

import httpx
import pytest

from deepinfer.entrypoints.model_host.catalog import HostedModel
from deepinfer.entrypoints.model_host.runners import HostLimits, RunnerPool
from deepinfer.serving.errors import ServingError


class _Child:
    """What RunnerPool asks of a child process: it runs until it is stopped."""

    _pids = itertools.count(1 << 22)

    def __init__(self):
        self.pid, self.returncode = next(self._pids), None

    def poll(self):
        return self.returncode

    def send_signal(self, _signal):
        self.returncode = 0

    def wait(self, _timeout=None):
        return self.returncode

    def kill(self):
        self.returncode = -9


class _Children:
    """Starts stand-in children; a child answers /health once its model is in `healthy`."""

    def __init__(self):
        self.healthy: set[str] = set()
        self.started: list[str] = []
        self.by_port: dict[int, str] = {}
        self.ports = itertools.count(20000)
        self.slow_start: dict[str, threading.Event] = {}  # a model's process starts once its event is set

    def start(self, model, port):
        self.started.append(model.name)
        if model.name in self.slow_start:
            assert self.slow_start[model.name].wait(10)
        self.by_port[port] = model.name
        return _Child()

    def health(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if self.by_port[request.url.port] in self.healthy else 503)


def _pool(children: _Children, **limits) -> RunnerPool:
    pool = RunnerPool(HostLimits(**limits), children.start, lambda: next(children.ports))
    pool.client = httpx.AsyncClient(transport=httpx.MockTransport(children.health))
    return pool


def _model(name: str) -> HostedModel:
    return HostedModel(name, f"/models/{name}.gguf", size=1, modified=0.0, source="models-dir")


async def _settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_a_waiting_model_gets_its_turn_while_the_loaded_one_keeps_getting_requests():
    async def scenario():
        children = _Children()
        children.healthy |= {"a", "b"}
        pool = _pool(children, max_loaded=1, load_timeout_s=30)
        a = await pool.acquire(_model("a"))  # a is loaded and busy
        waiting_b = asyncio.ensure_future(pool.acquire(_model("b")))
        await _settle()
        assert pool.waiting_for_room == ["b"] and not waiting_b.done()
        # a new request for a waits behind b: admitting it would keep a busy for as long as requests come
        late_a = asyncio.ensure_future(pool.acquire(_model("a")))
        await _settle()
        assert not late_a.done() and a.in_flight == 1
        await pool.release(a, None)  # a drains: b unloads it and loads
        b = await asyncio.wait_for(waiting_b, 10)
        assert b.name == "b" and children.started == ["a", "b"] and pool.evictions == 1
        assert not late_a.done()  # a is gone, and b is busy: a waits for room in turn
        await pool.release(b, None)
        assert (await asyncio.wait_for(late_a, 10)).name == "a"
        assert children.started == ["a", "b", "a"] and pool.waiting_for_room == []
        await pool.stop_all()

    asyncio.run(scenario())


def test_a_loading_model_is_never_unloaded_to_make_room():
    async def scenario():
        children = _Children()
        children.slow_start["a"] = threading.Event()
        pool = _pool(children, max_loaded=1, load_timeout_s=30)
        loading_a = asyncio.ensure_future(pool.acquire(_model("a")))
        await asyncio.sleep(0.1)
        assert children.started == ["a"] and not loading_a.done()  # a's process is starting
        waiting_b = asyncio.ensure_future(pool.acquire(_model("b")))
        await asyncio.sleep(0.1)
        children.slow_start["a"].set()
        await asyncio.sleep(0.3)  # a's process runs, /health not yet 200
        assert "a" in pool.runners and not waiting_b.done() and pool.evictions == 0
        children.healthy |= {"a", "b"}
        a = await asyncio.wait_for(loading_a, 10)  # a's waiter is served, not left waiting for ever
        assert a.loaded and a.in_flight == 1
        await pool.release(a, None)
        assert (await asyncio.wait_for(waiting_b, 10)).name == "b"
        await pool.stop_all()

    asyncio.run(scenario())


def test_requests_waiting_for_a_model_that_is_unloaded_while_it_loads_get_503():
    async def scenario():
        children = _Children()
        pool = _pool(children, max_loaded=2, load_timeout_s=30)
        loading = asyncio.ensure_future(pool.acquire(_model("a")))
        await _settle()
        assert await pool.unload("a", "deleted")
        with pytest.raises(ServingError) as caught:
            await asyncio.wait_for(loading, 10)
        assert caught.value.status_code == 503 and "'a'" in caught.value.problem and "unloaded" in caught.value.problem
        await pool.stop_all()

    asyncio.run(scenario())


def test_a_model_that_waits_too_long_for_its_turn_gets_503_naming_it():
    async def scenario():
        children = _Children()
        children.healthy |= {"a", "b"}
        pool = _pool(children, max_loaded=1, load_timeout_s=0.5)
        a = await pool.acquire(_model("a"))
        with pytest.raises(ServingError) as caught:
            await pool.acquire(_model("b"))  # a never goes idle
        assert caught.value.status_code == 503 and "'b'" in caught.value.problem
        assert pool.waiting_for_room == []
        await pool.release(a, None)
        await pool.stop_all()

    asyncio.run(scenario())
