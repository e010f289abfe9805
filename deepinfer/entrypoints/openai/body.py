"""Request bodies: a size limit (413) applied while the body streams in, and strict JSON reading.

The limit is a plain ASGI middleware: a declared Content-Length over the limit is refused before
the body is read; a chunked body is counted as it arrives, and the read fails once it passes
the limit.
"""

from __future__ import annotations

import json

from fastapi import Request

from deepinfer.entrypoints.openai.errors import APIError, bad_request


def body_too_large(max_bytes: int, size: int | None = None) -> APIError:
    detail = f" ({size} bytes)" if size is not None else ""
    return APIError(413, f"the request body is too large{detail}; the limit is {max_bytes} bytes",
                    param=None, code="request_too_large")


class BodySizeLimit:
    """ASGI middleware refusing HTTP bodies larger than `max_bytes` with a 413."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            response = body_too_large(self.max_bytes, declared).response()
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


async def read_json(request: Request) -> dict:
    """The body as a JSON object; 400 (never 500) for anything else."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    return data
