"""Fuzzing `deepinfer serve`: no input gets a 5xx, nothing hangs, and the server is whole after.

The server's app in this process (`AppServer`) on the tiny checkpoint (a short context, so that
a valid request is quick) gets hypothesis-generated JSON bodies over the request fields of
/v1/completions, /v1/chat/completions and /v1/embeddings (right names with right and wrong types, huge and
negative numbers, nested junk, lone surrogates, any unicode, sent as escaped ASCII or as raw
UTF-8) and a table of hand-written hostile requests. Every answer must be a 2xx or an OpenAI-shaped 4xx within the
per-request timeout; a chat or completion stream must end with `data: [DONE]` and carry no error
event; a Responses stream (no `[DONE]`) must pass `responses_stream.check_response_stream` (events in
order, numbered, ending with `response.completed` / `.incomplete`, no `error`). Afterwards
a normal request succeeds and every KV block is free again. `pytest -s` prints the counts.

The server parses tool calls (hermes) and reasoning (deepseek_r1), so chat bodies with function
tools, tool_choice and histories of calls reach the grammars and parsers; /v1/responses, /tokenize
and /detokenize get bodies of their own fields; well-typed Responses bodies and a fixed streamed
example make sure successful Responses streams are among the cases (`COUNTS["responses streams"]`).
/v1/messages and /v1/messages/count_tokens get Anthropic-shaped bodies: their 4xx must be in Anthropic's
error shape, their streams Anthropic's events in order (`check_messages_stream`).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
from app_server import AppServer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from responses_stream import check_response_stream

MODEL = "fuzz-model"
MAX_BODY = 1 << 20
REQUEST_TIMEOUT_S = 30.0
EXAMPLES_PER_ENDPOINT = 100  # per test: 6 tests
COUNTS: Counter = Counter()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint):
    with AppServer("--model", tiny_checkpoint("llama"), "--max-model-len", "96", "--served-model-name", MODEL,
                   "--max-body-bytes", str(MAX_BODY), "--tool-call-parser", "hermes",
                   "--reasoning-parser", "deepseek_r1") as server:
        yield server


@pytest.fixture(scope="module")
def client(fuzz_server):
    return fuzz_server.client


def send(client: httpx.Client, path: str, raw: bytes | None, headers: dict | None = None,
         method: str = "POST") -> int:
    """One request; asserts no 5xx, no hang, an OpenAI-shaped 4xx, and a whole stream."""
    headers = {"Content-Type": "application/json"} if headers is None else headers
    try:
        with client.stream(method, path, content=raw, headers=headers, timeout=REQUEST_TIMEOUT_S) as resp:
            body = resp.read()
    except httpx.TimeoutException:
        COUNTS["timeouts"] += 1
        pytest.fail(f"no answer within {REQUEST_TIMEOUT_S} s to {method} {path} {raw[:200]!r}")
    status = resp.status_code
    COUNTS["cases"] += 1
    COUNTS[f"{status // 100}xx"] += 1
    assert status < 500, f"{status} for {method} {path} {raw[:300]!r}: {body[:500]!r}"
    if status >= 400 and path.startswith("/api/"):  # Ollama's error shape there
        assert isinstance(json.loads(body)["error"], str) and len(json.loads(body)) == 1, body[:300]
    elif status >= 400 and resp.headers.get("content-type", "").startswith("application/json"):
        anthropic = path.startswith("/v1/messages")  # Anthropic's error shape there
        assert set(json.loads(body)["error"]) == ({"type", "message"} if anthropic else {"message", "type", "param",
                                                                                          "code"})
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(path, body)
    if resp.headers.get("content-type", "").startswith("application/x-ndjson"):  # Ollama: done or error last
        lines = [json.loads(line) for line in body.splitlines()]
        assert lines and (lines[-1].get("done") is True or "error" in lines[-1]), body[-300:]
    return status


def check_stream(path: str, body: bytes) -> None:
    """A whole stream: Responses' events (no `[DONE]` there), else chunks ending with `data: [DONE]`."""
    if path.startswith("/v1/responses"):
        check_response_stream(body)
        COUNTS["responses streams"] += 1
        return
    if path.startswith("/v1/messages"):
        check_messages_stream(body)
        return
    assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
    assert b'data: {"error"' not in body, body[-500:]


