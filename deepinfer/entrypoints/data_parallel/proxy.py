"""What a data-parallel front end passes to its replicas, and how.

Routes. Only the replica server's own API routes are forwarded (ALLOWED_ROUTES; a test holds the
list against the server's route table); any other path or method is answered by the front end
itself (404 / 405) and never reaches a replica. A path that would change on the way (dot segments)
is a 404 as well. /health and /metrics are the front end's own; NOT_FORWARDED lists the server
routes that are not passed on, and why.

Headers. A replica gets only REQUEST_HEADERS of the client's (the body's type, what the client
accepts, the API key headers, which the replica checks and names tenants by, and Anthropic's
version headers), plus `x-deepinfer-client` (who the client is, identity.py) beside that replica's
secret. The client gets only ANSWER_HEADERS of the replica's, plus `x-deepinfer-replica`.

Failures. A replica that cannot be reached (connect failed) is marked down and the request is
routed again. Once sent, a request fails alone: 504 when the replica sends nothing for
--data-parallel-read-timeout seconds, 502 when its connection fails or the replica goes down (health
checks, its process exited) while the request waits, each naming the replica in
`x-deepinfer-replica`; a stream already under way ends with an error event (stream_errors.py).
A client that leaves before its answer started closes the request to the replica, whose own
disconnect watcher then aborts it; one that leaves a stream does the same.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from deepinfer.entrypoints.data_parallel.identity import CLIENT_HEADER, SECRET_HEADER
from deepinfer.entrypoints.data_parallel.stream_errors import StreamTail
from deepinfer.entrypoints.openai.errors import error_response
from deepinfer.serving.errors import ServingError

logger = logging.getLogger("deepinfer.server")

_GET, _POST = ("GET",), ("POST",)
ALLOWED_ROUTES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("/", _GET), ("/static/{file_path:path}", _GET), ("/dashboard", _GET), ("/dashboard/state", _GET),
    ("/v1/models", _GET), ("/v1/models/{model_id:path}", _GET),
    ("/v1/completions", _POST), ("/v1/chat/completions", _POST), ("/v1/embeddings", _POST),
    ("/v1/responses", _POST), ("/v1/responses/{response_id}", ("GET", "DELETE")),
    ("/v1/responses/{response_id}/input_items", _GET),
    ("/v1/messages", _POST), ("/v1/messages/count_tokens", _POST),
    ("/v1/rerank", _POST), ("/rerank", _POST), ("/v2/rerank", _POST), ("/v1/score", _POST), ("/score", _POST),
    ("/tokenize", _POST), ("/detokenize", _POST), ("/infill", _POST),
    ("/api/version", _GET), ("/api/tags", _GET), ("/api/ps", _GET), ("/api/show", _POST), ("/api/chat", _POST),
    ("/api/generate", _POST), ("/api/embed", _POST), ("/api/embeddings", _POST),
)
NOT_FORWARDED = {
    "/health": "the front end's own (replicas up)",
    "/metrics": "the front end's own (its counters and every replica's, labelled)",
    "/openapi.json": "the server's schema is not part of its API",
    "/v1/load_lora_adapter": "it would load an adapter into one replica only",
    "/v1/unload_lora_adapter": "it would unload an adapter from one replica only",
}
REQUEST_HEADERS = ("content-type", "accept", "authorization", "x-api-key", "anthropic-version", "anthropic-beta")
ANSWER_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "retry-after", "x-request-id",
                  "content-security-policy", "www-authenticate", "etag", "last-modified")
REPLICA_HEADER = "x-deepinfer-replica"  # on every proxied answer: the rank that served it (or failed)


class ReplicaWentDown(Exception):
    """The replica serving a request went down (health checks, its process exited) meanwhile."""


class ClientLeft(Exception):
    """The client went away before its answer started."""


def proxy_routes(frontend, pinned) -> APIRouter:
    """The allowed routes, each passed to the replica `frontend` chooses (`pinned(path, replica)`: the
    rank a dashboard request must reach, or None)."""
    router = APIRouter()

    async def proxy(request: Request) -> Response:
        raw = await request.body()
        path = request.url.path
        by_prefix = request.method == "POST" and frontend.router.policy == "prefix"
        hashes = await frontend.hashes(path, raw) if by_prefix else []  # other policies read no key
        try:
            rank = pinned(path, request.query_params.get("replica"))
        except ValueError as exc:
            raise ServingError(400, str(exc), path="replica", names_field=False) from None
        return await forward(frontend, request, raw, hashes, rank)

    for path, methods in ALLOWED_ROUTES:
        router.add_api_route(path, proxy, methods=list(methods), include_in_schema=False)
    return router


def upstream_headers(frontend, request: Request) -> list[tuple[str, str]]:
    """The client's headers a replica gets (REQUEST_HEADERS, every value of each), and who the client is."""
    kept = [(name, value) for name, value in request.headers.items() if name.lower() in REQUEST_HEADERS]
    client = request.scope.get("deepinfer.client") or frontend.client_of(request.scope)  # the seats' one, if counted
    return [*kept, ("accept-encoding", "identity"), (CLIENT_HEADER, client)]


