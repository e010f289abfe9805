"""Ollama's request bodies, and their mapping onto the chat and completion requests of the OpenAI path.

    POST /api/chat       ChatBody      -> a chat completion request
    POST /api/generate   GenerateBody  -> a chat request of [system, user: prompt] (the model's chat
                                          template), or with `raw` (or a `suffix`) a completion request
    POST /api/embed      EmbedBody     -> an embeddings request (`input` a string or a list of them)
    POST /api/embeddings LegacyEmbedBody {prompt} -> the same, one input

`stream` defaults to true, as in Ollama. `format` is "json" (any JSON object) or a JSON schema
(structured output), "" for free text. `options` are Ollama's: temperature, top_p, top_k, min_p,
seed, num_predict (-1 or -2: up to the context), stop, repeat_penalty, presence_penalty,
frequency_penalty map onto the sampling fields; the load-time ones (num_ctx, num_gpu, num_thread,
...) are accepted and ignored, as are the samplers' neutral values (typical_p 1, tfs_z 1,
mirostat 0); any other option is a 400 naming it. `think` (true or a level) asks the chat template
for its reasoning section (`enable_thinking`), read by the server's --reasoning-parser (a 400 without
one); `keep_alive` is accepted and ignored. A chat message is `{role: system | user | assistant |
tool, content, tool_calls?: [{function: {name, arguments: object}}], tool_name?, thinking?}`; a tool
message answers the earliest unanswered call (of its `tool_name`, when given). Images, `template`,
`context` and `logprobs` are refused with a 400 naming them. Errors name Ollama's fields
(`OLLAMA_NAMES` renames the chat path's).
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict, deque
from typing import Any

from pydantic import BaseModel, Field

from deepinfer.contracts.pooling import PoolingParams
from deepinfer.sampling_params import short_repr
from deepinfer.serving.embeddings import MAX_INPUTS
from deepinfer.serving.errors import FieldError, Path
from deepinfer.serving.parse import STRICT, Entries, Items
from deepinfer.serving.protocol import PICTURE_PATHS

# Ollama option -> chat request field
_SAMPLING_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
                     "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
_LOAD_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                           "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "numa",
                           "num_keep"})
_NEUTRAL_OPTIONS = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
_MESSAGE_FIELDS = frozenset({"role", "content", "images", "thinking", "tool_calls", "tool_name", "tool_call_id"})
_ROLES = ("system", "user", "assistant", "tool")
# the chat path's field -> Ollama's (for the 400s)
OLLAMA_NAMES = {"truncate_prompt_tokens": ("truncate",), "max_tokens": ("options", "num_predict"),
                "response_format": ("format",), "structured_outputs": ("format",), "chat_template_kwargs": ("think",),
                **{field: ("options", option) for option, field in _SAMPLING_OPTIONS.items()}}


def ollama_names(path: Path) -> Path:
    """A chat, completion or embeddings request's field path in Ollama's names (`max_tokens` is
    `options.num_predict`, `response_format...` is `format`, ...)."""
    if not path or path[0] not in OLLAMA_NAMES:
        return path
    renamed = OLLAMA_NAMES[path[0]]
    return renamed if renamed == ("format",) else (*renamed, *path[1:])


class _Body(BaseModel):
    model_config = STRICT
    model: str = Field(min_length=1)
    format: str | Entries[str, Any] | None = None
    options: Entries[str, Any] | None = None
    stream: bool | None = True
    keep_alive: float | str | None = None  # accepted and ignored: the model stays loaded
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def sampling_fields(self, thinking: bool) -> dict:
        """The chat request's sampling, structured output and template fields; FieldError naming the field."""
        if self.logprobs or self.top_logprobs:
            raise FieldError("logprobs", "logprobs and top_logprobs are not supported on the Ollama API; use "
                             "/v1/chat/completions")
        fields = {**options_fields(self.options), "response_format": response_format(self.format)}
        fields["chat_template_kwargs"] = think_kwargs(self.think, thinking)
        return {key: value for key, value in fields.items() if value is not None}


class ChatBody(_Body):
    """POST /api/chat."""

    messages: Items[Any] = Field(default_factory=list)
    tools: Items[Any] | None = None

    def chat_body(self, model: str, thinking: bool) -> dict:
        """The chat completion request (a dict for ChatCompletionRequest)."""
        messages = chat_messages(self.messages)
        body = {"model": model, "messages": messages, **self.sampling_fields(thinking)}
        paths = [("messages", i, "images", k) for i, m in enumerate(self.messages)
                 for k in range(len(m.get("images") or ()))]
        return body | ({"tools": self.tools} if self.tools else {}) | ({PICTURE_PATHS: paths} if paths else {})


