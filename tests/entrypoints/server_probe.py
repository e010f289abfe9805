"""Probes of an in-process server (`AppServer`) for the hostile-body and tenancy tests: async
clients on the app's own event loop (each a peer address of its own), a log of the engine's steps,
and the check that the server is whole after a test (nothing running, every KV block free, a
normal request answered)."""

from __future__ import annotations

import asyncio
import time

import httpx

from deepinfer.entrypoints.openai.server import ServerSettings, build_app

HANG_S = 300.0  # a "must not hang" bound, never a timing assertion
JSON = {"Content-Type": "application/json"}


def async_client(server, peer: str = "10.0.0.1", headers: dict | None = None) -> httpx.AsyncClient:
    """An httpx client of the app for coroutines run on its loop (`server.call`); a fault inside
    the app is a 500 answer, as a real server gives."""
    transport = httpx.ASGITransport(app=server.app, client=(peer, 1000), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://deepinfer.test", timeout=HANG_S,
                             headers=headers)


class StepLog:
    """Counts the engine's steps, and notes the step count when a request was added, when its first
    output came and when its last one did (a finished one)."""

    def __init__(self, engine, monkeypatch):
        self.steps, self.added, self.first_output, self.finished = 0, {}, {}, {}
        step, add = engine.step, engine.add_request

        def counted_step():
            outputs = step()
            self.steps += 1
            for out in outputs:
                self.first_output.setdefault(out.request_id, self.steps)
                if out.finished:
                    self.finished[out.request_id] = self.steps
            return outputs

        def noted_add(prompt_ids, params, request_id, **kwargs):
            self.added[request_id] = self.steps
            return add(prompt_ids, params, request_id, **kwargs)

        monkeypatch.setattr(engine, "step", counted_step)
        monkeypatch.setattr(engine, "add_request", noted_add)

    def steps_to_finish(self, request_id: str) -> int:
        return self.finished[request_id] - self.added[request_id]

    def steps_to_first_output(self, request_id: str) -> int:
        return self.first_output[request_id] - self.added[request_id]


def check_whole(server, headers: dict | None = None) -> None:
    """Nothing runs any more (within HANG_S), a normal completion is answered, and every KV block
    is back in its pool."""
    engine = server.llm.engine
    deadline = time.monotonic() + HANG_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"requests still run {HANG_S} s after the test"
        time.sleep(0.05)
    resp = server.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers,
                              timeout=HANG_S)
    assert resp.status_code == 200, resp.text
    engine.kv_manager.check_no_leaks()


def serve(llm, scenario, monkeypatch, clients=(("127.0.0.1", 123),), **settings):
    """Run `scenario(app, *clients)` against a fresh app over `llm`'s engine, one httpx client per
    peer address in `clients`; every KV block must be free afterwards."""
    monkeypatch.setattr(llm.engine, "close", lambda: None)
    app = build_app(llm.engine, ServerSettings(model_name="m", **settings))

    async def main():
        async with app.router.lifespan_context(app):
            http = [httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=peer),
                                      base_url="http://test", timeout=120) for peer in clients]
            try:
                return await scenario(app, *http)
            finally:
                for client in http:
                    await client.aclose()

    result = asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()
    return result
