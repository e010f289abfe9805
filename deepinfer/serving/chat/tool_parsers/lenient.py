"""Lenient reading of `tool_choice="auto"` answers, as llama.cpp does for Hermes-style models:
small models often write a call without their format's markers, as

    ```json
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ```

or as the bare object. Such an answer is a call when it is nothing but that (whitespace aside; a
closing fence left out at the very end is forgiven), its `name` is one of the request's tools and
its arguments (`arguments` or `parameters`; none: `{}`) pass the function's schema
(`schema_check.py`). Anything else, prose holding JSON that is not a call, an unknown name,
arguments that do not validate, is read by the format's own parser (tagged calls, content).

`LenientToolParser` wraps the format's parser. Streamed, an answer that may still become such a
call (it starts with a backtick or `{` and nothing rules it out yet) is held back; once something
does, the wrapped parser reads it from the start, so what was held goes out as content. A
lenient call is sent whole at the end of the answer (only then is it sure nothing follows it).
"""

from __future__ import annotations

import json
import re

from deepinfer.serving.chat.tool_parsers.base import CallScan, FunctionSpec, Scan, ToolParser, scan_call_object
from deepinfer.serving.chat.tool_parsers.json_scan import Invalid, skip_ws
from deepinfer.serving.chat.tool_parsers.schema_check import matches_schema

FENCE = "```"
_ARGUMENT_KEYS = ("arguments", "parameters")
_INFO = re.compile(r"[A-Za-z]*")


class _Hold(Exception):
    """The text so far may still become a lenient call."""


class _Not(Exception):
    """The text is not a lenient call, whatever follows."""


class LenientToolParser(ToolParser):
    """`inner`'s format, plus fenced or bare JSON calls of `functions` (see the module docstring)."""

    def __init__(self, inner: ToolParser, functions: tuple[FunctionSpec, ...] | list[FunctionSpec]):
        super().__init__(inner.special_ids, inner.chat_template)
        self.inner = inner
        self.name, self.markers = inner.name, inner.markers
        self.schemas = {f.name: f.parameters for f in functions}

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return False  # never chosen from a template: it wraps the parser that was

    def new_call_id(self) -> str:
        return self.inner.new_call_id()

    def call_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        return self.inner.call_grammar(functions, parallel)

    def scan(self, text: str, final: bool) -> Scan:
        try:
            call = self._call(text, final)
        except _Hold:
            if not final:
                return Scan()
            return self.inner.scan(text, final)  # a finished answer that stopped inside the shape
        except _Not:
            return self.inner.scan(text, final)
        return Scan(calls=[call])

    def _call(self, text: str, final: bool) -> CallScan:
        """The lenient call `text` is (only once `final`); _Hold or _Not otherwise."""
        pos = skip_ws(text, 0)
        fenced = text.startswith("`", pos)
        if fenced:
            pos = _fence_open(text, pos)
        if pos == len(text):
            raise _Hold
        if text[pos] != "{":
            raise _Not
        try:
            call, end = scan_call_object(text, pos, _ARGUMENT_KEYS)
        except Invalid:
            raise _Not from None
        if call.name is not None and call.name not in self.schemas:
            raise _Not
        if end is None:
            raise _Hold
        if not self._valid(call):
            raise _Not
        _ending(text, skip_ws(text, end), fenced, final)
        call.done = True
        return call

    def _valid(self, call: CallScan) -> bool:
        try:
            arguments = json.loads(call.arguments)
        except (ValueError, RecursionError):
            return False
        return isinstance(arguments, dict) and matches_schema(arguments, self.schemas[call.name])


def _fence_open(text: str, pos: int) -> int:
    """Past an opening fence (its info string empty or `json`) and the whitespace after it."""
    rest = text[pos:pos + len(FENCE)]
    if rest != FENCE:
        raise _Hold if FENCE.startswith(rest) and pos + len(rest) == len(text) else _Not
    info = _INFO.match(text, pos + len(FENCE))
    word = info.group().lower()
    if word and word != "json":
        raise _Hold if "json".startswith(word) and info.end() == len(text) else _Not
    return skip_ws(text, info.end())


def _ending(text: str, pos: int, fenced: bool, final: bool) -> None:
    """What follows the object: a closing fence when `fenced` (left out at the end of a finished
    answer), then only whitespace. Returns when the answer may end here and has; raises otherwise."""
    if fenced and pos < len(text):
        rest = text[pos:pos + len(FENCE)]
        if rest != FENCE:
            raise _Hold if FENCE.startswith(rest) and pos + len(rest) == len(text) and not final else _Not
        pos = skip_ws(text, pos + len(FENCE))
    if pos < len(text):
        raise _Not
    if not final:
        raise _Hold
