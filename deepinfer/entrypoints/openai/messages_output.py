"""The Anthropic Messages API's answers: the message object, its stream of events, and errors.

Content blocks, in the order the answer writes them: `thinking` (with a reasoning parser; its
`signature` is ""), `text` (when the answer has content), `tool_use` (one per parsed call: the
parser's id, the name, `input` the arguments as an object). An answer with none of them has one
empty text block. `stop_reason`: "max_tokens" when max_tokens cut the answer, else "tool_use" when
it made calls, "stop_sequence" (and `stop_sequence` set) when one of stop_sequences ended it, else
"end_turn". `usage.input_tokens` counts the prompt tokens not found in the prefix cache,
`cache_read_input_tokens` those found there (their sum is the prompt, as count_tokens gives it).

A stream (`MessageEvents`) sends, as Anthropic does:

    message_start                      the message with empty content and usage so far
    per block: content_block_start     the empty block
               content_block_delta*    text_delta | thinking_delta | input_json_delta
               content_block_stop
    message_delta                      stop_reason, stop_sequence, usage (output_tokens)
    message_stop

Whitespace a stream sees before a text block's first other character waits for it (and is dropped
if none comes), as the whole answer's parsed content does.

Errors: `{"type": "error", "error": {"type", "message"}}`, the type from the status code (`errors.anthropic_error`).
"""

from __future__ import annotations

import json
import uuid

from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.serving.chat.output import ChoiceStream, ParsedMessage


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def stop_reason(c: CompletionOutput, num_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):  # the stop string that matched
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage(out: RequestOutput | None, num_prompt_tokens: int) -> dict:
    """Anthropic's usage: None `out` for a message just started."""
    num_cached = 0 if out is None else out.num_cached_tokens
    num_output = 0 if out is None else sum(len(c.token_ids) for c in out.outputs)
    return {"input_tokens": num_prompt_tokens - num_cached, "output_tokens": num_output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": num_cached}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: str) -> dict:
    """`arguments`: the call's JSON text (whole, or "" while it streams)."""
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments) if arguments else {}}


def content_blocks(parsed: ParsedMessage) -> list[dict]:
    """A whole answer's content blocks."""
    blocks = [] if parsed.reasoning_content is None else [thinking_block(parsed.reasoning_content)]
    if parsed.content:
        blocks.append(text_block(parsed.content))
    blocks += [tool_use_block(call.id, call.function.name, call.function.arguments) for call in parsed.tool_calls]
    return blocks or [text_block("")]


class MessageContext:
    """What every version of one message shares."""

    def __init__(self, message_id: str, model: str, num_prompt_tokens: int):
        self.message_id, self.model, self.num_prompt_tokens = message_id, model, num_prompt_tokens

    def envelope(self, content: list[dict], reason: tuple[str | None, str | None], out: RequestOutput | None
                 ) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason[0], "stop_sequence": reason[1],
                "usage": usage(out, self.num_prompt_tokens)}

    def message(self, parsed: ParsedMessage, out: RequestOutput) -> dict:
        """The whole message of a finished request."""
        return self.envelope(content_blocks(parsed), stop_reason(out.outputs[0], len(parsed.tool_calls)), out)


class MessageEvents:
    """The events of one streamed message, built from its outputs step by step."""

    def __init__(self, ctx: MessageContext, stream: ChoiceStream):
        self.ctx, self.stream = ctx, stream
        self.num_blocks = 0
        self._open: str | None = None  # the type of the open block
        self._space = ""  # whitespace waiting for a text block

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self.ctx.envelope([], (None, None), None)}]

    def step(self, out: RequestOutput) -> list[dict]:
        """The events of one step; the closing ones too once the request finished."""
        c = out.outputs[0]
        parts = self.stream.read(c)
        events = []
        if parts.reasoning_content:
            events += self._ensure("thinking") + self._delta("thinking_delta", "thinking", parts.reasoning_content)
        if parts.content:
            events += self._text(parts.content)
        for delta in parts.tool_calls:
            if "id" in delta:
                events += self._close() + self._start(tool_use_block(delta["id"], delta["function"]["name"], ""))
            if delta["function"].get("arguments"):
                events += self._delta("input_json_delta", "partial_json", delta["function"]["arguments"])
        return events + (self.finish(out) if out.finished else [])

    def finish(self, out: RequestOutput) -> list[dict]:
        """The closing events of a finished request."""
        events = self._close()
        if not self.num_blocks:
            events += self._start(text_block("")) + self._close()
        reason = stop_reason(out.outputs[0], self.stream.num_calls)
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                          "usage": usage(out, self.ctx.num_prompt_tokens)}, {"type": "message_stop"}]

    def _text(self, text: str) -> list[dict]:
        if self._open != "text":
            text = self._space + text
            self._space = ""
            if not text.strip():
                self._space = text
                return []
        return self._ensure("text") + self._delta("text_delta", "text", text)

    def _ensure(self, kind: str) -> list[dict]:
        if self._open == kind:
            return []
        return self._close() + self._start(text_block("") if kind == "text" else thinking_block(""))

    def _start(self, block: dict) -> list[dict]:
        self._open = block["type"]
        self.num_blocks += 1
        return [{"type": "content_block_start", "index": self.num_blocks - 1, "content_block": block}]

    def _delta(self, kind: str, key: str, text: str) -> list[dict]:
        return [{"type": "content_block_delta", "index": self.num_blocks - 1, "delta": {"type": kind, key: text}}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self.num_blocks - 1}]