# -- strategies -------------------------------------------------------------------------------------

_surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)
TEXT = st.one_of(st.text(max_size=30), st.tuples(st.text(max_size=5), _surrogates, st.text(max_size=5)).map("".join))
INTS = st.one_of(st.integers(-3, 120), st.integers(),
                 st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**40, -(10**40)]))
FLOATS = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True))
JUNK = st.recursive(st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT),
                    lambda children: st.one_of(st.lists(children, max_size=4),
                                               st.dictionaries(TEXT, children, max_size=4)),
                    max_leaves=12)
TOKEN_IDS = st.lists(st.integers(-2, 50_000), max_size=24)

_COMMON = {
    "model": st.one_of(st.just(MODEL), TEXT),
    "max_tokens": INTS, "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "min_p": FLOATS,
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS, "seed": INTS,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)), "n": INTS, "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.one_of(st.booleans(), JUNK)}),
    "user": TEXT, "ignore_eos": st.booleans(), "logit_bias": st.dictionaries(TEXT, INTS, max_size=3),
}
COMPLETION_FIELDS = _COMMON | {
    "prompt": st.one_of(st.text(max_size=60), TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3),
                        st.lists(TOKEN_IDS, max_size=3)),
    "logprobs": INTS, "best_of": INTS, "echo": st.booleans(), "suffix": TEXT,
}
_PART = st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["text", "image_url"]), TEXT)},
                              optional={"text": TEXT, "image_url": JUNK})
_NAMES = st.sampled_from(["f", "get_weather", "add"])
_PROPERTY = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean"])},
                                            optional={"maxLength": st.integers(0, 8), "minimum": st.integers(-5, 5)}),
                      st.fixed_dictionaries({"enum": st.lists(st.text(max_size=4), min_size=1, max_size=3)}))
_SCHEMA = st.fixed_dictionaries({"type": st.just("object")}, optional={
    "properties": st.dictionaries(st.sampled_from(["a", "b", "c"]), _PROPERTY, max_size=3),
    "required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=3), "additionalProperties": st.booleans()})
_TOOL = st.fixed_dictionaries({"type": st.one_of(st.just("function"), TEXT), "function": st.fixed_dictionaries(
    {"name": st.one_of(_NAMES, TEXT)},
    optional={"description": TEXT, "parameters": st.one_of(_SCHEMA, JUNK), "strict": st.booleans()})})
_TOOL_CHOICE = st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.one_of(_NAMES, TEXT)})}))
_CALL = st.fixed_dictionaries({"id": TEXT, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.one_of(_NAMES, TEXT), "arguments": st.one_of(st.just('{"a": 1}'), TEXT, JUNK)})})
_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), TEXT),
     "content": st.one_of(st.text(max_size=60), TEXT, st.none(), st.lists(_PART, max_size=3))},
    optional={"name": st.one_of(TEXT, JUNK), "tool_calls": st.one_of(JUNK, st.lists(_CALL, max_size=2)),
              "tool_call_id": TEXT})
CHAT_FIELDS = _COMMON | {
    "messages": st.lists(_MESSAGE, max_size=4), "max_completion_tokens": INTS, "logprobs": st.booleans(),
    "top_logprobs": INTS, "tools": st.one_of(st.lists(_TOOL, max_size=3), st.lists(JUNK, max_size=2)),
    "tool_choice": st.one_of(_TOOL_CHOICE, JUNK), "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": st.dictionaries(TEXT, JUNK, max_size=2),
    "functions": st.lists(JUNK, max_size=2), "function_call": st.one_of(st.just("none"), JUNK),
    "response_format": st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["text", "json_object"]), TEXT)}),
}
EMBEDDING_FIELDS = {
    "model": st.one_of(st.just(MODEL), TEXT),
    "input": st.one_of(st.text(max_size=60), TEXT, TOKEN_IDS, st.lists(TEXT, max_size=4),
                       st.lists(TOKEN_IDS, max_size=4)),
    "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), TEXT), "dimensions": INTS, "user": TEXT,
    "truncate_prompt_tokens": INTS, "normalize": st.booleans(),
}


