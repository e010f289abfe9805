"""Request bodies over HTTP: a size limit (413) applied while the body streams in.

The limit is a plain ASGI middleware: a declared Content-Length over the limit is refused before
the body is read; a chunked body is counted as it arrives, and the read fails once it passes
the limit. What is read is parsed (bounded, in the tokenizer pool) by `deepinfer.serving.parse`.
"""

from __future__ import annotations

from fastapi import Request

from deepinfer.entrypoints.openai.errors import error_response
from deepinfer.serving.errors import ServingError, bad_request


def body_too_large(max_bytes: int, size: int | None = None) -> ServingError:
    detail = f" ({size} bytes)" if size is not None else ""
    return ServingError(413, f"the request body is too large{detail}; the limit is {max_bytes} bytes",
                        code="request_too_large")


class BodySizeLimit:
    """ASGI middleware refusing HTTP bodies larger than `max_bytes` with a 413."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            response = error_response(body_too_large(self.max_bytes, declared), scope["path"])
            response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        return await self.app(scope, self._counting(receive), send)

    def _counting(self, receive):
        received = 0

        async def wrapped():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return message

        return wrapped


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def in_pool(state, request: Request, prepare, *args):
    """A request's first steps: the capacity checked (503 / 429), its body read (400 when empty), and
    `prepare(tokenizer, state, raw, *args)` (parse and prepare) run in the tokenizer pool."""
    state.check_capacity()
    return await state.pool.run(prepare, state, await read_body(request), *args)


async def read_body(request: Request) -> bytes:
    """The raw body; 400 when it is empty."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    return raw
