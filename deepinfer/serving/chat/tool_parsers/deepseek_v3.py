"""DeepSeek V3 / R1 tool calls, as their chat templates write them:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": ...}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME2 ...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the section (and after its end) is content. In a finished answer, closing markers
left out at the very end (after a complete arguments object) are forgiven."""

from __future__ import annotations

import json

from deepinfer.serving.chat.tool_parsers.base import CallScan, FunctionSpec, Scan, ToolParser
from deepinfer.serving.chat.tool_parsers.formats import json_rule, scan_sections, styled
from deepinfer.serving.chat.tool_parsers.json_scan import Incomplete, Invalid, skip_ws, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
JSON_OPEN, JSON_CLOSE = "\n```json\n", "\n```"


class _Open(Exception):
    """The text ends inside the section (more may come)."""


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def scan(self, text: str, final: bool) -> Scan:
        return scan_sections(text, final, CALLS_BEGIN, self._open_section)

    def _open_section(self, text: str, pos: int, final: bool, scan: Scan) -> int | None:
        try:
            return self._section(text, pos, final, scan)
        except _Open:  # still being written
            return None

    def _section(self, text: str, pos: int, final: bool, scan: Scan) -> int:
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(CALLS_END, pos):
                return pos + len(CALLS_END)
            if final and pos == len(text) and scan.calls and scan.calls[-1].done:
                return pos
            pos = _expect(text, pos, CALL_BEGIN, CALLS_END)
            pos = self._call(text, pos, final, scan)

    def _call(self, text: str, pos: int, final: bool, scan: Scan) -> int:
        sep = text.find(SEP, pos)
        if sep < 0:
            if ("function" + SEP).startswith(text[pos:]) and not final:
                raise _Open
            raise Invalid
        if text[pos:sep] != "function":
            raise Invalid
        newline = text.find("\n", sep + len(SEP))
        if newline < 0:
            if final:
                raise Invalid
            raise _Open
        call = CallScan(name=text[sep + len(SEP):newline])
        if not call.name:
            raise Invalid
        scan.calls.append(call)
        pos = _expect(text, newline, JSON_OPEN)
        try:
            end = value_end(text, pos)
        except Incomplete:
            call.arguments = text[pos:]
            raise (Invalid if final else _Open) from None
        call.arguments = text[pos:end]
        try:
            pos = _expect(text, end, JSON_CLOSE)
            pos = _expect(text, skip_ws(text, pos), CALL_END)
        except _Open:
            if final:  # the answer ended where the closing markers belong
                call.done = True
                return len(text)
            raise
        call.done = True
        return pos

    def call_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        lit = self.literal
        # blanks may come before the closing marker: a newline after a call need not start another
        section = f"{lit(CALLS_BEGIN)} calls END_BLANKS? {lit(CALLS_END)}"
        lines = ["%llguidance {}", self.start_rule(section, "", False),
                 "calls: " + self.calls_rule("call", '"\\n"', parallel),
                 f"call: {' | '.join(f'fn_{i}' for i in range(len(functions)))}"]
        for i, fn in enumerate(functions):
            lines.append(f'fn_{i}: {lit(CALL_BEGIN)} "function" {lit(SEP)} {json.dumps(fn.name)} '
                         f'{json.dumps(JSON_OPEN)} args_{i} {json.dumps(JSON_CLOSE)} {lit(CALL_END)}')
            lines.append(f"args_{i}: {json_rule(styled(fn.parameters))}")
        return "\n".join(lines)


def _expect(text: str, pos: int, literal: str, *alternatives: str) -> int:
    """The index past `literal` at `pos`; _Open when the text ends inside it or inside one of
    `alternatives` (what that means for a finished answer is the caller's to say); else Invalid."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    rest = text[pos:]
    if any(option.startswith(rest) for option in (literal, *alternatives)):
        raise _Open
    raise Invalid