# well-typed: every value of its right type and mostly in range, so that most requests reach the
# engine and exercise its sampling options together
_CLEAN_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
_WELL_TYPED_COMMON = {
    "model": st.just(MODEL), "max_tokens": st.integers(1, 40), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.one_of(st.integers(-1, 100), st.integers(0, 2**63 - 1)),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 5), "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(), "user": _CLEAN_TEXT, "ignore_eos": st.booleans(), "n": st.just(1),
}
WELL_TYPED_COMPLETION_FIELDS = _WELL_TYPED_COMMON | {
    "prompt": st.one_of(_CLEAN_TEXT.filter(str.strip), st.lists(st.integers(0, 49_151), min_size=1, max_size=40)),
    "logprobs": st.integers(0, 20), "best_of": st.just(1), "echo": st.just(False),
}
WELL_TYPED_CHAT_FIELDS = _WELL_TYPED_COMMON | {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.one_of(_CLEAN_TEXT, st.lists(st.fixed_dictionaries(
                                                    {"type": st.just("text"), "text": _CLEAN_TEXT}), max_size=2))}),
                         min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, 40), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": _NAMES, "parameters": _SCHEMA})}), max_size=2),
    "tool_choice": _TOOL_CHOICE, "parallel_tool_calls": st.booleans(),
}


_ID_LISTS = st.lists(st.integers(0, 49_151), min_size=1, max_size=120)  # some beyond the 96-token context
WELL_TYPED_EMBEDDING_FIELDS = {
    "model": st.just(MODEL), "user": _CLEAN_TEXT, "normalize": st.booleans(),
    "input": st.one_of(_CLEAN_TEXT.filter(str.strip), st.lists(_CLEAN_TEXT.filter(str.strip), min_size=1, max_size=8),
                       _ID_LISTS, st.lists(_ID_LISTS, min_size=1, max_size=6)),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "truncate_prompt_tokens": st.one_of(st.just(-1), st.integers(1, 200)),
}


def well_typed(fields: dict, required: str) -> st.SearchStrategy[dict]:
    optional = {name: strategy for name, strategy in fields.items() if name != required}
    return st.fixed_dictionaries({required: fields[required]}, optional=optional)


def bodies(fields: dict, required: str) -> st.SearchStrategy[dict]:
    """Objects over `fields`: each value of its right type or junk; `required` mostly present."""
    values = {name: st.one_of(strategy, JUNK) for name, strategy in fields.items() if name != required}
    with_required = st.fixed_dictionaries({required: fields[required]}, optional=values)
    return st.one_of(with_required, with_required, st.fixed_dictionaries({}, optional=values | {required: JUNK}))


def encode(body: dict, ascii_only: bool) -> bytes:
    """JSON as escaped ASCII, or as raw UTF-8 (a lone surrogate then goes out as its 3 bytes)."""
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


_FUZZ = settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_FUZZ
@given(body=bodies(COMPLETION_FIELDS, "prompt"), ascii_only=st.booleans())
def test_fuzz_completions(client, body, ascii_only):
    send(client, "/v1/completions", encode(body, ascii_only))


@_FUZZ
@given(body=bodies(CHAT_FIELDS, "messages"), ascii_only=st.booleans())
def test_fuzz_chat_completions(client, body, ascii_only):
    send(client, "/v1/chat/completions", encode(body, ascii_only))


@_FUZZ
@given(body=well_typed(WELL_TYPED_COMPLETION_FIELDS, "prompt"))
def test_fuzz_well_typed_completions(client, body):
    send(client, "/v1/completions", encode(body, False))


