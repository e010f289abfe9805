"""Bounds on the JSON a client sends: the request body (entrypoints/openai/body.py) and JSON text
a client puts inside a string of it (a tool call's `arguments`, a JSON schema sent as text).

Python's json.loads recurses once per array or object level and raises RecursionError (not a
ValueError) at about a thousand levels, so the depth is measured first, by a linear scan of the
text that never recurses (`json_depth`); only JSON within MAX_JSON_DEPTH is parsed. Its size is
bounded by the body it came in (`--max-body-bytes`).

`parse_nested_json(text, field)` reads nested JSON under the body's rules, every refusal a
ValueError whose message starts with `field` (e.g. `messages[1].tool_calls[0].function.arguments`):

    nesting deeper than MAX_JSON_DEPTH     found by the scan, before json.loads runs
    text that is not JSON                  json's message, line and column
    a number of over MAX_NUMBER_CHARS      (Python refuses ints of over 4300 digits anyway)
    NaN, Infinity, 1e999                   not JSON (Python accepts them), or not finite
    a lone UTF-16 surrogate ("\\ud800")     a str that no encoder (or tokenizer) accepts

Pure Python and numpy: the server, `LLM.chat` and the structured-output specs use it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 64  # arrays and objects inside one another
MAX_NUMBER_CHARS = 100  # characters of one number literal (sign, digits, fraction, exponent)

# A JSON string literal, or an unterminated one up to the end: one linear pass, no backtracking.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")  # a lone surrogate, or its escape


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in `raw` (brackets inside strings do not count)."""
    structure = _JSON_STRING.sub(b"", raw).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    if not structure:
        return 0
    return int(np.frombuffer(structure, dtype=np.int8).cumsum(dtype=np.int32).max())


def check_json_depth(text: str, field: str) -> None:
    """ValueError naming `field` when the JSON `text` nests deeper than MAX_JSON_DEPTH."""
    depth = json_depth(text.encode("utf-8", "surrogatepass"))
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{field} nests arrays and objects {depth} deep; the limit is {MAX_JSON_DEPTH}")


def parse_nested_json(text: str, field: str) -> Any:
    """`text` (JSON a client sent inside a string) parsed under the body's bounds; ValueError
    naming `field` for anything refused (see the module docstring)."""
    check_json_depth(text, field)
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") \
            from None
    except ValueError as exc:  # a number the hooks refused
        raise ValueError(f"{field}: {exc}") from None
    except RecursionError:  # unreachable after the depth scan; kept as the last line of defence
        raise ValueError(f"{field} nests too deeply; the limit is {MAX_JSON_DEPTH}") from None
    if _SURROGATE.search(text) and not _encodable(value):
        raise ValueError(f"{field} holds a lone UTF-16 surrogate, which is not valid unicode text")
    return value


def _parse_int(text: str) -> int:
    _check_length(text)
    return int(text)


def _parse_float(text: str) -> float:
    _check_length(text)
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_length(text: str) -> None:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters is too long; the limit is {MAX_NUMBER_CHARS}")


def _encodable(value: Any) -> bool:
    """Whether every string (and key) in `value` is valid unicode (holds no lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
