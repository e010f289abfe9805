"""Parsing a request body, bounded: the first step of every request's life, run in the tokenizer pool.

    raw bytes ──(size: the HTTP layer's limit)──> depth scan ──> json.loads ──> validated model
                                                   │                │              │
                      nesting > MAX_JSON_DEPTH: 400│   bad numbers, │   pydantic, every list and
                      before json.loads recurses   │   not UTF-8,   │   dict fail-fast: at most a
                                                   │   surrogates   │   few errors, read here

Every way a body can be hostile is a 400 that names the problem (and the field, where the JSON
parses), never a 500, and costs work linear in its bytes:

    nesting deeper than MAX_JSON_DEPTH   a scan of the raw bytes, before json.loads recurses
    a number of over MAX_NUMBER_CHARS    json's parse_int / parse_float hooks
    NaN, Infinity, 1e999                 not JSON (Python accepts them) or not finite
    bytes that are not UTF-8             incl. UTF-8-encoded surrogates
    a lone surrogate in any string       "\\ud800"; the 400 names the field, e.g. messages[0].content
    1.5 million wrong-typed list items   every list and dict of a request model is `FAIL_FAST`
                                         (pydantic stops at a container's first bad item), so a
                                         validation error list holds a few entries, not millions

`validate` converts pydantic's errors here, on the pool thread, never on the event loop.
`tests/entrypoints/test_request_models.py` checks that every list and dict field of every request
model is fail-fast.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.json_bounds import MAX_JSON_DEPTH, MAX_NUMBER_CHARS, json_depth
from deepinfer.serving.errors import ServingError, bad_request, format_path, from_validation_errors

# A list or dict field stops validating at its first bad item: `Items[str]`, `Entries[str, float]`.
FAIL_FAST = Field(fail_fast=True)
_T, _K, _V = TypeVar("_T"), TypeVar("_K"), TypeVar("_V")
Items = Annotated[list[_T], FAIL_FAST]
Entries = Annotated[dict[_K, _V], FAIL_FAST]
# What every request model uses: unknown fields refused, types strict, numbers finite.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

_SURROGATE = re.compile("[\ud800-\udfff]")
# as json_bounds.json_depth scans: a string literal (or an unterminated one); brackets as +1 / -1
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_DEPTH_STEPS = bytes(1 if b in b"[{" else 255 if b in b"]}" else 0 for b in range(256))  # int8 +1 / -1 / 0
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape in the JSON text


def parse_body(raw: bytes, model: type[BaseModel]):
    """The body as a validated `model` instance; a 400 for anything else (the module docstring)."""
    return validate(model, parse_json(raw))


def validate(model: type[BaseModel], data):
    """`data` validated into `model`; pydantic's errors as one 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_url=False), exc.error_count()) from None


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; a 400 (never a 500) for anything else."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        field = deep_field(raw)
        what = "nests" if field else "the request body nests"
        raise bad_request(f"{what} arrays and objects {depth} deep; the limit is {MAX_JSON_DEPTH}", field,
                          code="invalid_json")
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


def deep_field(raw: bytes) -> str | None:
    """The top-level field whose value nests past MAX_JSON_DEPTH (None: the body itself, or no key
    found). Linear in the body, without parsing it: the strings are masked in place, the depth of every
    byte is a cumulative sum, and the field is the last top-level key before the first byte too deep."""
    spans = [m.span() for m in _JSON_STRING.finditer(raw)]
    masked = bytearray(raw)
    for start, end in spans:
        masked[start:end] = b"s" * (end - start)
    steps = np.frombuffer(bytes(masked).translate(_DEPTH_STEPS), dtype=np.int8)  # one per byte of the body
    depth = np.cumsum(steps, dtype=np.int32)  # depth after each byte
    too_deep = int(np.argmax(depth > MAX_JSON_DEPTH + 1))
    for start, end in reversed(spans):
        if start < too_deep and depth[start] == 1 and raw[end:end + 64].lstrip()[:1] == b":":
            try:
                key = json.loads(raw[start:end])
            except ValueError:
                return None
            return key if isinstance(key, str) else None
    return None


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


def _located_error(data: dict, match, problem: str, code: str) -> ServingError:
    """A 400 naming where in `data` the first value (or key) that `match`es sits."""
    location = _locate(data, match) or []
    if location and match(location[-1]):  # a bad field name: say where it sits, name no field
        return bad_request(f"{format_path(tuple(location[:-1])) or 'the request body'}: a field name holds "
                           f"{problem}", code=code)
    return bad_request(problem, tuple(location) or None, code=code)


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
