"""Errors of the request lifecycle, below HTTP: what went wrong, where in the request, and the status.

A `ServingError` says where the problem is as a field path into the request (`("messages", 2,
"content")`), what the problem is in a text that does not repeat the field, and OpenAI's status,
type and code. It knows no API. Each API's encoder renders it in its own shape and with its own
field names: a `FieldNames` maps a path of the request the lifecycle saw (a chat or completion
request, in OpenAI's names) onto the body the client sent (Anthropic's `stop_sequences`, Ollama's
`options.num_predict`, ...). The message is the rendered path, a colon and the problem:

    ServingError(400, "must be at most 2, got 5", path=("temperature",))
        OpenAI      {"error": {"message": "temperature: must be at most 2, got 5", "param": "temperature", ...}}
        Ollama      {"error": "options.temperature: must be at most 2, got 5"}

`FieldError` is the ValueError that request-checking code raises (tools, the protocol conversions,
`LLM.chat`): a path and a problem; `LLM.chat` lets it out as a ValueError, the server answers it as
a 400. Every 4xx names the field and the value where there is one, never an internal exception's
text. Anything else is a 500 that says only "internal error" and a request id (`req-<hex>`); the
log has the same id with the traceback.
"""

from __future__ import annotations

import logging
import reprlib
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger("deepinfer.server")

INVALID_REQUEST = "invalid_request_error"
Path = tuple[str | int, ...]
FieldNames = Callable[[Path], Path]  # a request path -> the client's body's path


def same_names(path: Path) -> Path:
    return path


def as_path(where: str | Path | None) -> Path:
    """A field path from a top-level name ("tools"), a path tuple, or None (the request as a whole)."""
    if where is None:
        return ()
    return (where,) if isinstance(where, str) else tuple(where)


def format_path(path: Path) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (names escaped and shortened)."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            name = part.encode("utf-8", "backslashreplace").decode("utf-8")
            name = name if len(name) <= 40 else name[:40] + "..."
            text += f".{name}" if text else name
    return text


class FieldError(ValueError):
    """A bad value at `path` of a request; its text is `path: problem`."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = as_path(path), problem
        super().__init__(f"{format_path(self.path)}: {problem}" if self.path else problem)

    @property
    def param(self) -> str | None:
        return top_field(self.path)


def top_field(path: Path) -> str | None:
    return str(path[0]) if path else None


class ServingError(Exception):
    """An error answered to the client: status, problem, field path, OpenAI's type and code, headers."""

    def __init__(self, status_code: int, problem: str, type: str = INVALID_REQUEST,
                 path: str | Path | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 *, names_field: bool = True):
        super().__init__(problem)
        self.status_code, self.problem, self.type = status_code, problem, type
        self.path, self.code, self.headers = as_path(path), code, headers
        self.names_field = names_field  # False: the problem names the field itself (and nothing is prefixed)
        self.names: FieldNames | None = None  # set by an API that knows how the path maps onto its body

    def message(self, names: FieldNames = same_names) -> str:
        path = names(self.path) if self.path and self.names_field else ()
        return f"{format_path(path)}: {self.problem}" if path else self.problem

    def param(self, names: FieldNames = same_names) -> str | None:
        return top_field(names(self.path) if self.path else ())

    def to_dict(self, names: FieldNames = same_names) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message(names), "type": self.type, "param": self.param(names),
                          "code": self.code}}


def bad_request(problem: str, path: str | Path | None = None, code: str | None = None) -> ServingError:
    return ServingError(400, problem, INVALID_REQUEST, path, code)


def from_field_error(exc: FieldError, code: str | None = None) -> ServingError:
    return ServingError(400, exc.problem, INVALID_REQUEST, exc.path, code)


@contextmanager
def named_by(names: FieldNames) -> Iterator[None]:
    """Errors raised inside name their fields by `names` (unless one already has its own); a FieldError
    becomes a 400. An API wraps its own conversions in `named_by(same_names)` (their paths are in its
    names already) and its use of the chat path in its mapping of the chat request's names."""
    try:
        yield
    except FieldError as exc:
        error = from_field_error(exc)
        error.names = names
        raise error from None
    except ServingError as error:
        error.names = error.names or names
        raise


