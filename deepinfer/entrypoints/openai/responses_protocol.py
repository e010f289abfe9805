"""The Responses API's request body, and its mapping onto a chat completion request.

The subset `client.responses.create` and agent frameworks use: `input` (a string, or a list of
message items and of `function_call` / `function_call_output` items; `reasoning` items are
skipped), `instructions` (a system message; not carried over from a previous response, as in
OpenAI's API), function `tools` and `tool_choice`, `text.format` (text, json_object,
json_schema), `max_output_tokens`, `temperature`, `top_p`, `previous_response_id`, `store`,
`stream`, and `seed` (not OpenAI's: the chat route's, for a repeatable sample; send it in
`extra_body`). Fields that change nothing here are accepted and ignored (`include`, `reasoning`,
`truncation`, `user`, `metadata` (returned as given), `service_tier`, ...); fields whose meaning
the server does not implement (`background`, `conversation`, `prompt`, `max_tool_calls`) are a
400 naming them. Items are read loosely (an item's unknown fields are ignored: clients send back
the output items they got, with ids and statuses).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from deepinfer.json_bounds import check_json_depth
from deepinfer.sampling_params import short_repr
from deepinfer.serving.errors import FieldError, FieldNames, Path
from deepinfer.serving.parse import STRICT, Entries, Items
from deepinfer.serving.pictures import take_picture_paths
from deepinfer.serving.protocol import PICTURE_PATHS, SEED_MAX, SEED_MIN

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# chat field -> the Responses field it comes from (for the param of a 400)
CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def responses_names(num_before: int) -> FieldNames:
    """A chat request's field paths in the Responses API's names, for a request whose input items
    start at message `num_before` of the chat (after the instructions and the history): messages[k]
    is input[k - num_before] (an earlier message is the history's: `previous_response_id`)."""

    def names(path: Path) -> Path:
        if not path:
            return path
        if path[0] == "messages":
            index = path[1] if len(path) > 1 and isinstance(path[1], int) else None
            if index is None:
                return ("input",)
            if index < num_before:
                return ("previous_response_id",)
            return ("input", index - num_before, *path[2:])
        return (CHAT_TO_RESPONSES.get(path[0], path[0]), *path[1:])

    return names


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = STRICT
    input: str | Items[Entries[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = False
    tools: Items[Any] | None = None
    tool_choice: str | Entries[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    text: Entries[str, Any] | None = None
    # accepted and ignored
    metadata: Entries[str, str] | None = None
    reasoning: Entries[str, Any] | None = None
    include: Items[str] | None = None
    truncation: str | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: Entries[str, Any] | None = None
    # refused when set
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        for name, value in (("conversation", self.conversation), ("prompt", self.prompt),
                            ("max_tool_calls", self.max_tool_calls), ("top_logprobs", self.top_logprobs)):
            if value is not None:
                raise FieldError(name, "is not supported")
        if self.background:
            raise FieldError("background", "background responses are not supported")

    def chat_body(self, history: list[dict]) -> dict:
        """The chat completion request this response is: `history` (a previous response's
        conversation) between the instructions and this input."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            list(history) + input_messages(self.input)
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
                PICTURE_PATHS: take_picture_paths(messages, ("previous_response_id",)),
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "tools": chat_tools(self.tools),
                "tool_choice": chat_tool_choice(self.tool_choice), "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": chat_response_format(self.text)}
        return {key: value for key, value in body.items() if value is not None}

    def conversation_messages(self, history: list[dict]) -> list[dict]:
        """What a later response continues from: the history and this input (no instructions)."""
        messages = list(history) + input_messages(self.input)
        take_picture_paths(messages)  # a picture's path is this request's, not a later one's
        return messages


def input_messages(value: str | list[dict]) -> list[dict]:
    """`input` as chat messages; FieldError naming `input[i]` for an item that cannot be one."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            _add_call(messages, i, item)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(i, item, "call_id"),
                             "content": _text(i, item.get("output"), "output")})
        elif kind != "reasoning":  # reasoning items are the model's own notes: not sent back to it
            raise FieldError(("input", i, "type"), f"items of type {short_repr(kind)} are not supported")
    if not messages:
        raise FieldError("input", "holds no message")
    return messages


def _message(i: int, item: dict) -> dict:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise FieldError(("input", i, "role"), f"must be one of {', '.join(_ROLES)}, got {short_repr(role)}")
    content = item.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return {"role": _ROLES[role], "content": _parts(i, content)}
    return {"role": _ROLES[role], "content": _text(i, content, "content")}


def _parts(i: int, content: list) -> list[dict]:
    """A message's text and input_image parts, in order (`image_url`: a data URL or a URL; `file_id`
    is refused: this server keeps no files)."""
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise FieldError(("input", i, "content", j, "image_url"), "must be a data URL or a URL "
                                 f"(file_id is not supported: this server keeps no files), got {short_repr(url)}")
            parts.append({"type": "image_url", "image_url": {"url": url}, "path": ("input", i, "content", j)})
        else:
            parts.append({"type": "text", "text": _text(i, [part], "content")})
    return parts


def _text(i: int, content, field: str) -> str:
    """A string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(("input", i, field), f"must be a string or a list of text parts, got {short_repr(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise FieldError(("input", i, field, j), f"only text parts are supported, got type {short_repr(kind)}")
        texts.append(part["text"])
    return "".join(texts)


def _string(i: int, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise FieldError(("input", i, key), f"must be a non-empty string, got {short_repr(value)}")
    return value


def _add_call(messages: list[dict], i: int, item: dict) -> None:
    """A function_call item joins the assistant message before it (or starts one). Its arguments
    (JSON text) are parsed later, with the chat's; their depth is checked here, naming the item."""
    call_id, name = _string(i, item, "call_id"), _string(i, item, "name")
    arguments = _text(i, item.get("arguments", "{}"), "arguments")
    try:
        check_json_depth(arguments, "")
    except ValueError as exc:
        raise FieldError(("input", i, "arguments"), str(exc).lstrip(": ")) from None
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def chat_tools(tools: list | None) -> list | None:
    """Responses function tools (`{"type": "function", "name", ...}`) in the chat shape."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise FieldError(("tools", i, "type"), f"only function tools are supported, got {short_repr(kind)}")
        converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return converted


def chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise FieldError("tool_choice", f"{short_repr(choice)} is not supported; send 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"name\": ...}")
    return choice


def chat_response_format(text: dict | None) -> dict | None:
    """`text.format` as the chat request's response_format (None: free text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError(("text", "format"), f"must be of type text, json_object or json_schema, got {short_repr(fmt)}")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return {"type": fmt["type"]}
