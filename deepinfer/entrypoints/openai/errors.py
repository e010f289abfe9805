"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause maps to a 4xx here; FastAPI's default 422 body never leaves
the server, and malformed JSON is a 400, never a 500. A 4xx message names the field and the
problem, never an internal exception's text. Anything else is a 500 that says only "internal
error" and a request id (`req-<hex>`); the log has the same id with the traceback.
"""

from __future__ import annotations

import json
import logging
import reprlib
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deepinfer.entrypoints.openai.error_log import ClientErrorLog

logger = logging.getLogger("deepinfer.server")

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error answered to the client as OpenAI's error JSON."""

    def __init__(self, status_code: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code, self.message, self.type = status_code, message, type
        self.param, self.code, self.headers = param, code, headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)


class ErrorResponse(JSONResponse):
    """A JSON response rendered as ASCII, so that no text a client sent can fail its encoding."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def service_unavailable(message: str, retry_after_s: int = 5, code: str = "server_unavailable") -> APIError:
    return APIError(503, message, "service_unavailable", code=code, headers={"Retry-After": str(retry_after_s)})


def internal_error(exc: BaseException | None, context: str) -> APIError:
    """A 500 saying only "internal error" and a fresh request id; logs the id with the traceback."""
    request_id = f"req-{uuid.uuid4().hex}"
    logger.error("internal error %s while %s", request_id, context, exc_info=exc)
    return APIError(500, f"internal error (request id {request_id})", "server_error", code="internal_error",
                    headers={"X-Request-Id": request_id})


def context_length_exceeded(num_prompt_tokens: int, max_model_len: int, param: str,
                            max_tokens: int | None = None) -> APIError:
    """The prompt (plus max_tokens, when given) does not fit into the model's context."""
    if max_tokens is None:
        detail = (f"your prompt has {num_prompt_tokens} tokens, which leaves no room for an "
                  f"output token")
    else:
        detail = (f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                  f"the prompt, {max_tokens} in the completion)")
    return bad_request(f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"{detail}. Please reduce the length of the prompt or the completion.",
                       param=param, code="context_length_exceeded")


def from_value_error(exc: ValueError, fields: frozenset[str] = frozenset()) -> APIError:
    """An engine or SamplingParams ValueError; its message starts with the field, when one of `fields`."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return bad_request(message, param=first if first in fields else None)


def from_validation_errors(errors: list[dict]) -> APIError:
    """pydantic's error list -> one 400 naming the first bad field and its value."""
    if not errors:
        return bad_request("invalid request body")
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    err = unknown[0] if unknown else errors[0]  # an unknown field first: it may explain the rest
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None  # the request field; the message gives the full location
    if unknown:
        return bad_request(f"Unrecognized request argument supplied: {_short_name('.'.join(loc))}",
                           param=_short_name(param), code="unknown_parameter")
    message = err.get("msg", "invalid value")
    if "input" in err and err.get("type") != "missing":
        message += f" (got {_short_repr(err['input'])})"
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param=param)


def _short_name(name: str | None) -> str | None:
    """A client-chosen field name, bounded for a message."""
    return name if name is None or len(name) <= 80 else name[:80] + "..."


def _short_repr(value) -> str:
    """A bounded repr of what the client sent (cheap for a huge value)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxdict, short.maxlist, short.maxtuple = 2, 4, 6, 6
    short.maxstring, short.maxother, short.maxlong = 60, 60, 40
    return short.repr(value)


_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error"}


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Answer every error as OpenAI's JSON; `on_error(request, status)` sees each one (metrics).
    Every 4xx answer, these and the middlewares' added before, is logged in one line (error_log.py)."""
    app.add_middleware(ClientErrorLog)

    def respond(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(request, error.status_code)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        return respond(request, from_validation_errors(list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        return respond(request, from_validation_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        fallback = INVALID_REQUEST if exc.status_code < 500 else "server_error"
        kind = _STATUS_TYPES.get(exc.status_code, fallback)
        return respond(request, APIError(exc.status_code, str(exc.detail), kind,
                                         headers=exc.headers))

    @app.exception_handler(ClientDisconnect)
    async def _disconnect(request: Request, exc: ClientDisconnect):  # nobody reads this answer
        return respond(request, bad_request("the client went away before sending the whole body"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return respond(request, internal_error(exc, f"serving {request.method} {request.url.path}"))


class ReshapedErrors:
    """ASGI middleware: an error answer (status >= 400) on the routes under `prefix`, in OpenAI's
    shape `{"error": {"message", ...}}` or any other, is sent as `shape(status, message)` instead
    (Anthropic's and Ollama's APIs), so the errors of the auth check and of the other middlewares
    take the API's shape too."""

    def __init__(self, app, prefix: str, shape: Callable[[int, str], dict]):
        self.app, self.prefix, self.shape = app, prefix, shape

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == self.prefix or path.startswith(self.prefix + "/")):
            return await self.app(scope, receive, send)
        held: dict = {}

        async def reshaping_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.update(start=message, body=b"")
                return
            if "start" not in held or message["type"] != "http.response.body":
                return await send(message)
            held["body"] += message.get("body", b"")
            if not message.get("more_body", False):
                await self._send_reshaped(send, held["start"], held["body"])

        await self.app(scope, receive, reshaping_send)

    async def _send_reshaped(self, send, start: dict, body: bytes) -> None:
        status = start["status"]
        new_body = json.dumps(self.shape(status, error_message(body, status)), ensure_ascii=True).encode("ascii")
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
        await send({**start, "headers": headers + [(b"content-length", str(len(new_body)).encode()),
                                                   (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": new_body})


def error_message(body: bytes, status: int) -> str:
    """The message of an error answer's body: OpenAI's `error.message` (or a bare `error` string),
    else the body's text, cut to 1,000 characters."""
    try:
        found = json.loads(body)
    except ValueError:
        found = None
    error = found.get("error") if isinstance(found, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    if isinstance(message, str):
        return message
    return body.decode("utf-8", "replace")[:1000] or f"HTTP {status}"
