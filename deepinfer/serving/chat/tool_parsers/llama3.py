"""Llama 3.x JSON tool calls: the answer is `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several calls separated by `;`. An answer that does not start with `{` (after
whitespace and the tag) is content; one that starts with `{` but is not such a call (another
first key, text after the last call) is content too, once that is clear.

A forced call may begin with the tag when the tag is one token of the tokenizer (by id)."""

from __future__ import annotations

from deepinfer.serving.chat.tool_parsers.base import (
    FunctionSpec,
    Scan,
    ToolParser,
    call_object_schema,
    json_rule,
    scan_call_object,
)
from deepinfer.serving.chat.tool_parsers.json_scan import Invalid, skip_ws

_ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return cls.TAG in chat_template or ("<|start_header_id|>" in chat_template
                                            and '"parameters"' in chat_template)

    def scan(self, text: str, final: bool) -> Scan:
        pos = skip_ws(text, 0)
        if text.startswith(self.TAG, pos):
            pos = skip_ws(text, pos + len(self.TAG))
        elif pos < len(text) and self.TAG.startswith(text[pos:]) and not final:
            return Scan()  # may still become the tag
        if pos == len(text):
            return Scan(content=text if final else "")
        if text[pos] != "{":
            return Scan(content=text)
        scan = Scan()
        try:
            self._calls(text, pos, final, scan)
        except Invalid:
            scan.failed_at = 0
        return scan

    def _calls(self, text: str, pos: int, final: bool, scan: Scan) -> None:
        while True:
            call, end = scan_call_object(text, pos, _ARGUMENT_KEYS)
            scan.calls.append(call)
            if end is None:
                if final:
                    raise Invalid
                return
            call.done = True
            pos = skip_ws(text, end)
            if pos == len(text):
                return
            if text[pos] != ";":
                raise Invalid
            pos = skip_ws(text, pos + 1)
            if pos == len(text):
                return
            if text[pos] != "{":
                raise Invalid

    def call_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        lines = ["%llguidance {}", self.start_rule("call", '"; "', parallel),
                 f"call: {' | '.join(f'fn_{i}' for i in range(len(functions)))}"]
        if self.TAG in self.special_ids:  # a model may open its call with the tag token, as it was trained
            lines[1] = lines[1].replace("start: ", f"start: {self.literal(self.TAG)}? ", 1)
        lines += [f"fn_{i}: {json_rule(call_object_schema(fn, 'parameters'))}" for i, fn in enumerate(functions)]
        return "\n".join(lines)
