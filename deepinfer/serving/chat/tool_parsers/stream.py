"""One answer's text streamed through a tool-call parser: content deltas and OpenAI's tool-call
deltas (`{"index", "id", "type", "function": {"name", "arguments"}}` first, then
`{"index", "function": {"arguments"}}` pieces).

Each step scans the whole text so far (`ToolParser.scan`) and sends what is new: content the scan
shows (trailing whitespace held until more text follows, so the blank line between calls is not
sent), a call's header once its name is written whole, its arguments' new characters. The
streamed arguments of a call add up to the text `parse` returns for it.

When the text turns out not to be a call section: with no call sent yet, the rest of the text
goes out as content (what `parse` answers then too); after a call was sent, nothing more is sent.
"""

from __future__ import annotations

from deepinfer.serving.chat.tool_parsers.base import ToolParser


class ToolCallStream:
    """`feed(delta)` per step, `feed("", final=True)` once at the end: (content delta, tool-call deltas)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self._content_sent = 0  # characters of the scan's content sent
        self._arguments_sent: list[int] = []  # per call sent: characters of its arguments sent
        self._passthrough: int | None = None  # text from here on is content (the scan failed)
        self._stopped = False

    @property
    def num_calls(self) -> int:
        return len(self._arguments_sent)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if self._stopped:
            return "", []
        if self._passthrough is not None:
            return self._pass(final)
        scan = self.parser.scan(self.text, final)
        if scan.failed_at is not None:
            if self.num_calls:
                self._stopped = True
                return "", []
            self._passthrough = self._content_sent
            return self._pass(final)
        return self._content(scan.content, final), self._call_deltas(scan.calls)

    def _pass(self, final: bool) -> tuple[str, list[dict]]:
        text = self.text[self._passthrough:]
        self._passthrough += len(text)
        return text, []

    def _content(self, content: str, final: bool) -> str:
        if final:
            shown = content.rstrip() if self.num_calls else content
        else:
            shown = content.rstrip()
        new = shown[self._content_sent:]
        self._content_sent = max(self._content_sent, len(shown))
        return new

    def _call_deltas(self, calls) -> list[dict]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # a later call waits for this one's name
            if index == len(self._arguments_sent):
                deltas.append({"index": index, "id": self.parser.new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self._arguments_sent.append(len(call.arguments))
                continue
            new = call.arguments[self._arguments_sent[index]:]
            if new:
                deltas.append({"index": index, "function": {"arguments": new}})
                self._arguments_sent[index] = len(call.arguments)
        return deltas
