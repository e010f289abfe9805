"""The data-parallel front end: one API address in front of N `deepinfer serve` replicas.

    client ──> front end ──route──> replica r (its own engine and prefix cache)
               │ routing key: the prompt's first blocks (routing_key.py, router.py), read off the event loop
               │ /metrics: its routing counters + every replica's metrics, labelled replica="r" (metrics.py)
               ├ /dp/register: replicas say where they listen, with a secret (registration.py, identity.py)
               ├ /dp/replicas lists them (behind --api-key)
               ├ /dashboard?replica=R: replica R's dashboard (its page, metrics and requests)
               └ every answer carries x-deepinfer-replica: the rank that served it

The replica server's API routes are passed through to the chosen replica (proxy.py: body, the
headers it needs, the streamed answer), so the replica's validation, errors and streaming formats
reach the client unchanged; every other path is the front end's 404. With --max-requests-per-client
the front end counts each client's requests in flight itself (`ClientLimit`: a client is its API key,
else its peer address) and tells the replica who the client is.

A health task asks every replica's /health each second (`check_health`); it is supervised: an
exception is logged with its traceback, counted, and the task goes on, so a replica that dies is
always noticed (and a local child started again).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time

import httpx
from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from deepinfer.entrypoints.data_parallel.metrics import (
    MAX_METRICS_BYTES,
    FrontendMetrics,
    merged_text,
    replica_families,
)
from deepinfer.entrypoints.data_parallel.proxy import proxy_routes
from deepinfer.entrypoints.data_parallel.registration import registration_route
from deepinfer.entrypoints.data_parallel.replicas import HEALTH_INTERVAL_S, ReplicaSet
from deepinfer.entrypoints.data_parallel.router import PrefixRouter, block_hashes
from deepinfer.entrypoints.data_parallel.routing_key import routing_tokens
from deepinfer.entrypoints.openai.admission import ClientShares
from deepinfer.entrypoints.openai.auth import api_key_dependency
from deepinfer.entrypoints.openai.body import BodySizeLimit
from deepinfer.entrypoints.openai.errors import install_error_handlers
from deepinfer.json_bounds import MAX_JSON_DEPTH, json_depth
from deepinfer.serving.admission import ClientSeats, client_key
from deepinfer.serving.tenancy import Credentials

logger = logging.getLogger("deepinfer.server")
DEFAULT_READ_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 2.0


class Frontend:
    """Routing state shared by the routes: replicas, router, tokenizer, metrics, HTTP client.

    `child_secret`: what this front end's own children send to register (and are sent); `cluster_secret`:
    what every other replica sends and is sent (None: no other replica may join)."""

    def __init__(self, replicas: ReplicaSet, router: PrefixRouter, tokenizer, block_size: int, *,
                 child_secret: str = "", cluster_secret: str | None = None, api_key: str | None = None,
                 read_timeout: float = DEFAULT_READ_TIMEOUT_S):
        self.replicas, self.router, self.tokenizer, self.block_size = replicas, router, tokenizer, block_size
        self.child_secret, self.cluster_secret = child_secret, cluster_secret
        self.credentials = Credentials(api_key)  # a client presenting one of its keys is that key's client
        self.read_timeout = read_timeout
        self.metrics = FrontendMetrics()
        self.failed = False  # every replica exited: the command ends with status 1
        self.stop = lambda: None  # ends the HTTP server (set by whoever runs it)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="deepinfer-dp-parse")
        self._down: dict[int, asyncio.Event] = {}  # set when that replica goes down (its requests fail)
        self._rejections_logged: set[tuple[int, str]] = set()
        replicas.on_down = self._replica_down

    def secret_for(self, replica) -> str:
        """The secret a replica is sent with each request (the one it registered with)."""
        return self.child_secret if replica.process is not None else (self.cluster_secret or "")

    async def hashes(self, path: str, raw: bytes) -> list[bytes]:
        """The request's block hashes, read in the parse pool (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._hashes, path, raw)

    def _hashes(self, path: str, raw: bytes) -> list[bytes]:
        """None for a body that is not bounded JSON with a prompt (the replica it goes to answers
        what such a body deserves)."""
        if not raw or json_depth(raw) > MAX_JSON_DEPTH:
            return []
        try:
            tokens = routing_tokens(self.tokenizer, path, json.loads(raw))
        except Exception as exc:  # a key that cannot be read routes by load alone
            logger.debug("no routing key for %s: %r", path, exc)
            return []
        return block_hashes(tokens, self.block_size)

    def choose(self, hashes: list[bytes], pinned: int | None = None):
        """The replica for a request: `pinned` when it is up (ValueError when not), else the router's."""
        if pinned is not None:
            if pinned not in self.replicas.loads():
                raise ValueError(f"data-parallel replica {pinned} is not up")
            return self.replicas.replicas[pinned]
        route = self.router.route(hashes, self.replicas.loads())
        self.metrics.routed.labels(str(route.rank), route.reason).inc()
        self.metrics.matched_blocks.inc(route.matched_blocks)
        return self.replicas.replicas[route.rank]

    def down_event(self, rank: int) -> asyncio.Event:
        """Set once replica `rank` goes down: a request sent to it waits on this as well."""
        return self._down.setdefault(rank, asyncio.Event())

    def client_of(self, scope) -> str:
        """Whom a request counts for at the front end (`serving.admission.client_key`)."""
        peer = scope.get("client")
        return client_key(Headers(scope=scope).getlist, peer[0] if peer else None, self.credentials)

    def went_down(self, rank: int, why: str) -> None:
        self.replicas.mark_down(rank, why)

    def _replica_down(self, rank: int) -> None:
        self.router.forget(rank)  # its cache is gone
        event = self._down.pop(rank, None)
        if event is not None:
            event.set()  # its requests in flight fail now (proxy.py), not when they time out

    async def check_health(self) -> None:
        """The health rounds, supervised: an exception is logged with its traceback and counted, and
        the rounds go on. Returns only when the front end stops (every local replica exited)."""
        while True:
            try:
                await self._health_rounds()
                return
            except Exception:
                self.metrics.health_task_restarts.inc()
                logger.exception("the data-parallel health check failed; it goes on")
                await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _health_rounds(self) -> None:
        """Every HEALTH_INTERVAL_S: ask each registered replica's /health. When every replica is a
        local child and all have exited, stop the front end (`failed` set, `stop` called)."""
        while True:
            await asyncio.gather(*(self._check(r) for r in list(self.replicas.replicas.values()) if r.url))
            self.replicas.restart_exited(time.monotonic())
            self.metrics.health_rounds.inc()
            if self.replicas.all_local_exited():
                codes = [r.process.returncode for r in self.replicas.replicas.values()]
                logger.error("every data-parallel replica exited (status %s): stopping the front end", codes)
                self.failed = True
                self.stop()
                return
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _check(self, replica) -> None:
        try:
            answer = await self.client.get(replica.url + "/health", timeout=HEALTH_TIMEOUT_S)
            ok = answer.status_code == 200
        except httpx.HTTPError:
            ok = False
        self.replicas.health_result(replica.rank, ok)

    def table(self) -> list[dict]:
        """Each replica's rank, address, state and load (also set into the gauges)."""
        rows = []
        for r in self.replicas.replicas.values():
            self.metrics.up.labels(str(r.rank)).set(int(r.up))
            self.metrics.in_flight.labels(str(r.rank)).set(r.in_flight)
            rows.append({"rank": r.rank, "url": r.url or None, "up": r.up, "in_flight": r.in_flight,
                         "local": r.process is not None, "pid": r.process.pid if r.process else None,
                         "restarts": len(r.restarts)})
        return rows

    async def replica_metrics(self, replica) -> str | None:
        """A registered replica's /metrics text, at most MAX_METRICS_BYTES (else None, counted)."""
        if not (replica.up and replica.url):
            return None
        try:
            async with self.client.stream("GET", replica.url + "/metrics", timeout=HEALTH_TIMEOUT_S) as answer:
                if answer.status_code != 200:
                    return None
                body = b""
                async for chunk in answer.aiter_raw():
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        self.metrics_rejected(replica.rank, "too_large", f"more than {MAX_METRICS_BYTES} bytes")
                        return None
        except httpx.HTTPError:
            return None
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            self.metrics_rejected(replica.rank, "unreadable", "not UTF-8 text")
            return None

    def metrics_rejected(self, rank: int, reason: str, detail: str) -> None:
        """Count a replica's metrics left out; log it the first time for each reason."""
        self.metrics.metrics_rejected.labels(str(rank), reason).inc()
        if (rank, reason) not in self._rejections_logged:
            self._rejections_logged.add((rank, reason))
            logger.warning("data-parallel replica %d's metrics left out (%s): %s", rank, reason, detail)

    async def close(self) -> None:
        await self.client.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)


