"""Every POST route of `deepinfer serve` as the hostile-body tests see it: a valid, cheap body, the
route's main list field, its number fields and its enum-like fields (the table below), and the
error shape of its API.

Enum-like fields are the ones whose value the server compares with a fixed set of names (a role,
a block or item type, a choice, a format) or looks up (a model, a tool name). A client that sends
a list or an object there must get a 4xx naming the field, never a 500 from an unhashable value
reaching a dict or set. Where a list (or an object) is a valid value of the field (`stop` takes a
list of strings, Ollama's `format` a JSON schema object), only the other kind is sent.

    route                       enum-like fields (a path into the body: key names and list indexes)
    /v1/completions             model, stop, service_tier, response_format.type
    /v1/chat/completions        model, messages[].role, messages[].content[].type, messages[].tool_calls[].type,
                                tools[].type, tool_choice, tool_choice.type, response_format.type, stop,
                                reasoning_effort, verbosity, service_tier, modalities[], function_call
    /v1/responses               model, input[].type, input[].role, input[].content[].type, tools[].type,
                                tool_choice, tool_choice.type, text.format.type, truncation, service_tier,
                                include[]
    /v1/messages                model, messages[].role, messages[].content[].type, system[].type, tools[].type,
                                tool_choice, tool_choice.type, thinking, thinking.type,
                                output_config.format.type, stop_sequences, service_tier
    /v1/messages/count_tokens   the same, less stop_sequences and service_tier
    /v1/embeddings              model, encoding_format
    /tokenize                   model, messages[].role, messages[].content[].type, tools[].type
    /detokenize, /v1/rerank, /v1/score, /api/embed, /api/embeddings    model
    /infill                     model, stop, samplers[]
    /api/chat                   model, messages[].role, messages[].tool_name, tools[].type, format, think,
                                options.stop
    /api/generate               model, format, think, options.stop
    /api/show                   model, name
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

MODEL = "tiny"
UNHASHABLE = ([], ["x"], {}, {"a": 1})
OBJECTS = ({}, {"a": 1})  # for a field that takes a list
LISTS = ([], ["x"])  # for a field that takes an object
NON_FINITE = ("Infinity", "-Infinity", "NaN", "1e400")  # JSON text of the number

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
USER_BLOCKS = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
CALL_HISTORY = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "r"}]
OLLAMA_CALLS = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                {"role": "tool", "content": "r", "tool_name": "f"}]
RESPONSES_FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
INPUT_ITEMS = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]


@dataclass(frozen=True)
class Enum:
    """An enum-like field: where it is, what the body needs beside it, the values sent there."""

    path: tuple
    context: dict = field(default_factory=dict)
    values: tuple = UNHASHABLE


@dataclass(frozen=True)
class Route:
    path: str
    body: dict  # valid and cheap (a token or two)
    main: str  # the main list field (a string field where the route has no list)
    numbers: tuple[tuple, ...] = ()
    enums: tuple[Enum, ...] = ()


def _anthropic_enums(sampling: bool) -> tuple[Enum, ...]:
    tools = {"tools": [ANTHROPIC_TOOL]}
    enums = (Enum(("model",)), Enum(("messages", 0, "role")), Enum(("messages", 0, "content", 0, "type")),
             Enum(("system", 0, "type"), {"system": [{"type": "text", "text": "be brief"}]}),
             Enum(("tools", 0, "type"), tools), Enum(("tool_choice",), tools),
             Enum(("tool_choice", "type"), {**tools, "tool_choice": {"type": "auto"}}),
             Enum(("thinking",)), Enum(("thinking", "type"), {"thinking": {"type": "enabled", "budget_tokens": 16}}),
             Enum(("output_config", "format", "type"),
                  {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}))
    return enums + ((Enum(("stop_sequences",), values=OBJECTS), Enum(("service_tier",))) if sampling else ())


ROUTES = (
    Route("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "prompt",
          (("max_tokens",), ("temperature",), ("top_p",), ("seed",), ("priority",), ("logit_bias", "50")),
          (Enum(("model",)), Enum(("stop",), values=OBJECTS), Enum(("service_tier",)),
           Enum(("response_format", "type"), {"response_format": {"type": "text"}}))),
    Route("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "messages",
          (("max_tokens",), ("max_completion_tokens",), ("temperature",), ("top_logprobs",)),
          (Enum(("model",)), Enum(("messages", 0, "role")),
           Enum(("messages", 0, "content", 0, "type"), {"messages": USER_BLOCKS}),
           Enum(("messages", 1, "tool_calls", 0, "type"), {"messages": CALL_HISTORY, "tools": [FUNCTION]}),
           Enum(("tools", 0, "type"), {"tools": [FUNCTION]}), Enum(("tool_choice",), {"tools": [FUNCTION]}),
           Enum(("tool_choice", "type"), {"tools": [FUNCTION],
                                          "tool_choice": {"type": "function", "function": {"name": "f"}}}),
           Enum(("response_format", "type"), {"response_format": {"type": "json_object"}}),
           Enum(("stop",), values=OBJECTS), Enum(("reasoning_effort",)), Enum(("verbosity",)),
           Enum(("service_tier",)), Enum(("modalities", 0), {"modalities": ["text"]}), Enum(("function_call",)))),
    Route("/v1/responses", {"input": INPUT_ITEMS, "max_output_tokens": 2, "store": False}, "input",
          (("max_output_tokens",), ("temperature",), ("top_p",)),
          (Enum(("model",)), Enum(("input", 0, "type")), Enum(("input", 0, "role")),
           Enum(("input", 0, "content", 0, "type")), Enum(("tools", 0, "type"), {"tools": [RESPONSES_FUNCTION]}),
           Enum(("tool_choice",), {"tools": [RESPONSES_FUNCTION]}),
           Enum(("tool_choice", "type"), {"tools": [RESPONSES_FUNCTION], "tool_choice": {"type": "function",
                                                                                         "name": "f"}}),
           Enum(("text", "format", "type"), {"text": {"format": {"type": "text"}}}), Enum(("truncation",)),
           Enum(("service_tier",)), Enum(("include", 0), {"include": ["reasoning.encrypted_content"]}))),
    Route("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": USER_BLOCKS}, "messages",
          (("max_tokens",), ("temperature",), ("top_k",)), _anthropic_enums(sampling=True)),
    Route("/v1/messages/count_tokens", {"model": MODEL, "messages": USER_BLOCKS}, "messages",
          (("thinking", "budget_tokens"),), _anthropic_enums(sampling=False)),
    Route("/v1/embeddings", {"input": ["hi"]}, "input", (("dimensions",), ("truncate_prompt_tokens",)),
          (Enum(("model",)), Enum(("encoding_format",)))),
    Route("/tokenize", {"messages": USER_BLOCKS}, "messages", (),
          (Enum(("model",)), Enum(("messages", 0, "role")), Enum(("messages", 0, "content", 0, "type")),
           Enum(("tools", 0, "type"), {"tools": [FUNCTION]}))),
    Route("/detokenize", {"tokens": [1, 2]}, "tokens", (("tokens", 0),), (Enum(("model",)),)),
    Route("/v1/rerank", {"query": "a", "documents": ["b"]}, "documents", (("top_n",),), (Enum(("model",)),)),
    Route("/v1/score", {"text_1": ["a"], "text_2": ["b"]}, "text_1", (), (Enum(("model",)),)),
    Route("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f", "text": "x"}],
                      "n_predict": 2}, "input_extra", (("n_predict",), ("temperature",), ("top_p",), ("seed",)),
          (Enum(("model",)), Enum(("stop",), values=OBJECTS), Enum(("samplers", 0), {"samplers": ["top_k"]}))),
    Route("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                        "options": {"num_predict": 2}}, "messages",
          (("options", "num_predict"), ("options", "temperature"), ("options", "top_k"), ("keep_alive",)),
          (Enum(("model",)), Enum(("messages", 0, "role")),
           Enum(("messages", 2, "tool_name"), {"messages": OLLAMA_CALLS}),
           Enum(("tools", 0, "type"), {"tools": [FUNCTION]}),
           Enum(("format",), values=LISTS), Enum(("think",)), Enum(("options", "stop"), values=OBJECTS))),
    Route("/api/generate", {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
          "context", (("options", "num_predict"), ("options", "seed"), ("keep_alive",)),
          (Enum(("model",)), Enum(("format",), values=LISTS), Enum(("think",)),
           Enum(("options", "stop"), values=OBJECTS))),
    Route("/api/embed", {"model": MODEL, "input": ["hi"]}, "input", (("dimensions",), ("keep_alive",)),
          (Enum(("model",)),)),
    Route("/api/embeddings", {"model": MODEL, "prompt": "hi"}, "prompt", (("keep_alive",), ("options", "temperature")),
          (Enum(("model",)),)),
    Route("/api/show", {"model": MODEL}, "model", (), (Enum(("model",)), Enum(("name",), {"model": None}))),
)
ROUTE = {route.path: route for route in ROUTES}


def api_of(path: str) -> str:
    """Whose error shape the route answers in: openai, anthropic (/v1/messages*) or ollama (/api/*)."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "ollama" if path.startswith("/api/") else "openai"


def error_of(path: str, resp) -> tuple[str, str | None]:
    """(message, param) of an error answer; AssertionError unless it has the route's API error shape
    (param: None where the API has none)."""
    body = resp.json()
    api = api_of(path)
    if api == "anthropic":
        assert body.get("type") == "error" and isinstance(body.get("error"), dict), body
        assert isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str), body
        return body["error"]["message"], None
    if api == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"], None
    error = body.get("error")
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), body
    return error["message"], error["param"]


def refusal_problem(path: str, resp, field_path: tuple) -> str | None:
    """None when `resp` is a 4xx in the route's error shape whose message names the field at
    `field_path` (its top-level name and its own key; for OpenAI's shape `param` is the top-level
    name); else what is wrong, with the first 300 characters of the answer."""
    shown = f"{resp.status_code} {resp.text[:300]}"
    if not 400 <= resp.status_code < 500:
        return f"not a 4xx: {shown}"
    try:
        message, param = error_of(path, resp)
    except (AssertionError, ValueError):
        return f"not {api_of(path)}'s error shape: {shown}"
    top, leaf = field_path[0], next((p for p in reversed(field_path) if isinstance(p, str)), field_path[0])
    if top not in message or leaf not in message:
        return f"the message does not name {' and '.join(map(repr, dict.fromkeys((top, leaf))))}: {shown}"
    if api_of(path) == "openai" and param != top:
        return f"param is {param!r}, not {top!r}: {shown}"
    return None


def body_with(route: Route, field_path: tuple, value, context: dict | None = None) -> dict:
    """The route's body with `context` merged in (None values drop a field) and `value` at `field_path`."""
    body = {k: v for k, v in {**copy.deepcopy(route.body), **copy.deepcopy(context or {})}.items() if v is not None}
    *parents, last = field_path
    target = body
    for key in parents:
        target = target.setdefault(key, {}) if isinstance(key, str) else target[key]
    target[last] = value
    return body


def raw_with(route: Route, field_path: tuple, json_text: str, context: dict | None = None) -> bytes:
    """The route's body (as body_with) with the JSON text `json_text` at `field_path` (which may be
    what json.dumps never writes: Infinity, 1e400, 100,000 brackets)."""
    marker = "__VALUE_MARKER__"
    text = json.dumps(body_with(route, field_path, marker, context), separators=(",", ":"))
    return text.replace(json.dumps(marker), json_text, 1).encode()


def case_id(field_path: tuple) -> str:
    return ".".join(str(p) for p in field_path)
