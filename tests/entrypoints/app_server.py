"""The app of `deepinfer serve` in this process, for tests of the API's semantics: no subprocess,
and one model load for every test that shares it.

`AppServer(*flags)` takes the flags of `deepinfer serve` (the engine's and the server's own; the
connection limits and the shutdown grace belong to the launcher and its process, which
`live_server.LiveServer` starts). The app's lifespan (the engine thread, the tokenizer pool) runs
on an event loop in a thread of its own, and every request is served on that loop:

- `client`, a sync httpx.Client, reaches the app through httpx's ASGI transport. The transport
  hands over each answer whole: a stream arrives at once, and a client cannot leave early. A
  request's read timeout still holds (then httpx.ReadTimeout, and the request is cancelled).
- `openai()`: the official openai client on `client`.
- `listen()` serves the app with uvicorn on a free 127.0.0.1 port as well (`url`, `port`), for
  tests that need a real connection: a client that leaves mid-answer, or another process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time

import httpx
from live_server import parse_metrics

BASE_URL = "http://deepinfer.test"


class AppServer:
    """`deepinfer serve *flags` as an in-process app; use as a context manager (the engine is
    closed on exit). `api_key` as in LiveServer."""

    def __init__(self, *flags: str, api_key: str | None = None):
        self.flags = [*flags, *(["--api-key", api_key] if api_key else [])]
        self.api_key = api_key
        self.llm = self.app = self.client = None
        self.url: str | None = None
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lifespan = None
        self._uvicorn = None
        self._served: concurrent.futures.Future | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self) -> AppServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> AppServer:
        from deepinfer.entrypoints.engine_args import make_llm
        from deepinfer.entrypoints.openai.server import build_app

        args = serve_args(self.flags)
        self.llm = make_llm(args)
        self.app = build_app(self.llm.engine, server_settings(args))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="app-event-loop", daemon=True)
        self._thread.start()
        lifespan = self.app.router.lifespan_context(self.app)
        self.call(lifespan.__aenter__(), timeout=60)
        self._lifespan = lifespan
        self.client = httpx.Client(transport=_LoopTransport(self.app, self._loop), base_url=BASE_URL, timeout=60)
        return self

    def call(self, coro, timeout: float | None = None):
        """Run `coro` on the app's event loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def listen(self) -> str:
        """Serve the app on a free 127.0.0.1 port too (uvicorn, on the app's loop); the URL."""
        if self.url is None:
            import uvicorn

            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            config = uvicorn.Config(self.app, lifespan="off", log_config=None, log_level="warning",
                                    timeout_graceful_shutdown=5)
            self._uvicorn = uvicorn.Server(config)
            self._served = asyncio.run_coroutine_threadsafe(self._uvicorn.serve(sockets=[sock]), self._loop)
            deadline = time.monotonic() + 30
            while not self._uvicorn.started:
                if self._served.done():
                    self._served.result()  # raises what stopped it
                assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
                time.sleep(0.01)
            self.port = sock.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    def close(self) -> None:
        if self._served is not None:
            self._uvicorn.should_exit = True
            self._served.result(30)
            self._served = None
        if self._lifespan is not None:
            self.call(self._lifespan.__aexit__(None, None, None), timeout=60)  # stops the engine thread
            self._lifespan = None
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()
            self._thread = None
        if self.client is not None:
            self.client.close()
        if self.llm is not None:
            self.llm.close()

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {'name{label="v",...}': value}, as LiveServer.metrics."""
        return parse_metrics(self.client.get("/metrics").text)

    def openai(self, api_key: str = "unused", **kwargs):
        """The official openai client on this app, without retries (a test sees the first answer)."""
        from openai import OpenAI

        return OpenAI(base_url=f"{BASE_URL}/v1", api_key=api_key, max_retries=0, http_client=self.client,
                      **kwargs)


def serve_args(flags: list[str]):
    from deepinfer.entrypoints import cli

    return cli.build_parser().parse_args(["serve", *flags])


def server_settings(args):
    """The ServerSettings `deepinfer serve` builds from its flags."""
    from deepinfer.entrypoints.openai.args import server_settings as settings

    return settings(args)


class _LoopTransport(httpx.BaseTransport):
    """A sync transport that hands each request to the app on its event loop (httpx's ASGI
    transport) and waits for the whole answer, at most the request's read timeout."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop):
        # a fault inside the app is a 500 answer, as a real server gives
        self._asgi = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self._loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()  # the body as a stream both sync and async
        future = asyncio.run_coroutine_threadsafe(self._answer(request), self._loop)
        timeout = request.extensions.get("timeout", {}).get("read")
        try:
            status, headers, body = future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the app sees the request cancelled, as when a client leaves
            raise httpx.ReadTimeout(f"no answer within {timeout} s", request=request) from None
        return httpx.Response(status, headers=headers, content=body, request=request)

    async def _answer(self, request: httpx.Request) -> tuple[int, list, bytes]:
        response = await self._asgi.handle_async_request(request)
        return response.status_code, response.headers.raw, await response.aread()
