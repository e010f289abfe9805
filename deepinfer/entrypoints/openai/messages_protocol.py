"""The Anthropic Messages API's request bodies, and their mapping onto a chat completion request.

    POST /v1/messages               MessagesRequest
    POST /v1/messages/count_tokens  CountTokensRequest (the same, less the sampling fields)

`model`, `messages` and (for /v1/messages) `max_tokens` are required, as in Anthropic's API.
`system` is a string or a list of text blocks. A message's `role` is "user" or "assistant"; its
`content` a string or a list of blocks:

    user       text, image {source: {type: base64, media_type, data} | {type: url, url}},
               tool_result {tool_use_id, content: string | text blocks, is_error?}
    assistant  text, tool_use {id, name, input: object}; thinking / redacted_thinking are skipped
               (the model's own notes are not sent back to it, as with /v1/responses' reasoning items)

Text blocks of one message are joined with "\\n" (with images, they stay parts, in order; a url
source needs the server's --allow-remote-media). A user message's tool_result blocks become
`tool` messages (in order) before its text. A conversation must end with a user message (an
assistant prefill is refused). `tools` are custom tools `{name, description?, input_schema}`;
`tool_choice` `{type: auto | any | tool | none, name?, disable_parallel_tool_use?}` maps to the chat
forms "auto", "required", a named function and "none". `thinking` `{type: enabled | adaptive |
disabled}` reaches the chat template as `enable_thinking` (budget_tokens is accepted and ignored;
the --reasoning-parser reads the section). `output_config.format` (`{type: json_schema, schema}`)
constrains the answer as the chat route's response_format does. `temperature`, `top_p` and `top_k`
are read (the newest client no longer declares them: send them in `extra_body`), and `seed` (not
Anthropic's: the chat route's, for a repeatable sample). `metadata`,
`service_tier`, `cache_control` (the prefix cache is automatic) and `output_config.effort` are
accepted and ignored; any other field is a 400 naming it. `cache_control` and `citations` on blocks are ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from deepinfer.sampling_params import INT64_MAX, short_repr
from deepinfer.serving.errors import FieldError, Path
from deepinfer.serving.parse import STRICT, Entries, Items
from deepinfer.serving.pictures import take_picture_paths
from deepinfer.serving.protocol import PICTURE_PATHS, SEED_MAX, SEED_MIN

_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
_TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "cache_control"})
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}
# chat field -> the Messages field it comes from (for the param and message of a 400)
CHAT_TO_MESSAGES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice",
                    "chat_template_kwargs": "thinking", "response_format": "output_config"}


def messages_names(path: Path) -> Path:
    """A chat request's field path in the Messages API's names (`tools[0].function.parameters` is
    `tools[0].input_schema`, `stop` is `stop_sequences`, ...)."""
    if len(path) >= 3 and path[0] == "tools" and path[2] == "function":
        rest = path[3:]
        if rest[:1] == ("parameters",):
            return ("tools", path[1], "input_schema", *rest[1:])
        return ("tools", path[1], *rest)
    return (CHAT_TO_MESSAGES.get(path[0], path[0]), *path[1:]) if path else path


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what the prompt is made of."""

    model_config = STRICT
    model: str
    messages: Items[Entries[str, Any]] = Field(min_length=1)
    system: str | Items[Entries[str, Any]] | None = None
    tools: Items[Entries[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Entries[str, Any] | None = None
    output_config: Entries[str, Any] | None = None
    cache_control: Entries[str, Any] | None = None  # accepted and ignored: the prefix cache is automatic

    def chat_body(self) -> dict:
        """The chat completion request (a dict for ChatCompletionRequest); FieldError naming the field."""
        messages = chat_messages(self.system, self.messages)
        body = {"model": self.model, "messages": messages, PICTURE_PATHS: take_picture_paths(messages),
                "tools": chat_tools(self.tools), "chat_template_kwargs": thinking_kwargs(self.thinking),
                "response_format": chat_response_format(self.output_config),
                **chat_tool_choice(self.tool_choice, bool(self.tools))}
        return {key: value for key, value in body.items() if value is not None}


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop_sequences: Items[str] | None = None
    stream: bool | None = False
    # accepted and ignored
    metadata: Entries[str, Any] | None = None
    service_tier: str | None = None

    def chat_body(self) -> dict:
        body = super().chat_body()
        sampling = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "seed": self.seed, "stop": self.stop_sequences}
        return body | {key: value for key, value in sampling.items() if value is not None}


def chat_messages(system, messages: list[dict]) -> list[dict]:
    """`system` and `messages` as chat messages; FieldError naming `messages[i]...` for a bad one."""
    converted = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise FieldError(("messages", i), f"has unknown field {short_repr(unknown[0])}")
        role = message.get("role")
        if role == "user":
            converted += _user_messages(i, message.get("content"))
        elif role == "assistant":
            converted.append(_assistant_message(i, message.get("content")))
        else:
            raise FieldError(("messages", i, "role"), f"must be 'user' or 'assistant', got {short_repr(role)}")
    if converted[-1]["role"] == "assistant":
        raise FieldError(("messages", len(messages) - 1), "the conversation must end with a user message (a final "
                         "assistant message, to be continued, is not supported)")
    return converted


def _blocks(i: int, content, allowed: tuple[str, ...]) -> list[dict]:
    """A message's content as a list of blocks of the `allowed` types."""
    where = ("messages", i, "content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise FieldError(where, f"must be a string or a non-empty list of content blocks, got {short_repr(content)}")
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise FieldError((*where, j, "type"), f"must be one of {', '.join(allowed)}, got "
                             f"{short_repr(kind if isinstance(block, dict) else block)}")
    return content


def _user_messages(i: int, content) -> list[dict]:
    """One user message: its tool results (as `tool` messages), then its text (if any)."""
    blocks = _blocks(i, content, _USER_BLOCKS)
    results = [{"role": "tool", "tool_call_id": _string(block, "tool_use_id", ("messages", i, "content", j)),
                "content": _text(block.get("content", ""), ("messages", i, "content", j, "content"))}
               for j, block in enumerate(blocks) if block["type"] == "tool_result"]
    texts = [b for b in blocks if b["type"] == "text"]
    if any(b["type"] == "image" for b in blocks):
        return results + [{"role": "user", "content": _parts(i, blocks)}]
    return results + ([{"role": "user", "content": _text(texts, ("messages", i, "content"))}] if texts else [])


def _parts(i: int, blocks: list[dict]) -> list[dict]:
    """A user message's text and image blocks as chat parts, in order (images as image_url parts
    whose path, `messages[i].content[j]`, `picture_paths` lists)."""
    parts = []
    for j, block in enumerate(blocks):
        if block["type"] == "text":
            parts.append({"type": "text", "text": _text([block], ("messages", i, "content"))})
        elif block["type"] == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, ("messages", i, "content", j))},
                          "path": ["messages", i, "content", j]})
    return parts


