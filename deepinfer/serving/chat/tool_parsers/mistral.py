"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the list form of
the v3 tokenizer's templates), or `[TOOL_CALLS]name[ARGS]{...}` per call (the templates that
write `[ARGS]`, from v11 on). Text before the first `[TOOL_CALLS]` is content.

Call ids are 9 letters and digits: Mistral's templates refuse others."""

from __future__ import annotations

import json
import random
import re
import string

from deepinfer.serving.chat.tool_parsers.base import CallScan, FunctionSpec, Scan, ToolParser
from deepinfer.serving.chat.tool_parsers.formats import (
    call_object_schema,
    json_rule,
    scan_call_object,
    scan_sections,
    styled,
)
from deepinfer.serving.chat.tool_parsers.json_scan import Incomplete, Invalid, skip_ws, value_end

_ARGUMENT_KEYS = ("arguments", "parameters")
_NAME = re.compile(r"[A-Za-z0-9_.-]*")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (TOOL_CALLS, ARGS)

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def scan(self, text: str, final: bool) -> Scan:
        return scan_sections(text, final, self.TOOL_CALLS,
                             lambda text, pos, final, scan: self._section(text, skip_ws(text, pos), final, scan))

    def _section(self, text: str, pos: int, final: bool, scan: Scan) -> int | None:
        """The calls after one `[TOOL_CALLS]`: the index past them, None while they are being written."""
        if pos == len(text):
            if final:
                raise Invalid
            return None
        if text[pos] == "[":
            return self._list(text, skip_ws(text, pos + 1), final, scan)
        return self._named(text, pos, final, scan)

    def _list(self, text: str, pos: int, final: bool, scan: Scan) -> int | None:
        while pos < len(text):
            if text[pos] != "{":
                raise Invalid
            call, end = scan_call_object(text, pos, _ARGUMENT_KEYS)
            scan.calls.append(call)
            if end is None:
                break
            call.done = True
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == "]":
                return pos + 1
            if pos < len(text) and text[pos] != ",":
                raise Invalid
            pos = skip_ws(text, pos + 1)
        if final and scan.calls and scan.calls[-1].done:  # the list was not closed
            return len(text)
        if final:
            raise Invalid
        return None

    def _named(self, text: str, pos: int, final: bool, scan: Scan) -> int | None:
        """`name[ARGS]{...}`."""
        name_end = _NAME.match(text, pos).end()
        rest = text[name_end:]
        if not rest.startswith(self.ARGS):
            if self.ARGS.startswith(rest) and not final:
                return None
            raise Invalid
        if name_end == pos:
            raise Invalid
        call = CallScan(name=text[pos:name_end])
        scan.calls.append(call)
        start = skip_ws(text, name_end + len(self.ARGS))
        try:
            end = value_end(text, start)
        except Incomplete:
            if final and not text[start:].strip():
                raise Invalid from None
            call.arguments = text[start:]
            return len(text) if final else None
        call.arguments, call.done = text[start:end], True
        return end

    def call_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        marker = self.literal(self.TOOL_CALLS)
        alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
        if self.ARGS in self.chat_template:
            lines = ["%llguidance {}", self.start_rule("call", "", parallel), f"call: {marker} ({alternatives})"]
            lines += [f"fn_{i}: {json.dumps(fn.name)} {self.literal(self.ARGS)} args_{i}"
                      for i, fn in enumerate(functions)]
            lines += [f"args_{i}: {json_rule(styled(fn.parameters))}" for i, fn in enumerate(functions)]
            return "\n".join(lines)
        lines = ["%llguidance {}", self.start_rule(f'{marker} "[" calls "]"', "", False),
                 "calls: " + self.calls_rule("call", '", "', parallel), f"call: {alternatives}"]
        lines += [f"fn_{i}: {json_rule(call_object_schema(fn, 'arguments'))}" for i, fn in enumerate(functions)]
        return "\n".join(lines)
