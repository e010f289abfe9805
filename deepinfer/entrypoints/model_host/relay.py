"""A request passed to the child serving its model, and the child's answer passed back as it streams.

The child gets the client's body unchanged and only the headers the data-parallel front end passes
(`data_parallel.proxy.REQUEST_HEADERS`), plus who the client is beside the host's per-run secret
(the child believes `x-deepinfer-client` only beside it). The client gets the child's status, body
and `ANSWER_HEADERS`, plus `x-deepinfer-model`. A child that goes away mid-answer ends a stream with
its API's error event (`stream_errors.StreamTail`); one that goes away before answering is a 502. A
client that leaves closes the request to the child, whose disconnect watcher aborts it there.
`done()` runs once the answer is over, however it ends (the runner's in-flight count).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deepinfer.entrypoints.data_parallel.identity import CLIENT_HEADER, SECRET_HEADER
from deepinfer.entrypoints.data_parallel.proxy import (
    ANSWER_HEADERS,
    REQUEST_HEADERS,
    ClientLeft,
    ReplicaWentDown,
    send_unless_gone,
)
from deepinfer.entrypoints.data_parallel.stream_errors import StreamTail
from deepinfer.entrypoints.openai.errors import error_response
from deepinfer.serving.errors import ServingError

logger = logging.getLogger("deepinfer.server")
MODEL_HEADER = "x-deepinfer-model"


async def relay(client: httpx.AsyncClient, request: Request, url: str, raw: bytes, who: str, secret: str,
                model: str, gone: asyncio.Event, done: Callable[[], Awaitable[None]]) -> Response:
    """`request` (its body `raw`) sent to the child at `url`; its answer, streamed back."""
    target = httpx.URL(url).copy_with(path=request.url.path, query=request.url.query.encode())
    headers = [(k, v) for k, v in request.headers.items() if k.lower() in REQUEST_HEADERS]
    upstream = client.build_request(request.method, target, content=raw, headers=[
        *headers, ("accept-encoding", "identity"), (CLIENT_HEADER, who), (SECRET_HEADER, secret)])
    try:
        answer = await send_unless_gone(client, request, upstream, gone)
    except BaseException as exc:
        await done()
        if isinstance(exc, httpx.HTTPError | ReplicaWentDown):
            return failed(502, f"model {model!r} failed before answering: {_why(exc)}", request.url.path)
        if isinstance(exc, ClientLeft):
            return Response(status_code=499)
        raise
    kept = {k: v for k, v in answer.headers.items() if k.lower() in ANSWER_HEADERS}
    tail = StreamTail(request.url.path, answer.headers.get("content-type", ""))
    return StreamingResponse(_stream(answer, tail, model, gone, done), status_code=answer.status_code,
                             headers={**kept, MODEL_HEADER: model})


def failed(status: int, message: str, path: str) -> Response:
    """The host's own error, in the shape of the API at `path`."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return error_response(ServingError(status, message, kind), path)


def _why(exc: Exception) -> str:
    if isinstance(exc, ReplicaWentDown):
        return "it was unloaded or its process exited"
    if isinstance(exc, httpx.TimeoutException):
        return "it sent nothing in time"
    return f"its connection failed ({type(exc).__name__})"


async def _stream(answer: httpx.Response, tail: StreamTail, model: str, gone: asyncio.Event, done):
    try:
        async for chunk in answer.aiter_raw():
            tail.seen(chunk)
            yield chunk
    except httpx.HTTPError as exc:
        event = tail.error_event(f"model {model!r} failed during this answer: {_why(exc)}")
        if event is None:
            raise
        yield event
    finally:
        await answer.aclose()
        await done()
