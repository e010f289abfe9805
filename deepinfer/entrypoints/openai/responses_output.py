"""The Responses API's output: the response object, its output items, and the events of a streamed
one.

Output items, in the order the answer writes them: `reasoning` (with a reasoning parser),
`message` (its text as one `output_text` part), `function_call` (one per complete call, `call_id`
the parser's id; `completed`, in an `incomplete` response too: a call max_output_tokens cut is
dropped). A whole answer has a message item when it has content, or nothing else.

A stream (`ResponseEvents`) sends `response.created` and `response.in_progress`, then per item
`response.output_item.added`, its deltas (`response.reasoning_text.delta`, `response.content_part.added`
+ `response.output_text.delta`, `response.function_call_arguments.delta`), its `.done` events and
`response.output_item.done`; last `response.completed` (or `response.incomplete` when
max_output_tokens cut the answer) with the whole response. Every event has a `sequence_number`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.entrypoints.openai.responses_protocol import ResponsesRequest
from deepinfer.outputs import RequestOutput
from deepinfer.serving.chat.output import ChoiceStream, MessageDelta, ParsedMessage


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseContext:
    """What every version of one response object shares."""

    response_id: str
    model: str
    body: ResponsesRequest
    temperature: float
    top_p: float
    created_at: int = 0

    def __post_init__(self):
        self.created_at = self.created_at or int(time.time())

    def envelope(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        body = self.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": body.reasoning,
            "store": body.store is not False, "temperature": self.temperature, "top_p": self.top_p,
            "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "truncation": body.truncation or "disabled", "user": body.user}


def status_of(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def usage(out: RequestOutput, num_reasoning_tokens: int) -> dict:
    """`reasoning_tokens`: the reasoning text tokenized again (a close count, not the sampled one)."""
    num_output = sum(len(c.token_ids) for c in out.outputs)
    num_prompt = len(out.prompt_token_ids)
    return {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": num_prompt + num_output}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_items(parsed: ParsedMessage, status: str) -> list[dict]:
    """A whole answer's output items."""
    items = []
    if parsed.reasoning_content is not None:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning_content, status))
    if parsed.content or not items and not parsed.tool_calls:
        items.append(message_item(new_id("msg"), parsed.content or "", status))
    items += [call_item(new_id("fc"), call.id, call.function.name, call.function.arguments, "completed")
              for call in parsed.tool_calls]  # only complete calls are parsed, in a cut answer too
    return items


def input_items(value: str | list[dict]) -> list[dict]:
    """A request's input as Responses items (what GET /v1/responses/{id}/input_items lists): a string
    is one user message; every item gets an id."""
    if isinstance(value, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    return [item if isinstance(item.get("id"), str) else {**item, "id": new_id("item")} for item in value]


def assistant_message(items: list[dict]) -> dict:
    """The output as the chat message a later response continues from."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def reasoning_text(items: list[dict]) -> str:
    return "".join(part["text"] for item in items if item["type"] == "reasoning" for part in item["content"])


class ResponseEvents:
    """The events of one streamed response, built from its outputs step by step. `count_tokens(text)`
    counts the reasoning tokens of the usage; `on_finish(response)` gets the whole finished response."""

    def __init__(self, ctx: ResponseContext, stream: ChoiceStream, count_tokens: Callable[[str], int],
                 on_finish: Callable[[dict], None]):
        self.ctx, self.stream = ctx, stream
        self.count_tokens, self.on_finish = count_tokens, on_finish
        self.output: list[dict] = []  # items so far; the last one may be open
        self._open = False
        self._sequence = 0

    def start(self) -> list[dict]:
        response = self.ctx.envelope("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def step(self, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        parts: MessageDelta = self.stream.read(c)
        events = []
        if parts.reasoning_content:
            events += self._ensure("reasoning") + self._text_delta("response.reasoning_text.delta",
                                                                     parts.reasoning_content)
        if parts.content:
            events += self._ensure("message") + self._text_delta("response.output_text.delta", parts.content)
        for delta in parts.tool_calls:
            if "id" in delta:
                events += self._close() + self._add(call_item(new_id("fc"), delta["id"], delta["function"]["name"],
                                                             "", "in_progress"))
            events += self._arguments_delta(delta["function"]["arguments"])
        return events + (self._finish(out) if out.finished else [])

    def _finish(self, out: RequestOutput) -> list[dict]:
        """The closing events; the whole response goes to `on_finish`."""
        status = status_of(out)
        events = self._close(status)
        if not self.output:
            events += self._add(message_item(new_id("msg"), "", "in_progress")) + self._close(status)
        response = self.ctx.envelope(status, self.output, usage(out, self.count_tokens(reasoning_text(self.output))))
        self.on_finish(response)
        return events + [self.event(f"response.{status}", response=response)]

    def event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _ensure(self, kind: str) -> list[dict]:
        if self._open and self.output[-1]["type"] == kind:
            return []
        item = reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning" else \
            message_item(new_id("msg"), "", "in_progress")
        return self._close() + self._add(item)

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open = True
        events = [self.event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", **self._where(), part=_text_part("")))
        return events

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _text_delta(self, kind: str, text: str) -> list[dict]:
        self.output[-1]["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return [self.event(kind, **self._where(), delta=text, **extra)]

    def _arguments_delta(self, text: str) -> list[dict]:
        if not text:
            return []
        item = self.output[-1]
        item["arguments"] += text
        return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=len(self.output) - 1, delta=text)]

    def _close(self, status: str = "completed") -> list[dict]:
        if not self._open:
            return []
        self._open = False
        item, where = self.output[-1], self._where()
        item["status"] = "completed" if item["type"] == "function_call" else status  # a call is sent complete
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=where["output_index"], name=item["name"], arguments=item["arguments"])]
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            events = [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                      self.event("response.content_part.done", **where, part=_text_part(text))]
        else:
            events = [self.event("response.reasoning_text.done", **where, text=item["content"][0]["text"])]
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                     item=_copy(item))]


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item["content"]]} if "content" in item else dict(item)