@_FUZZ
@given(body=well_typed(WELL_TYPED_CHAT_FIELDS, "messages"))
def test_fuzz_well_typed_chat_completions(client, body):
    send(client, "/v1/chat/completions", encode(body, False))


@_FUZZ
@given(body=bodies(EMBEDDING_FIELDS, "input"), ascii_only=st.booleans())
def test_fuzz_embeddings(client, body, ascii_only):
    send(client, "/v1/embeddings", encode(body, ascii_only))


@_FUZZ
@given(body=well_typed(WELL_TYPED_EMBEDDING_FIELDS, "input"))
def test_fuzz_well_typed_embeddings(client, body):
    send(client, "/v1/embeddings", encode(body, False))


# -- the Responses API and the tokenizer routes -----------------------------------------------------

_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "developer", "assistant"]), TEXT),
                           "content": st.one_of(TEXT, JUNK, st.lists(st.fixed_dictionaries(
                               {"type": st.one_of(st.sampled_from(["input_text", "output_text", "input_image"]), TEXT)},
                               optional={"text": TEXT}), max_size=2))}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": st.one_of(_NAMES, TEXT),
                           "arguments": st.one_of(st.just("{}"), TEXT)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": st.one_of(TEXT, JUNK)}),
    st.fixed_dictionaries({"type": st.one_of(st.just("reasoning"), TEXT)}, optional={"summary": JUNK}),
    JUNK)
_RESPONSES_TOOL = st.fixed_dictionaries(
    {"type": st.one_of(st.just("function"), TEXT), "name": st.one_of(_NAMES, TEXT)},
    optional={"parameters": st.one_of(_SCHEMA, JUNK), "strict": st.booleans()})
RESPONSES_FIELDS = {
    "model": st.one_of(st.just(MODEL), TEXT),
    "input": st.one_of(st.text(max_size=60), TEXT, st.lists(_ITEM, max_size=4)),
    "instructions": TEXT, "max_output_tokens": INTS, "temperature": FLOATS, "top_p": FLOATS, "stream": st.booleans(),
    "tools": st.lists(_RESPONSES_TOOL, max_size=2), "parallel_tool_calls": st.booleans(), "store": st.booleans(),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"), "name": st.one_of(_NAMES, TEXT)})),
    "previous_response_id": st.one_of(TEXT, st.just("resp_x")), "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
    "text": st.fixed_dictionaries({"format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "name": TEXT, "schema": st.one_of(_SCHEMA, JUNK)}))}),
    "reasoning": JUNK, "include": st.lists(TEXT, max_size=2), "truncation": st.sampled_from(["auto", "disabled"]),
    "background": st.booleans(), "user": TEXT,
}
TOKENIZE_FIELDS = {
    "model": st.one_of(st.just(MODEL), TEXT), "prompt": st.one_of(st.text(max_size=60), TEXT),
    "messages": st.lists(_MESSAGE, max_size=3), "add_generation_prompt": st.booleans(),
    "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(), "tools": st.lists(_TOOL, max_size=2),
    "chat_template_kwargs": st.dictionaries(TEXT, JUNK, max_size=2),
}
DETOKENIZE_FIELDS = {"model": st.one_of(st.just(MODEL), TEXT),
                     "tokens": st.one_of(TOKEN_IDS, st.lists(INTS, max_size=5))}
_FUZZ_ROUTE = settings(_FUZZ, max_examples=60)

# well-typed Responses bodies, mostly streamed: most reach the engine, and their streams are checked
_INPUT_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "developer", "assistant"]),
    "content": st.one_of(_CLEAN_TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.just("input_text"), "text": _CLEAN_TEXT}), min_size=1, max_size=2))})