def _image_url(block: dict, where: Path) -> str:
    """An image block's source as a URL: base64 data as a data URL, a url source as itself."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise FieldError((*where, "source", "media_type"), f"must be an image type (image/png, image/jpeg, "
                             f"image/gif, image/webp), got {short_repr(media_type)}")
        if not isinstance(data, str) or not data:
            raise FieldError((*where, "source", "data"), f"must be base64 text, got {short_repr(data)}")
        return f"data:{media_type};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise FieldError((*where, "source"), "must be {\"type\": \"base64\", \"media_type\", \"data\"} or "
                     "{\"type\": \"url\", \"url\"}")


def _assistant_message(i: int, content) -> dict:
    blocks = _blocks(i, content, _ASSISTANT_BLOCKS)
    texts = [b for b in blocks if b["type"] == "text"]
    calls = [_call(block, ("messages", i, "content", j)) for j, block in enumerate(blocks)
             if block["type"] == "tool_use"]
    message = {"role": "assistant", "content": _text(texts, ("messages", i, "content")) if texts else None}
    return message | ({"tool_calls": calls} if calls else {})


def _call(block: dict, where: Path) -> dict:
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise FieldError((*where, "input"), f"must be an object, got {short_repr(arguments)}")
    return {"id": _string(block, "id", where), "type": "function",
            "function": {"name": _string(block, "name", where), "arguments": json.dumps(arguments)}}


def _text(content, where: Path | str) -> str:
    """A string, or text blocks joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(where, f"must be a string or a list of text blocks, got {short_repr(content)}")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else block
            at = (where, j) if isinstance(where, str) else (*where, j)
            raise FieldError(at, f"must be a text block ({{\"type\": \"text\", \"text\": ...}}), got type "
                             f"{short_repr(kind)}")
    return "\n".join(block["text"] for block in content)


def _string(block: dict, key: str, where: Path) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise FieldError((*where, key), f"must be a non-empty string, got {short_repr(value)}")
    return value


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Custom tools as chat function tools (the chat path then checks names and schemas)."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise FieldError(("tools", i, "type"), f"only custom tools ({{name, description, input_schema}}) are "
                             f"supported, got {short_repr(kind)}")
        unknown = sorted(set(tool) - _TOOL_FIELDS)
        if unknown:
            raise FieldError(("tools", i), f"has unknown field {short_repr(unknown[0])}")
        if "input_schema" not in tool:
            raise FieldError(("tools", i, "input_schema"), "is required (a JSON schema of an object)")
        function = {"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool["input_schema"]}
        converted.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return converted


def chat_tool_choice(choice: ToolChoice | None, has_tools: bool) -> dict:
    """`tool_choice` (and `parallel_tool_calls`) of the chat request."""
    if choice is None:
        return {}
    if choice.type in ("any", "tool") and not has_tools:
        raise FieldError(("tool_choice", "type"), f"{choice.type!r} needs tools; the request has none")
    if (choice.type == "tool") != (choice.name is not None):
        raise FieldError(("tool_choice", "name"), f"goes with type 'tool' (and only with it); got type "
                         f"{choice.type!r} and name {short_repr(choice.name)}")
    value = {"type": "function", "function": {"name": choice.name}} if choice.type == "tool" else \
        _TOOL_CHOICES[choice.type]
    return {"tool_choice": value, "parallel_tool_calls": False if choice.disable_parallel_tool_use else None}


def chat_response_format(output_config: dict | None) -> dict | None:
    """`output_config.format` (`{type: json_schema, schema}`) as the chat response_format (None: free
    text); `output_config.effort` is accepted and ignored."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise FieldError(("output_config", "format"), f"must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}, "
                         f"got {short_repr(fmt)}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def thinking_kwargs(thinking: dict | None) -> dict | None:
    """`thinking` as the chat template's `enable_thinking`."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if not isinstance(kind, str) or kind not in _THINKING:
        raise FieldError(("thinking", "type"), f"must be one of {', '.join(_THINKING)}, got {short_repr(kind)}")
    return {"enable_thinking": _THINKING[kind]}
