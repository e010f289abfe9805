"""One log line per 4xx answer, with its reason, on logger "deepinfer.server" at INFO:

    POST /v1/chat/completions -> 400 (code context_length_exceeded, param messages): This model's max...

An ASGI middleware (`ClientErrorLog`) sees every answer the app sends, whoever made it (a route, an
exception handler, the body-size or admission middlewares, a 404 for an unknown path), and reads
the reason from the OpenAI-shaped error body: `message` (cut to MAX_MESSAGE_CHARS, control
characters escaped, so a client's text cannot forge log lines), `code` and `param`. Nothing else of
the request or the answer is logged; answers pass through unchanged and undelayed.
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger("deepinfer.server")

MAX_MESSAGE_CHARS = 200
_MAX_ERROR_BODY = 16 << 10  # an error body is small; past this the reason is not read


class ClientErrorLog:
    """ASGI middleware: logs each 4xx answer's method, path, status, code, param and message."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen: dict = {}

        async def observing_send(message) -> None:
            await send(message)
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                seen.update(status=message["status"], body=b"")
            elif message["type"] == "http.response.body" and "status" in seen:
                if len(seen["body"]) < _MAX_ERROR_BODY:
                    seen["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    log_client_error(scope.get("method", "?"), scope.get("path", "?"), seen.pop("status"),
                                     seen.pop("body"))

        await self.app(scope, receive, observing_send)


def log_client_error(method: str, path: str, status: int, body: bytes) -> None:
    """The one line of a 4xx answer (see the module docstring)."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", client_error_line(method, path, status, body))


def client_error_line(method: str, path: str, status: int, body: bytes) -> str:
    """`METHOD PATH -> STATUS (code C, param P): message` from an error body (OpenAI's shape
    `{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}`, or anything else)."""
    error = _error_fields(body)
    details = [f"{name} {one_line(str(error[name]), 80)}" for name in ("code", "param") if error.get(name)]
    reason = f" ({', '.join(details)})" if details else ""
    message = error.get("message")
    text = one_line(message, MAX_MESSAGE_CHARS) if isinstance(message, str) else "(no error message)"
    return f"{one_line(method, 16)} {one_line(path, 200)} -> {status}{reason}: {text}"


def _error_fields(body: bytes) -> dict:
    try:
        found = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    error = found.get("error") if isinstance(found, dict) else None
    if isinstance(error, str):  # e.g. {"error": "..."}
        return {"message": error}
    return error if isinstance(error, dict) else {}


def one_line(text: str, limit: int) -> str:
    """`text` cut to `limit` characters ("..." marks a cut), non-printable characters escaped."""
    cut = text[:limit]
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return escaped + ("..." if len(text) > limit else "")