WELL_TYPED_RESPONSES_FIELDS = {
    "model": st.just(MODEL), "instructions": _CLEAN_TEXT, "max_output_tokens": st.integers(1, 40),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "store": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": _NAMES, "parameters": _SCHEMA}),
                      max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]), "parallel_tool_calls": st.booleans(),
    "text": st.fixed_dictionaries({"format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("s"), "schema": _SCHEMA}))}),
}
WELL_TYPED_RESPONSES = st.fixed_dictionaries(
    {"input": st.one_of(_CLEAN_TEXT.filter(str.strip), st.lists(_INPUT_MESSAGE, min_size=1, max_size=3)),
     "stream": st.sampled_from([True, True, False])}, optional=WELL_TYPED_RESPONSES_FIELDS)
STREAMED_RESPONSE = {"model": MODEL, "input": "Say hi", "stream": True, "max_output_tokens": 8, "temperature": 0}


@_FUZZ_ROUTE
@given(body=bodies(RESPONSES_FIELDS, "input"), ascii_only=st.booleans())
@example(body=STREAMED_RESPONSE, ascii_only=False)
def test_fuzz_responses(client, body, ascii_only):
    send(client, "/v1/responses", encode(body, ascii_only))


@_FUZZ_ROUTE
@given(body=WELL_TYPED_RESPONSES)
def test_fuzz_well_typed_responses(client, body):
    send(client, "/v1/responses", encode(body, False))


def test_a_streamed_response_passes_the_stream_check(client):
    """A valid streamed /v1/responses request is a 200 whose events `send` reads and checks (with the
    old `[DONE]` check this very request failed the fuzz test, so none could be among its cases)."""
    before = COUNTS["responses streams"]
    assert send(client, "/v1/responses", encode(STREAMED_RESPONSE, False)) == 200
    assert COUNTS["responses streams"] == before + 1


@_FUZZ_ROUTE
@given(body=bodies(TOKENIZE_FIELDS, "prompt"), ascii_only=st.booleans())
def test_fuzz_tokenize(client, body, ascii_only):
    send(client, "/tokenize", encode(body, ascii_only))


@_FUZZ_ROUTE
@given(body=bodies(DETOKENIZE_FIELDS, "tokens"), ascii_only=st.booleans())
def test_fuzz_detokenize(client, body, ascii_only):
    send(client, "/detokenize", encode(body, ascii_only))


# -- Anthropic's Messages API ----------------------------------------------------------------------

_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": st.one_of(_NAMES, TEXT),
                           "input": st.one_of(st.just({"a": 1}), JUNK)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT},
                          optional={"content": st.one_of(TEXT, JUNK), "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["thinking", "image"]), TEXT)},
                          optional={"thinking": TEXT}),
    JUNK)
_ANTHROPIC_MESSAGE = st.fixed_dictionaries({
    "role": st.one_of(st.sampled_from(["user", "assistant"]), TEXT),
    "content": st.one_of(st.text(max_size=60), TEXT, st.lists(_BLOCK, max_size=3))})
MESSAGES_FIELDS = {
    "model": st.one_of(st.just(MODEL), TEXT), "max_tokens": INTS, "messages": st.lists(_ANTHROPIC_MESSAGE, max_size=4),
    "system": st.one_of(TEXT, st.lists(_BLOCK, max_size=2)), "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS,
    "stop_sequences": st.lists(TEXT, max_size=3), "stream": st.booleans(), "metadata": JUNK,
    "tools": st.lists(st.fixed_dictionaries({"name": st.one_of(_NAMES, TEXT)}, optional={
        "description": TEXT, "input_schema": st.one_of(_SCHEMA, JUNK), "type": TEXT}), max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["auto", "any", "tool", "none"]), TEXT)},
                                         optional={"name": st.one_of(_NAMES, TEXT), "disable_parallel_tool_use": JUNK}),
    "thinking": st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["enabled", "disabled"]), TEXT)}),
    "output_config": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.one_of(st.just("json_schema"), TEXT), "schema": st.one_of(_SCHEMA, JUNK)})}),
}
WELL_TYPED_MESSAGES = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 40), "stream": st.sampled_from([True, True, False]),
     "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _CLEAN_TEXT.filter(str.strip)}),
                          min_size=1, max_size=2)},
    optional={"system": _CLEAN_TEXT, "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1),
              "top_k": st.integers(0, 100), "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=3),
              "tools": st.lists(st.fixed_dictionaries({"name": _NAMES, "input_schema": _SCHEMA}), max_size=2,
                                unique_by=lambda tool: tool["name"]),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])})})