class GenerateBody(_Body):
    """POST /api/generate."""

    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: Items[int] | None = None
    raw: bool | None = None
    images: Items[Any] | None = None
    width: int | None = None  # image generation: refused
    height: int | None = None
    steps: int | None = None

    def check_supported(self) -> None:
        """FieldError naming a field this server cannot honour."""
        if self.template:
            raise FieldError("template", "a Go template is not supported: the model's own chat template is used; "
                             "send raw=true with a prompt formatted already")
        if self.context:
            raise FieldError("context", "the tokens of an earlier answer are not supported; send the "
                             "conversation to /api/chat")
        for name, value in (("width", self.width), ("height", self.height), ("steps", self.steps)):
            if value:
                raise FieldError(name, "is not supported: this server serves a text model")
        if self.images and not self.templated:
            raise FieldError("images", "need the chat template; they cannot go with raw or suffix")

    @property
    def templated(self) -> bool:
        """The prompt goes through the chat template (neither raw nor a fill-in-the-middle suffix)."""
        return not self.raw and not self.suffix

    def chat_body(self, model: str, thinking: bool) -> dict:
        user = {"role": "user", "content": _with_images(self.prompt or "", self.images, ("images",))}
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [user]
        paths = [("images", k) for k in range(len(self.images or ()))]
        return {"model": model, "messages": messages, **self.sampling_fields(thinking)} | (
            {PICTURE_PATHS: paths} if paths else {})

    def completion_body(self, model: str) -> dict:
        """The completion request of a raw (or suffix) prompt; `system` and `think` need the template."""
        if self.system:
            raise FieldError("system", "needs the chat template; it cannot go with raw or suffix")
        if self.think:
            raise FieldError("think", "needs the chat template; it cannot go with raw or suffix")
        fields = self.sampling_fields(False)
        fields.pop("chat_template_kwargs", None)
        body = {"model": model, "prompt": self.prompt or "", **fields}
        return body | ({"suffix": self.suffix} if self.suffix else {})


class EmbedBody(BaseModel):
    """POST /api/embed."""

    model_config = STRICT
    model: str = Field(min_length=1)
    input: str | Items[str]
    truncate: bool | None = None  # true: cut an input to the context (unset: a too long input is a 400)
    dimensions: int | None = None
    options: Entries[str, Any] | None = None
    keep_alive: float | str | None = None

    def inputs(self) -> list[str]:
        """The inputs; FieldError naming `input` for none, too many, or an empty one."""
        options_fields(self.options)  # checked; no option changes an embedding
        inputs = [self.input] if isinstance(self.input, str) else list(self.input)
        if not inputs or len(inputs) > MAX_INPUTS:
            raise FieldError("input", f"must hold 1 to {MAX_INPUTS} strings, got {len(inputs)}")
        empty = next((i for i, text in enumerate(inputs) if not text), None)
        if empty is not None:
            raise FieldError(("input", empty), "is empty; every input needs at least one token")
        return inputs

    def pooling_params(self) -> PoolingParams:
        """`truncate` true cuts an input to the context (-1); unset or false refuses a too long one."""
        try:
            return PoolingParams(dimensions=self.dimensions, truncate_prompt_tokens=-1 if self.truncate else None)
        except ValueError as exc:
            raise FieldError("dimensions", str(exc).removeprefix("dimensions").lstrip(": ")) from None


class LegacyEmbedBody(BaseModel):
    """POST /api/embeddings (Ollama's older route)."""

    model_config = STRICT
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    options: Entries[str, Any] | None = None
    keep_alive: float | str | None = None


class NameBody(BaseModel):
    """POST /api/show."""

    model_config = STRICT
    model: str | None = None
    name: str | None = None  # Ollama's older spelling
    verbose: bool | None = None

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise FieldError("model", "is required")
        return name


def options_fields(options: dict | None) -> dict:
    """Ollama's options as chat request fields (their values checked there); FieldError naming an
    option that is not supported."""
    fields = {}
    for name, value in (options or {}).items():
        if name in _SAMPLING_OPTIONS:
            fields[_SAMPLING_OPTIONS[name]] = value
        elif name == "num_predict":
            fields["max_tokens"] = None if value in (-1, -2) else value
        elif name not in _LOAD_OPTIONS and not (name in _NEUTRAL_OPTIONS and value == _NEUTRAL_OPTIONS[name]):
            raise FieldError(("options", name), f"{short_repr(value)} is not supported (supported: "
                             f"{', '.join([*_SAMPLING_OPTIONS, 'num_predict'])}; ignored: the load-time options)")
    return fields


