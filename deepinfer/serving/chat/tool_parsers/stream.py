"""One answer's text streamed through a tool-call parser: content deltas and OpenAI's tool-call
deltas (`{"index", "id", "type", "function": {"name", "arguments"}}`, one per call).

Each step scans the whole text so far (`ToolParser.scan`) and sends what is new: content the scan
shows (trailing whitespace held until more text follows, so the blank line between calls is not
sent), and each call once it is complete: its name and its arguments whole, in one delta, only
when the arguments parse as a JSON object. So a stream cut anywhere never leaves a client holding
arguments that do not parse, and each call's arguments are the text `parse` returns for it.

When the text turns out not to be a call section: with no call sent yet, the rest of the text
goes out as content (what `parse` answers then too); after a call was sent, nothing more is sent.
An answer cut by max_tokens (`cut`) sends its complete calls and drops a call left unfinished at
the end, as `parse(text, cut=True)` does.
"""

from __future__ import annotations

from deepinfer.serving.chat.tool_parsers.base import CallScan, Scan, ToolParser, complete_calls


class ToolCallStream:
    """`feed(delta)` per step, `feed("", final=True)` once at the end (`cut`: max_tokens ended the
    answer): (content delta, tool-call deltas)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self._content_sent = 0  # characters of the scan's content sent
        self._num_sent = 0  # calls sent
        self._passthrough: int | None = None  # text from here on is content (the scan failed)
        self._stopped = False

    @property
    def num_calls(self) -> int:
        return self._num_sent

    def feed(self, delta: str, final: bool = False, cut: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if self._stopped:
            return "", []
        if self._passthrough is not None:
            return self._pass()
        scan = self.parser.scan(self.text, final)
        if scan.failed_at is None:
            return self._parts(scan, final)
        if final and cut and complete_calls(scan.calls):  # the complete calls of a cut answer
            self._stopped = True
            return self._parts(scan, final)
        if self.num_calls:
            self._stopped = True
            return "", []
        self._passthrough = self._content_sent
        return self._pass()

    def _parts(self, scan: Scan, final: bool) -> tuple[str, list[dict]]:
        deltas = self._call_deltas(scan.calls)  # first: an answer with calls sends its content without end blanks
        return self._content(scan.content, final), deltas

    def _pass(self) -> tuple[str, list[dict]]:
        text = self.text[self._passthrough:]
        self._passthrough += len(text)
        return text, []

    def _content(self, content: str, final: bool) -> str:
        shown = content.rstrip() if not final or self.num_calls else content
        new = shown[self._content_sent:]
        self._content_sent = max(self._content_sent, len(shown))
        return new

    def _call_deltas(self, calls: list[CallScan]) -> list[dict]:
        """The complete calls not sent yet, in order (a later call waits for an earlier one)."""
        deltas = []
        for index, call in enumerate(complete_calls(calls[self._num_sent:]), start=self._num_sent):
            deltas.append({"index": index, "id": self.parser.new_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
        self._num_sent += len(deltas)
        return deltas