def check_messages_stream(body: bytes) -> None:
    """Anthropic's events in order: message_start, framed content blocks, message_delta, message_stop."""
    events = [json.loads(line[len(b"data: "):]) for line in body.splitlines() if line.startswith(b"data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_index = None
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None
            open_index = event["index"]
        else:
            assert event["type"] in ("content_block_delta", "content_block_stop"), kinds
            assert event["index"] == open_index, kinds
            open_index = None if event["type"] == "content_block_stop" else open_index
    assert open_index is None, kinds
    COUNTS["messages streams"] += 1


@_FUZZ_ROUTE
@given(body=bodies(MESSAGES_FIELDS, "messages"), ascii_only=st.booleans())
def test_fuzz_messages(client, body, ascii_only):
    send(client, "/v1/messages", encode(body, ascii_only))


@_FUZZ_ROUTE
@given(body=WELL_TYPED_MESSAGES)
def test_fuzz_well_typed_messages(client, body):
    send(client, "/v1/messages", encode(body, False))


@_FUZZ_ROUTE
@given(body=bodies(MESSAGES_FIELDS, "messages"), ascii_only=st.booleans())
def test_fuzz_count_tokens(client, body, ascii_only):
    send(client, "/v1/messages/count_tokens", encode(body, ascii_only))


# /v1/rerank, /v1/score (this model declares no pooling: refused after parsing) and /infill (no FIM tokens)
_TEXTS = st.one_of(TEXT, st.lists(TEXT, max_size=4))
RERANK_FIELDS = {"query": TEXT, "documents": st.lists(st.one_of(TEXT, st.fixed_dictionaries({"text": TEXT})),
                                                      max_size=4),
                 "model": st.one_of(st.just(MODEL), TEXT), "top_n": INTS, "return_documents": st.booleans()}
SCORE_FIELDS = {"text_1": _TEXTS, "text_2": _TEXTS, "model": st.one_of(st.just(MODEL), TEXT)}
INFILL_FIELDS = {"input_suffix": TEXT, "input_prefix": TEXT, "prompt": TEXT, "n_predict": INTS,
                 "input_extra": st.lists(st.fixed_dictionaries({"filename": TEXT, "text": TEXT}), max_size=2),
                 "temperature": FLOATS, "top_k": INTS, "stop": st.lists(TEXT, max_size=2), "stream": st.booleans()}


@_FUZZ_ROUTE
@given(case=st.one_of(bodies(RERANK_FIELDS, "documents").map(lambda b: ("/v1/rerank", b)),
                      bodies(SCORE_FIELDS, "text_1").map(lambda b: ("/v1/score", b)),
                      bodies(INFILL_FIELDS, "input_suffix").map(lambda b: ("/infill", b))),
       ascii_only=st.booleans())
def test_fuzz_rerank_score_infill(client, case, ascii_only):
    path, body = case
    send(client, path, encode(body, ascii_only))


# -- Ollama's API -----------------------------------------------------------------------------------

_OLLAMA_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)},
    optional={"content": st.one_of(st.text(max_size=60), TEXT), "tool_name": TEXT, "thinking": TEXT,
              "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                  {"name": st.one_of(_NAMES, TEXT), "arguments": st.one_of(st.just({"a": 1}), JUNK)})}), max_size=2)})
_OLLAMA_OPTIONS = st.fixed_dictionaries({}, optional={
    "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "seed": INTS, "num_predict": st.integers(-3, 40),
    "stop": st.lists(TEXT, max_size=2), "repeat_penalty": FLOATS, "num_ctx": INTS, "mirostat": INTS, "x": JUNK})
_OLLAMA_COMMON = {"model": st.sampled_from([MODEL, f"{MODEL}:latest", "other"]), "options": _OLLAMA_OPTIONS,
                  "stream": st.booleans(), "format": st.one_of(st.sampled_from(["", "json"]), _SCHEMA, JUNK),
                  "think": st.one_of(st.booleans(), TEXT), "keep_alive": st.one_of(INTS, TEXT)}
OLLAMA_CHAT_FIELDS = _OLLAMA_COMMON | {"messages": st.lists(_OLLAMA_MESSAGE, max_size=3),
                                       "tools": st.lists(_TOOL, max_size=2)}
OLLAMA_GENERATE_FIELDS = _OLLAMA_COMMON | {"prompt": st.one_of(st.text(max_size=60), TEXT), "system": TEXT,
                                           "raw": st.booleans(), "suffix": TEXT, "template": TEXT,
                                           "context": TOKEN_IDS}
OLLAMA_EMBED_FIELDS = {"model": _OLLAMA_COMMON["model"], "input": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
                       "truncate": st.booleans(), "dimensions": INTS, "options": _OLLAMA_OPTIONS}


@_FUZZ_ROUTE
@given(case=st.one_of(bodies(OLLAMA_CHAT_FIELDS, "messages").map(lambda b: ("/api/chat", b)),
                      bodies(OLLAMA_GENERATE_FIELDS, "prompt").map(lambda b: ("/api/generate", b)),
                      bodies(OLLAMA_EMBED_FIELDS, "input").map(lambda b: ("/api/embed", b))),
       ascii_only=st.booleans())
def test_fuzz_ollama(client, case, ascii_only):
    path, body = case
    send(client, path, encode(body, ascii_only))


# -- hand-written hostile requests ------------------------------------------------------------------

_BIG = "9" * 5001
_NUMERIC = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "n", "logprobs", "best_of"]
_MSG = [{"role": "user", "content": "hi"}]


