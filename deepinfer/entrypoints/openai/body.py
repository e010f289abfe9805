"""Request bodies: a size limit (413) applied while the body streams in, and strict JSON reading.

The limit is a plain ASGI middleware: a declared Content-Length over the limit is refused before
the body is read; a chunked body is counted as it arrives, and the read fails once it passes
the limit.

`parse_json` turns the raw bytes into a dict, and every way a body can be hostile is a 400 that
names the problem (and the field, where the JSON parses), never a 500:

    nesting deeper than MAX_JSON_DEPTH   a scan of the raw bytes, before json.loads recurses
    a number of over MAX_NUMBER_CHARS    json's parse_int / parse_float hooks (Python refuses to
                                         convert ints of over 4300 digits with a ValueError)
    NaN, Infinity, 1e999                 not JSON (Python accepts them) or not finite
    bytes that are not UTF-8             incl. UTF-8-encoded surrogates
    a lone surrogate in any string       "\\ud800" decodes to a str no encoder accepts; the
                                         400 names the field, e.g. messages[0].content

JSON that a client sends inside a string of the body (a tool call's `arguments`) is read under
the same bounds by `deepinfer.json_bounds.parse_nested_json`, where the depth scan lives.

It is CPU work over up to `--max-body-bytes`: the server runs it off the event loop.
"""

from __future__ import annotations

import json
import math
import re

from fastapi import Request

from deepinfer.entrypoints.openai.errors import APIError, bad_request
from deepinfer.json_bounds import MAX_JSON_DEPTH, MAX_NUMBER_CHARS, json_depth

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape in the JSON text


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


async def read_body(request: Request) -> bytes:
    """The raw body; 400 when it is empty."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    return raw


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; a 400 (never a 500) for anything else. See the module docstring."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"the request body nests arrays and objects {depth} deep; the limit is "
                          f"{MAX_JSON_DEPTH}", code="invalid_json")
    bad_numbers: list[_BadNumber] = []
    try:
        text = raw.decode("utf-8")  # strict: UTF-8-encoded surrogates are refused here
        data = json.loads(text, **_number_hooks(bad_numbers))
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} "
                          f"column {exc.colno})", code="invalid_json") from None
    except RecursionError:  # unreachable after the depth scan; kept as the last line of defence
        raise bad_request("the request body nests too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(data)}")
    if bad_numbers:
        first = bad_numbers[0]
        raise _located_error(data, lambda value: value is first, first.problem, "invalid_number")
    if _SURROGATE_ESCAPE.search(text):  # the only way a lone surrogate gets into the data
        _check_text(data)
    return data


class _BadNumber:
    """Stands in for a number literal the parser refused, so that the 400 can name its field."""

    def __init__(self, problem: str):
        self.problem = problem


def _number_hooks(bad: list[_BadNumber]) -> dict:
    """json.loads hooks that replace refused numbers by a _BadNumber (also appended to `bad`)."""

    def refuse(problem: str) -> _BadNumber:
        bad.append(_BadNumber(problem))
        return bad[-1]

    def parse_int(text: str) -> int | _BadNumber:
        return int(text) if len(text) <= MAX_NUMBER_CHARS else refuse(_too_long(text))

    def parse_float(text: str) -> float | _BadNumber:
        if len(text) > MAX_NUMBER_CHARS:
            return refuse(_too_long(text))
        value = float(text)
        return value if math.isfinite(value) else refuse(f"the number {text} is out of range")

    def parse_constant(name: str) -> _BadNumber:
        return refuse(f"{name} is not a JSON number")

    return dict(parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant)


def _too_long(text: str) -> str:
    return f"a number of {len(text)} characters is too long; the limit is {MAX_NUMBER_CHARS}"


def _json_type(value) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _check_text(data: dict) -> None:
    """400 naming the field when a string (or key) anywhere in `data` holds a lone surrogate."""
    def has_surrogate(value) -> bool:
        return isinstance(value, str) and _SURROGATE.search(value) is not None

    if _locate(data, has_surrogate) is not None:
        raise _located_error(data, has_surrogate, "a lone UTF-16 surrogate is not valid unicode text",
                             "invalid_unicode")


def _located_error(data: dict, match, problem: str, code: str) -> APIError:
    """A 400 naming where in `data` the first value (or key) that `match`es sits."""
    location = _locate(data, match) or []
    field = location[0] if location and not match(location[0]) else None  # None: a bad field name
    return bad_request(f"{_format_location(location)}: {problem}", param=field, code=code)


def _locate(value, match) -> list | None:
    """Keys and indexes (outermost first) down to the first value or key that `match`es."""
    if match(value):
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if match(key):
            return [key]
        if (found := _locate(item, match)) is not None:
            return [key, *found]
    return None


def _format_location(location: list) -> str:
    """['messages', 0, 'content'] -> 'messages[0].content' (names escaped and shortened)."""
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            name = part.encode("utf-8", "backslashreplace").decode("utf-8")
            name = name if len(name) <= 40 else name[:40] + "..."
            text += f".{name}" if text else name
    return text or "the request body"
