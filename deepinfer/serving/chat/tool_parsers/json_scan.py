"""Scanning JSON text that is still being written: where a value ends, and the members of an
object seen so far. The tool-call parsers use it to stream a call's arguments as they arrive.

A scan never decides that text is valid JSON (json.loads does that once a value is complete); it
finds boundaries. Strings are skipped whole (escapes included), brackets are matched with a
stack (no recursion, so no depth limit), and anything between them is left for json.loads:

    value_end('{"a": [1, "]"]} tail', 0)  -> 15
    value_end('{"a": [1, "]', 0)          -> raises Incomplete (the text ends inside the value)
    value_end('{"a": ]', 0)               -> raises Invalid
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(r"-?[0-9][0-9eE.+-]*|true|false|null")
_BRACKETS_OR_QUOTE = re.compile(r'["\[\]{}]')
_WS = re.compile(r"[ \t\r\n]*")
_CLOSING = {"}": "{", "]": "["}


class Incomplete(Exception):
    """The text ends before the value does."""


class Invalid(Exception):
    """The text cannot be the JSON value asked for."""


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def value_end(text: str, pos: int) -> int:
    """The index just past the JSON value starting at `pos` (no leading whitespace)."""
    if pos >= len(text):
        raise Incomplete
    first = text[pos]
    if first == '"':
        return string_end(text, pos)
    if first in "{[":
        return _container_end(text, pos)
    match = _SCALAR.match(text, pos)
    if match is None:
        if text[pos:] == "-" or any(word.startswith(text[pos:]) for word in ("true", "false", "null")):
            raise Incomplete
        raise Invalid
    if match.end() == len(text):  # a number may go on
        raise Incomplete
    return match.end()


def string_end(text: str, pos: int) -> int:
    match = _STRING.match(text, pos)
    if match is None:
        raise Incomplete  # an opening quote without its closing one
    return match.end()


def _container_end(text: str, pos: int) -> int:
    stack: list[str] = []
    while True:
        match = _BRACKETS_OR_QUOTE.search(text, pos)
        if match is None:
            raise Incomplete
        char, pos = match.group(), match.start()
        if char == '"':
            pos = string_end(text, pos)
            continue
        if char in "{[":
            stack.append(char)
        elif not stack or stack.pop() != _CLOSING[char]:
            raise Invalid
        pos += 1
        if not stack:
            return pos


@dataclass
class ObjectScan:
    """The members of a JSON object seen so far.

    `members`: complete members, key -> (start, end) of the value's text. `open_key` / `open_start`:
    the member whose value is still being written (its value starts at `open_start`). `end`: the
    index just past the closing brace, once seen."""

    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)  # in the order written, the open one last
    open_key: str | None = None
    open_start: int | None = None
    end: int | None = None


def scan_object(text: str, pos: int) -> ObjectScan:
    """Scan the object starting at `pos` ('{'); Invalid when it cannot be one."""
    scan = ObjectScan()
    pos = skip_ws(text, pos + 1)
    while pos < len(text):
        if text[pos] == "}" and not scan.members:
            scan.end = pos + 1
            return scan
        if text[pos] != '"':
            raise Invalid
        try:
            key_end = string_end(text, pos)
        except Incomplete:
            return scan
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos == len(text):
            return scan
        if text[pos] != ":":
            raise Invalid
        scan.keys.append(key)
        start = skip_ws(text, pos + 1)
        try:
            end = value_end(text, start)
        except Incomplete:
            scan.open_key, scan.open_start = key, start
            return scan
        scan.members[key] = (start, end)
        pos = skip_ws(text, end)
        if pos == len(text):
            return scan
        if text[pos] == "}":
            scan.end = pos + 1
            return scan
        if text[pos] != ",":
            raise Invalid
        pos = skip_ws(text, pos + 1)
    return scan