def build_frontend(frontend: Frontend, max_body_bytes: int = 8 << 20,
                   max_requests_per_client: int | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(frontend.check_health(), name="deepinfer-dp-health")
        yield
        task.cancel()
        await frontend.close()

    app = FastAPI(title="DeepInfer data-parallel front end", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.frontend = frontend
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)  # as every replica: 413 above it
    if max_requests_per_client is not None:
        app.add_middleware(ClientShares, seats=ClientSeats(max_requests_per_client), client_of=frontend.client_of)
    install_error_handlers(app)  # after the middlewares: their 4xx answers are logged too
    app.include_router(_own_routes(frontend))
    app.include_router(registration_route(frontend))
    app.include_router(_replicas_route(frontend), dependencies=[Depends(api_key_dependency(frontend.credentials))])
    app.include_router(proxy_routes(frontend, lambda path, replica: _pinned(frontend, path, replica)))
    return app


def _own_routes(frontend: Frontend) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        up = sorted(frontend.replicas.loads())
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas_up": up},
                            status_code=200 if up else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        frontend.table()
        replicas = list(frontend.replicas.replicas.values())
        texts = await asyncio.gather(*(frontend.replica_metrics(r) for r in replicas))
        given = {r.rank: text for r, text in zip(replicas, texts, strict=True) if text is not None}
        families, rejected = await asyncio.to_thread(replica_families, given)
        for rank, why in rejected.items():
            frontend.metrics_rejected(rank, why.reason, str(why))
        body = await asyncio.to_thread(merged_text, frontend.metrics.registry, families)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


def _replicas_route(frontend: Frontend) -> APIRouter:
    router = APIRouter()

    @router.get("/dp/replicas")
    async def replicas() -> Response:
        return JSONResponse({"replicas": frontend.table()})

    return router


def _pinned(frontend: Frontend, path: str, replica: str | None) -> int | None:
    """The replica a dashboard request must reach: `?replica=R`, else the lowest rank up (the page
    shows one replica's engine). None for every other path. ValueError naming a bad `replica`."""
    if not path.startswith("/dashboard"):
        return None
    if replica is None:
        return min(frontend.replicas.loads(), default=None)
    if not (replica.isascii() and replica.isdigit()) or int(replica) not in frontend.replicas.replicas:
        raise ValueError(f"replica {replica[:20]!a} is not a data-parallel rank (0..{frontend.replicas.size - 1})")
    return int(replica)
