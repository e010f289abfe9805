"""The data-parallel front end: one API address in front of N `deepinfer serve` replicas.

    client ──> front end ──route──> replica r (its own engine and prefix cache)
               │ routing key: the prompt's first blocks (routing_key.py, router.py)
               │ /metrics: its routing counters + every replica's metrics, labelled replica="r"
               ├ /dp/register: replicas say where they listen (replicas.py); /dp/replicas lists them
               ├ /dashboard?replica=R: replica R's dashboard (its page, metrics and requests)
               └ every answer carries x-deepinfer-replica: the rank that served it

Every other path is passed through to the chosen replica as it is (body, headers, the streamed
answer), so the replica's validation, errors and streaming formats reach the client unchanged.
A replica that cannot be reached before the request was sent is marked down and the request is
routed again; one that fails after it was sent fails that request only (502 before the answer
starts; a cut stream after), and is marked down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import time

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.entrypoints.data_parallel.metrics import FrontendMetrics, merged_text
from deepinfer.entrypoints.data_parallel.replicas import HEALTH_INTERVAL_S, SECRET_HEADER, ReplicaSet
from deepinfer.entrypoints.data_parallel.router import PrefixRouter, block_hashes
from deepinfer.entrypoints.data_parallel.routing_key import routing_tokens
from deepinfer.entrypoints.openai.auth import api_key_dependency
from deepinfer.entrypoints.openai.body import BodySizeLimit
from deepinfer.entrypoints.openai.errors import install_error_handlers
from deepinfer.json_bounds import MAX_JSON_DEPTH, json_depth

logger = logging.getLogger("deepinfer.server")
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "proxy-authorization", "proxy-connection"}
_PROXY_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]
REPLICA_HEADER = "x-deepinfer-replica"  # on every proxied answer: the rank that served it


class Frontend:
    """Routing state shared by the routes: replicas, router, tokenizer, metrics, HTTP client."""

    def __init__(self, replicas: ReplicaSet, router: PrefixRouter, tokenizer, block_size: int, *,
                 secret: str = "", remote_joins: bool = False):
        self.replicas, self.router, self.tokenizer, self.block_size = replicas, router, tokenizer, block_size
        self.secret = secret  # what this front end's own children send (SECRET_HEADER) to register
        self.remote_joins = remote_joins  # may replicas register from other machines (needs --api-key)
        self.metrics = FrontendMetrics()
        self.failed = False  # every replica exited: the command ends with status 1
        self.stop = lambda: None  # ends the HTTP server (set by whoever runs it)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def hashes(self, path: str, raw: bytes) -> list[bytes]:
        """The request's block hashes; none for a body that is not bounded JSON with a prompt (the
        replica it goes to answers what such a body deserves)."""
        if not raw or json_depth(raw) > MAX_JSON_DEPTH:
            return []
        try:
            body = json.loads(raw)
            tokens = await asyncio.to_thread(routing_tokens, self.tokenizer, path, body)
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

    def went_down(self, rank: int, why: str) -> None:
        if self.replicas.mark_down(rank, why):
            self.router.forget(rank)

    async def check_health(self) -> None:
        """Every HEALTH_INTERVAL_S: ask each registered replica's /health. When every replica is a
        local child and all have exited, stop the front end (`failed` set, `stop` called)."""
        while True:
            await asyncio.gather(*(self._check(r) for r in list(self.replicas.replicas.values()) if r.url))
            for rank in self.replicas.restart_exited(time.monotonic()):
                self.router.forget(rank)  # its cache is gone
            if self.replicas.all_local_exited():
                codes = [r.process.returncode for r in self.replicas.replicas.values()]
                logger.error("every data-parallel replica exited (status %s): stopping the front end", codes)
                self.failed = True
                self.stop()
                return
            await asyncio.sleep(HEALTH_INTERVAL_S)

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

    async def _check(self, replica) -> None:
        try:
            ok = (await self.client.get(replica.url + "/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if self.replicas.health_result(replica.rank, ok):
            self.router.forget(replica.rank)


def build_frontend(frontend: Frontend, api_key: str | None, max_body_bytes: int = 8 << 20) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(frontend.check_health())
        yield
        task.cancel()
        await frontend.client.aclose()

    app = FastAPI(title="DeepInfer data-parallel front end", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)  # as every replica: 413 above it
    app.include_router(_own_routes(frontend))
    app.include_router(_register_route(frontend), dependencies=[Depends(api_key_dependency(api_key))])
    app.include_router(_proxy_route(frontend))
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
        texts = await asyncio.gather(*(_replica_metrics(frontend, r) for r in frontend.replicas.replicas.values()))
        body = merged_text(frontend.metrics.registry, {rank: t for rank, t in texts if t is not None})
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


async def _replica_metrics(frontend: Frontend, replica) -> tuple[int, str | None]:
    if not replica.up:
        return replica.rank, None
    try:
        answer = await frontend.client.get(replica.url + "/metrics", timeout=2.0)
    except httpx.HTTPError:
        return replica.rank, None
    return replica.rank, answer.text if answer.status_code == 200 else None


def _register_route(frontend: Frontend) -> APIRouter:
    router = APIRouter()

    @router.get("/dp/replicas")
    async def replicas() -> Response:
        return JSONResponse({"replicas": frontend.table()})

    @router.post("/dp/register")
    async def register(request: Request) -> Response:
        try:
            body = await request.json()
            rank, url = int(body["rank"]), str(body["url"])
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"/dp/register: a JSON body {{rank, url}} is needed ({exc!r})")
        refusal = registration_refusal(frontend, rank, request.headers.get(SECRET_HEADER),
                                       request.client.host if request.client else "")
        if refusal:
            return _error(403, f"/dp/register: {refusal}")
        try:
            frontend.replicas.register(rank, url)
        except ValueError as exc:
            return _error(400, f"/dp/register: {exc}")
        return JSONResponse({"status": "ok"})

    return router


def registration_refusal(frontend: Frontend, rank: int, secret: str | None, client_host: str) -> str | None:
    """Why a registration is refused, or None. A rank this front end started may be registered only
    by its child (the secret it was given); another rank only from this machine, unless the front end
    has an API key (which the registration then carried)."""
    replica = frontend.replicas.replicas.get(rank)
    if replica is not None and replica.process is not None:
        if not secret or not hmac.compare_digest(secret, frontend.secret):
            return f"rank {rank} is a replica this front end started; only that process registers it"
        return None
    if not frontend.remote_joins and not _is_loopback(client_host):
        return (f"a replica on {client_host} may not join: start the front end with --api-key to let replicas "
                f"on other machines join (they send the key)")
    return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _proxy_route(frontend: Frontend) -> APIRouter:
    router = APIRouter()

    @router.api_route("/{path:path}", methods=_PROXY_METHODS)
    async def proxy(path: str, request: Request) -> Response:
        raw = await request.body()
        by_prefix = request.method == "POST" and frontend.router.policy == "prefix"
        hashes = await frontend.hashes("/" + path, raw) if by_prefix else []  # other policies read no key
        try:
            pinned = _pinned(frontend, "/" + path, request.query_params.get("replica"))
        except ValueError as exc:
            return _error(400, str(exc))
        return await _forward(frontend, request, raw, hashes, pinned)

    return router


def _pinned(frontend: Frontend, path: str, replica: str | None) -> int | None:
    """The replica a dashboard request must reach: `?replica=R`, else the lowest rank up (the page
    shows one replica's engine). None for every other path. ValueError naming a bad `replica`."""
    if not path.startswith("/dashboard"):
        return None
    if replica is None:
        return min(frontend.replicas.loads(), default=None)
    if not replica.isdigit() or int(replica) not in frontend.replicas.replicas:
        raise ValueError(f"replica {replica!r} is not a data-parallel rank (0..{len(frontend.replicas.replicas) - 1})")
    return int(replica)


async def _forward(frontend: Frontend, request: Request, raw: bytes, hashes: list[bytes],
                   pinned: int | None = None) -> Response:
    """Send the request to its replica; on a replica that cannot be reached, mark it down and route again."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    for _ in range(len(frontend.replicas.replicas)):
        try:
            replica = frontend.choose(hashes, pinned)
        except ValueError as exc:
            return _error(503, f"{exc}: try again later")
        url = replica.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = frontend.client.build_request(request.method, url, content=raw, headers=headers)
        replica.in_flight += 1
        try:
            answer = await frontend.client.send(upstream, stream=True)
        except httpx.ConnectError as exc:  # never reached it: nothing was done there
            replica.in_flight -= 1
            frontend.went_down(replica.rank, f"connect failed ({exc})")
            continue
        except httpx.HTTPError as exc:
            replica.in_flight -= 1
            return _failed(frontend, replica, exc)
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(_relay(frontend, replica, answer), status_code=answer.status_code,
                                 headers={**kept, REPLICA_HEADER: str(replica.rank)})
    return _error(503, "no data-parallel replica is up: try again later")


async def _relay(frontend: Frontend, replica, answer: httpx.Response):
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        frontend.metrics.failed.labels(str(replica.rank)).inc()
        frontend.went_down(replica.rank, f"answer cut ({exc!r})")
        raise
    finally:
        replica.in_flight -= 1
        await answer.aclose()


def _failed(frontend: Frontend, replica, exc: Exception) -> Response:
    frontend.metrics.failed.labels(str(replica.rank)).inc()
    frontend.went_down(replica.rank, f"request failed ({exc!r})")
    error = _error(502, f"data-parallel replica {replica.rank} failed before answering: {exc!r}")
    error.headers[REPLICA_HEADER] = str(replica.rank)  # the one that failed
    return error


def _error(status: int, message: str) -> Response:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