def too_busy(problem: str, retry_after_s: int) -> ServingError:
    """A 429: the server, or this client's share of it, is full."""
    return ServingError(429, problem, "rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(retry_after_s)})


def service_unavailable(problem: str, retry_after_s: int = 5, code: str = "server_unavailable") -> ServingError:
    return ServingError(503, problem, "service_unavailable", code=code, headers={"Retry-After": str(retry_after_s)})


def internal_error(exc: BaseException | None, context: str) -> ServingError:
    """A 500 saying only "internal error" and a fresh request id; logs the id with the traceback."""
    request_id = f"req-{uuid.uuid4().hex}"
    logger.error("internal error %s while %s", request_id, context, exc_info=exc)
    return ServingError(500, f"internal error (request id {request_id})", "server_error", code="internal_error",
                        headers={"X-Request-Id": request_id})


def not_found(problem: str, path: str | Path | None = None, code: str | None = None) -> ServingError:
    return ServingError(404, problem, "not_found_error", path, code)


def context_length_exceeded(num_prompt_tokens: int, max_model_len: int, path: str | Path,
                            max_tokens: int | None = None) -> ServingError:
    """The prompt (plus max_tokens, when given) does not fit into the model's context."""
    if max_tokens is None:
        detail = f"your prompt has {num_prompt_tokens} tokens, which leaves no room for an output token"
    else:
        detail = (f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                  f"the prompt, {max_tokens} in the completion)")
    return bad_request(f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"{detail}. Please reduce the length of the prompt or the completion.",
                       path, code="context_length_exceeded")


def from_value_error(exc: ValueError, fields: frozenset[str] = frozenset()) -> ServingError:
    """An engine or SamplingParams ValueError; its message starts with the field, when one of `fields`."""
    if isinstance(exc, FieldError):
        return from_field_error(exc)
    message = str(exc)
    first = message.split(" ", 1)[0]
    if first in fields:  # "temperature must be ..." -> path temperature, problem "must be ..."
        return bad_request(message.split(" ", 1)[1] if " " in message else message, first)
    return bad_request(message)


MAX_VALIDATION_ERRORS = 8  # a validation error list is read this far, never further


def from_validation_errors(errors: list[dict], total: int | None = None) -> ServingError:
    """pydantic's error list (its first MAX_VALIDATION_ERRORS entries) -> one 400 naming the first bad field
    and its value; `total`: how many errors there were in all."""
    errors = errors[:MAX_VALIDATION_ERRORS]
    total = len(errors) if total is None else total
    if not errors:
        return bad_request("invalid request body")
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    err = unknown[0] if unknown else errors[0]  # an unknown field first: it may explain the rest
    path = tuple(part for part in err.get("loc", ()) if part != "body")
    if unknown:
        return ServingError(400, f"Unrecognized request argument supplied: {_short_name(format_path(path))}",
                            path=path[:1], code="unknown_parameter", names_field=False)
    problem = err.get("msg", "invalid value")
    if "input" in err and err.get("type") != "missing":
        problem += f" (got {short_repr(err['input'])})"
    if total > 1:
        problem += f" (and {total - 1} more error{'s' if total > 2 else ''})"
    return bad_request(problem, _named_path(path))


def _named_path(path: tuple) -> Path:
    """pydantic's location as a field path: union branch names (`list[int]`, `str`) dropped."""
    return tuple(part for part in path if isinstance(part, int) or not _is_type_name(part))


def _is_type_name(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none", "function-after",
                                   "function-before", "function-wrap", "constrained-str", "literal")


def _short_name(name: str | None) -> str | None:
    """A client-chosen field name, bounded for a message."""
    return name if name is None or len(name) <= 80 else name[:80] + "..."


def short_repr(value) -> str:
    """A bounded repr of what the client sent (cheap for a huge value)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxdict, short.maxlist, short.maxtuple = 2, 4, 6, 6
    short.maxstring, short.maxother, short.maxlong = 60, 60, 40
    return short.repr(value)
