"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
block per call, anywhere in the answer (the text around them is content).

A last block whose closing tag never came (the answer ended right after the JSON) still counts
in a finished answer."""

from __future__ import annotations

from deepinfer.serving.chat.tool_parsers.base import (
    CallScan,
    FunctionSpec,
    Scan,
    ToolParser,
    call_object_schema,
    json_rule,
    scan_call_object,
    scan_sections,
)
from deepinfer.serving.chat.tool_parsers.json_scan import Invalid, skip_ws

_ARGUMENT_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return cls.START in chat_template and "<function=" not in chat_template  # the XML flavour differs

    def scan(self, text: str, final: bool) -> Scan:
        return scan_sections(text, final, self.START, self._block)

    def _block(self, text: str, pos: int, final: bool, scan: Scan) -> int | None:
        """One block after its opening tag: the index past its closing tag, None while open."""
        pos = skip_ws(text, pos)
        if pos == len(text):
            if final:
                raise Invalid
            return None
        if text[pos] != "{":
            raise Invalid
        call, end = scan_call_object(text, pos, _ARGUMENT_KEYS)
        scan.calls.append(call)
        if end is None:
            if final:
                raise Invalid
            return None
        return self._closing(text, skip_ws(text, end), final, call)

    def _closing(self, text: str, pos: int, final: bool, call: CallScan) -> int | None:
        rest = text[pos:]
        if rest.startswith(self.END):
            call.done = True
            return pos + len(self.END)
        if not self.END.startswith(rest.rstrip()):
            raise Invalid
        if final:  # the answer ended before (or inside) the closing tag
            call.done = True
            return len(text)
        return None

    def call_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        lines = ["%llguidance {}", self.start_rule("call", '"\\n"', parallel),
                 f'call: {self.literal(self.START)} "\\n" ({" | ".join(f"fn_{i}" for i in range(len(functions)))}) '
                 f'"\\n" {self.literal(self.END)}']
        lines += [f"fn_{i}: {json_rule(call_object_schema(fn, 'arguments'))}" for i, fn in enumerate(functions)]
        return "\n".join(lines)