def _surrogate_bodies() -> list[tuple[str, dict]]:
    s = "x\ud800y"
    completion = [{"prompt": s}, {"prompt": [s]}, {"prompt": "hi", "model": s}, {"prompt": "hi", "stop": s},
                  {"prompt": "hi", "stop": ["a", s]}, {"prompt": "hi", "user": s}, {"prompt": "hi", "suffix": s},
                  {"prompt": "hi", "logit_bias": {s: 1}}, {"prompt": "hi", s: 1}]
    chat = [{"messages": [{"role": "user", "content": s}]}, {"messages": [{"role": s, "content": "x"}]},
            {"messages": [{"role": "user", "content": "x", "name": s}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]},
            {"messages": [{"role": "user", "content": [{"type": s, "text": "x"}]}]},
            {"messages": _MSG, "model": s}, {"messages": _MSG, "stop": [s]}, {"messages": _MSG, "user": s},
            {"messages": _MSG, "response_format": {"type": s}}, {"messages": _MSG, "tool_choice": s}]
    return [("/v1/completions", b) for b in completion] + [("/v1/chat/completions", b) for b in chat]


def hostile_requests() -> list[tuple[str, bytes | None, dict | None, str]]:
    """(path, raw body, headers (None: JSON), method)."""
    cases = []
    for path, body in _surrogate_bodies():
        cases += [(path, encode(body, True), None, "POST"), (path, encode(body, False), None, "POST")]
    for field in _NUMERIC:
        cases.append(("/v1/completions", f'{{"prompt": "hi", "{field}": {_BIG}}}'.encode(), None, "POST"))
        cases.append(("/v1/completions", f'{{"prompt": "hi", "{field}": -{_BIG}.5e3}}'.encode(), None, "POST"))
    deep = [b"[" * n + b"]" * n for n in (65, 1000, 100_000)]
    cases += [("/v1/completions", b'{"prompt": ' + d + b"}", None, "POST") for d in deep]
    cases += [("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x", "name": ' + d + b"}]}",
               None, "POST") for d in deep]
    cases += [("/v1/embeddings", b'{"input": ' + d + b"}", None, "POST") for d in deep]
    cases += [("/v1/embeddings", encode(body, ascii_only), None, "POST") for ascii_only in (True, False)
              for body in ({"input": "x\ud800y"}, {"input": ["a", "x\ud800y"]}, {"input": "a", "user": "x\ud800y"})]
    cases += [("/v1/embeddings", f'{{"input": "hi", "{field}": {_BIG}}}'.encode(), None, "POST")
              for field in ("dimensions", "truncate_prompt_tokens")]
    for path, key in (("/v1/responses", "input"), ("/tokenize", "prompt"), ("/detokenize", "tokens")):
        cases += [(path, b'{"%s": ' % key.encode() + d + b"}", None, "POST") for d in deep]
    cases += [(path, encode(body, ascii_only), None, "POST") for ascii_only in (True, False) for path, body in (
        ("/v1/responses", {"input": "x\ud800y"}), ("/v1/responses", {"input": [{"role": "user", "content": "\ud800"}]}),
        ("/v1/chat/completions", {"messages": _MSG, "tools": [{"type": "function", "function": {"name": "\ud800"}}]}),
        ("/tokenize", {"prompt": "x\ud800"}), ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}))]
    cases += [("/detokenize", f'{{"tokens": [{_BIG}]}}'.encode(), None, "POST"),
              ("/v1/responses", f'{{"input": "hi", "max_output_tokens": {_BIG}}}'.encode(), None, "POST"),
              ("/v1/models/%ff%00", None, None, "GET"), ("/v1/responses/%ff", None, None, "GET"),
              ("/v1/responses/" + "x" * 5000, None, None, "GET")]
    cases += [("/v1/completions", raw, None, "POST") for raw in (
        b"", b"   ", b"not json", b"{", b"}", b"[]", b"null", b"1", b'"prompt"', b"\x00\x01\x02", b"\xff" * 10,
        b'{"prompt": "a", "prompt": [1]}', b"\xef\xbb\xbf" + b'{"prompt": "hi"}', '{"prompt": "hi"}'.encode("utf-16"),
        b'{"prompt": "hi", "max_tokens": Infinity}', b'{"prompt": "unterminated', b'{"prompt": "\\', b"[" * 50_000)]
    for content_type in ("text/plain", "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", ""):
        headers = {"Content-Type": content_type} if content_type else {}
        cases += [("/v1/completions", b'{"prompt": [5], "max_tokens": 2}', headers, "POST"),
                  ("/v1/chat/completions", b"prompt=hi&max_tokens=2", headers, "POST")]
    cases += [("/v1/completions", b"a" * (MAX_BODY + 1), None, "POST"), ("/v1/completions", None, None, "GET"),
              ("/health", b"{}", None, "POST"), ("/v1/nothing", b"{}", None, "POST"),
              ("/v1/models", b"x", None, "DELETE"), ("/v1/completions?x=%ff%00", b'{"prompt": [5]}', None, "POST")]
    return cases


def test_hand_written_hostile_requests(client):
    before = COUNTS["cases"]
    statuses = Counter(send(client, path, raw, headers, method) for path, raw, headers, method in hostile_requests())
    print(f"\nhand-written: {COUNTS['cases'] - before} cases, statuses {dict(sorted(statuses.items()))}")


# -- afterwards -------------------------------------------------------------------------------------


def test_server_is_whole_after_the_fuzz(fuzz_server, client):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 20
    while True:
        m = fuzz_server.metrics()
        idle = m["deepinfer_num_requests_running"] == 0 and m["deepinfer_num_requests_waiting"] == 0
        if idle and m["deepinfer_kv_free_blocks"] == m["deepinfer_kv_total_blocks"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m["deepinfer_kv_free_blocks"] == m["deepinfer_kv_total_blocks"] > 0
    assert client.get("/health", timeout=5).status_code == 200
    print(f"\nfuzz totals: {COUNTS['cases']} cases, 2xx {COUNTS['2xx']}, 4xx {COUNTS['4xx']}, "
          f"5xx {COUNTS['5xx']}, timeouts {COUNTS['timeouts']}, responses streams {COUNTS['responses streams']}")
    assert COUNTS["5xx"] == 0 and COUNTS["timeouts"] == 0
