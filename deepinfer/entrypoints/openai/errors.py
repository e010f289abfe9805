"""Errors over HTTP: every `ServingError` rendered in the shape and field names of the API it hit.

    /v1/messages...   Anthropic's  {"type": "error", "error": {"type", "message"}}
    /api/...          Ollama's     {"error": "message"}
    anything else     OpenAI's     {"error": {"message", "type", "param", "code"}}

`error_response(error, path)` is the one place that picks the shape (by the path) and the field
names (the error's own `names`, set by an API that mapped a request onto the chat path, else the
API's default); the exception handlers, the auth check and the middlewares (body size, client
shares) all answer through it. FastAPI's default 422 body never leaves the server, and malformed
JSON is a 400, never a 500 (`deepinfer.serving.parse`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deepinfer.entrypoints.openai.error_log import ClientErrorLog
from deepinfer.entrypoints.openai.messages_protocol import messages_names
from deepinfer.entrypoints.openai.ollama_protocol import ollama_names
from deepinfer.entrypoints.openai.responses_protocol import responses_names
from deepinfer.serving.errors import (
    INVALID_REQUEST,
    FieldNames,
    ServingError,
    bad_request,
    from_validation_errors,
    internal_error,
    same_names,
)

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error"}


def anthropic_error(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, INVALID_REQUEST if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def ollama_error(message: str) -> dict:
    return {"error": message}


def _in(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def _anthropic_shape(error: ServingError, names: FieldNames) -> dict:
    return anthropic_error(error.status_code, error.message(names))


def _ollama_shape(error: ServingError, names: FieldNames) -> dict:
    return ollama_error(error.message(names))


def _openai_shape(error: ServingError, names: FieldNames) -> dict:
    return error.to_dict(names)


def error_style(path: str) -> tuple[Callable[[ServingError, FieldNames], dict], FieldNames]:
    """(body of an error, default field names) of the API that serves `path`."""
    if _in(path, "/v1/messages"):
        return _anthropic_shape, messages_names
    if _in(path, "/api"):
        return _ollama_shape, ollama_names
    return _openai_shape, (responses_names(0) if _in(path, "/v1/responses") else same_names)


def error_body(error: ServingError, path: str) -> dict:
    """The error's body in the shape and names of the API at `path` (also for an event of a stream)."""
    shape, names = error_style(path)
    return shape(error, error.names or names)


class ErrorResponse(JSONResponse):
    """A JSON response rendered as ASCII, so that no text a client sent can fail its encoding."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(error: ServingError, path: str) -> ErrorResponse:
    return ErrorResponse(error_body(error, path), status_code=error.status_code, headers=error.headers)


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Answer every error in its API's shape; `on_error(request, status)` sees each one (metrics).
    Every 4xx answer, these and the middlewares' added before, is logged in one line (error_log.py)."""
    app.add_middleware(ClientErrorLog)

    def respond(request: Request, error: ServingError) -> JSONResponse:
        if on_error is not None:
            on_error(request, error.status_code)
        return error_response(error, request.url.path)

    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, exc: ServingError):
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        return respond(request, from_validation_errors(list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        return respond(request, from_validation_errors(exc.errors(include_url=False), exc.error_count()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        fallback = INVALID_REQUEST if exc.status_code < 500 else "server_error"
        kind = _STATUS_TYPES.get(exc.status_code, fallback)
        return respond(request, ServingError(exc.status_code, str(exc.detail), kind, headers=exc.headers))

    @app.exception_handler(ClientDisconnect)
    async def _disconnect(request: Request, exc: ClientDisconnect):  # nobody reads this answer
        return respond(request, bad_request("the client went away before sending the whole body"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return respond(request, internal_error(exc, f"serving {request.method} {request.url.path}"))