def response_format(fmt) -> dict | None:
    """`format` as the chat response_format: "json" any JSON object, a dict a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise FieldError("format", f"must be \"json\" or a JSON schema object, got {short_repr(fmt)}")


def think_kwargs(think, thinking: bool) -> dict | None:
    """`think` as the chat template's enable_thinking (`thinking`: the server reads reasoning sections)."""
    if think is None or (think is False and not thinking):
        return None
    if think not in (True, False, "high", "medium", "low"):
        raise FieldError("think", f"must be true, false, \"high\", \"medium\" or \"low\", got {short_repr(think)}")
    if not thinking:
        raise FieldError("think", "this server reads no reasoning section (start it with --reasoning-parser)")
    return {"enable_thinking": think is not False}


def chat_messages(messages: list) -> list[dict]:
    """Ollama's messages as chat messages; FieldError naming `messages[i]...` for a bad one. A tool
    reply answers the earliest unanswered call (of its `tool_name`, when given): linear in the messages."""
    converted, pending = [], PendingCalls()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FieldError(("messages", i), f"must be an object, got {short_repr(message)}")
        unknown = sorted(set(message) - _MESSAGE_FIELDS)
        if unknown:
            raise FieldError(("messages", i), f"has unknown field {short_repr(unknown[0])}")
        role, content = message.get("role"), message.get("content") or ""
        if role not in _ROLES:
            raise FieldError(("messages", i, "role"), f"must be one of {', '.join(_ROLES)}, got {short_repr(role)}")
        if not isinstance(content, str):
            raise FieldError(("messages", i, "content"), f"must be a string, got {short_repr(content)}")
        converted.append(_message(i, role, content, message, pending))
        if message.get("images"):
            if role != "user":
                raise FieldError(("messages", i, "images"), f"only a user message may carry images, not {role}")
            converted[-1]["content"] = _with_images(content, message["images"], ("messages", i, "images"))
    return converted


def _with_images(text: str, images, where: tuple) -> str | list[dict]:
    """A message's content with its images (base64 strings) as image_url parts before the text."""
    if not images:
        return text
    if not isinstance(images, list):
        raise FieldError(where, f"must be a list of base64 strings, got {short_repr(images)}")
    parts = []
    for k, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise FieldError((*where, k), f"must be a base64 string, got {short_repr(image)}")
        parts.append({"type": "image_url", "image_url": {"url": "data:;base64," + image}})
    return parts + ([{"type": "text", "text": text}] if text else [])


class PendingCalls:
    """The unanswered calls of a conversation, in order: the earliest of them, or the earliest of one
    name, is found and removed in amortized constant time."""

    def __init__(self):
        self._order: OrderedDict[str, str] = OrderedDict()  # call id -> name
        self._by_name: defaultdict[str, deque[str]] = defaultdict(deque)

    def add(self, call_id: str, name: str) -> None:
        self._order[call_id] = name
        self._by_name[name].append(call_id)

    def answer(self, name: str | None) -> str | None:
        """The id of the earliest unanswered call (named `name`, when given), now answered; None if none."""
        if name is None:
            return self._order.popitem(last=False)[0] if self._order else None
        ids = self._by_name.get(name)
        while ids:
            call_id = ids.popleft()
            if self._order.pop(call_id, None) is not None:  # not answered meanwhile by a reply without a name
                return call_id
        return None


def _message(i: int, role: str, content: str, message: dict, pending: PendingCalls) -> dict:
    if role == "assistant" and message.get("tool_calls"):
        calls = [_call(i, j, call) for j, call in enumerate(_list(i, message["tool_calls"]))]
        for call in calls:
            pending.add(call["id"], call["function"]["name"])
        return {"role": role, "content": content or None, "tool_calls": calls}
    if role != "tool":
        return {"role": role, "content": content}
    name = message.get("tool_name")
    if name is not None and not isinstance(name, str):
        raise FieldError(("messages", i, "tool_name"), f"must be a string, got {short_repr(name)}")
    answered = pending.answer(name)
    call_id = message.get("tool_call_id") or answered or f"call_{i}"
    return {"role": "tool", "content": content, "tool_call_id": call_id} | ({"name": name} if name else {})


def _list(i: int, calls) -> list:
    if not isinstance(calls, list):
        raise FieldError(("messages", i, "tool_calls"), f"must be a list, got {short_repr(calls)}")
    return calls


def _call(i: int, j: int, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", {}) if isinstance(function, dict) else None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise FieldError(("messages", i, "tool_calls", j), f"must be {{\"function\": {{\"name\": string, "
                         f"\"arguments\": object}}}}, got {short_repr(call)}")
    call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{i}_{j}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