async def forward(frontend, request: Request, raw: bytes, hashes: list[bytes], pinned: int | None = None) -> Response:
    """Send the request to its replica; on a replica that cannot be reached, mark it down and route again."""
    headers = upstream_headers(frontend, request)
    for _ in range(frontend.replicas.size):
        try:
            replica = frontend.choose(hashes, pinned)
        except ValueError as exc:
            return _error(503, f"{exc}: try again later", request.url.path)
        url = httpx.URL(replica.url).copy_with(path=request.url.path, query=request.url.query.encode())
        if url.path != request.url.path:  # dot segments: the replica would see another path
            return _error(404, f"Not Found: {request.url.path!a}", request.url.path)
        upstream = frontend.client.build_request(request.method, url, content=raw,
                                                 headers=[*headers, (SECRET_HEADER, frontend.secret_for(replica))])
        down = frontend.down_event(replica.rank)
        replica.in_flight += 1
        try:
            answer = await send_unless_gone(frontend.client, request, upstream, down)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it: nothing was done there
            replica.in_flight -= 1
            frontend.went_down(replica.rank, f"connect failed ({exc!r})")
            continue
        except (httpx.HTTPError, ReplicaWentDown, ClientLeft) as exc:
            replica.in_flight -= 1
            return _failed(frontend, replica, exc, request.url.path)
        return _relayed(frontend, replica, answer, down, request.url.path)
    return _error(503, "no data-parallel replica is up: try again later", request.url.path)


async def send_unless_gone(client: httpx.AsyncClient, request: Request, upstream: httpx.Request,
                           down: asyncio.Event) -> httpx.Response:
    """The server's answer to `upstream` (its head; the body streams), unless the client of `request`
    leaves (ClientLeft) or the server goes down (`down` set: ReplicaWentDown) first: then the request
    to the server is closed, and the server's own disconnect watcher aborts it there. The
    data-parallel front end and the model host (`model_host/relay.py`) both send through it."""
    send = asyncio.ensure_future(client.send(upstream, stream=True))
    left = asyncio.ensure_future(_client_left(request))
    gone = asyncio.ensure_future(down.wait())
    try:
        await asyncio.wait({send, left, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        send.cancel()
        raise
    finally:
        left.cancel()
        gone.cancel()
    if send.done():  # the answer's head, or the error of sending
        return send.result()
    send.cancel()  # closes its connection
    await asyncio.wait({send})
    if not send.cancelled() and send.exception() is None:  # it came after all: nobody takes it
        await send.result().aclose()
    raise ClientLeft() if left.done() and not left.cancelled() else ReplicaWentDown()


async def _client_left(request: Request) -> None:
    """Returns once the client of `request` (whose body was read) has gone away."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception as exc:  # the server cannot tell any more: as good as gone
        logger.debug("waiting for a client to leave failed: %r", exc)


def _relayed(frontend, replica, answer: httpx.Response, down: asyncio.Event, path: str) -> Response:
    kept = {k: v for k, v in answer.headers.items() if k.lower() in ANSWER_HEADERS}
    tail = StreamTail(path, answer.headers.get("content-type", ""))
    return StreamingResponse(_relay(frontend, replica, answer, down, tail), status_code=answer.status_code,
                             headers={**kept, REPLICA_HEADER: str(replica.rank)})


async def _relay(frontend, replica, answer: httpx.Response, down: asyncio.Event, tail: StreamTail):
    """The answer's bytes as they come; a cut stream ends with its API's error event (stream_errors.py)."""
    try:
        async for chunk in _chunks(answer, down):
            tail.seen(chunk)
            yield chunk
    except (httpx.HTTPError, ReplicaWentDown) as exc:
        frontend.metrics.failed.labels(str(replica.rank)).inc()
        why = _why(frontend, exc)
        if isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException):
            frontend.went_down(replica.rank, f"answer cut ({exc!r})")
        event = tail.error_event(f"data-parallel replica {replica.rank} failed during this answer: {why}")
        if event is None:
            raise
        yield event
    finally:
        replica.in_flight -= 1
        await answer.aclose()


async def _chunks(answer: httpx.Response, down: asyncio.Event):
    """The answer's raw chunks; ReplicaWentDown as soon as `down` is set."""
    chunks = answer.aiter_raw()
    gone = asyncio.ensure_future(down.wait())
    step = None
    try:
        while True:
            step = asyncio.ensure_future(anext(chunks, None))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise ReplicaWentDown()
            chunk = step.result()
            if chunk is None:
                return
            yield chunk
    finally:
        gone.cancel()
        if step is not None and not step.done():
            step.cancel()


def _why(frontend, exc: Exception) -> str:
    if isinstance(exc, ReplicaWentDown):
        return "the replica went down"
    if isinstance(exc, ClientLeft):
        return "the client went away"
    if isinstance(exc, httpx.TimeoutException):
        return f"it sent nothing for {frontend.read_timeout:g} s (--data-parallel-read-timeout)"
    return f"its connection failed ({type(exc).__name__})"


def _failed(frontend, replica, exc: Exception, path: str) -> Response:
    """The answer to a request whose replica failed before answering (502, 504 for a timeout)."""
    if isinstance(exc, ClientLeft):  # nobody reads this answer
        logger.debug("a client left before data-parallel replica %d answered: request closed", replica.rank)
        return Response(status_code=499)
    frontend.metrics.failed.labels(str(replica.rank)).inc()
    if isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException):
        frontend.went_down(replica.rank, f"request failed ({exc!r})")
    status = 504 if isinstance(exc, httpx.TimeoutException) else 502
    error = _error(status, f"data-parallel replica {replica.rank} failed before answering: {_why(frontend, exc)}",
                   path)
    error.headers[REPLICA_HEADER] = str(replica.rank)  # the one that failed
    return error


def _error(status: int, message: str, path: str) -> Response:
    """The front end's own error, in the shape of the API at `path` (as a replica answers it)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return error_response(ServingError(status, message, kind), path)
