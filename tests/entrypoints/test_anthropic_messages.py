"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client, on the tiny random model with a hermes tool template (and one with a reasoning
template and --reasoning-parser): a plain answer (the same prompt and greedy text as the chat
route), system blocks and several turns, stop_sequences, the streamed events in Anthropic's order
(adding up to the whole answer, also through the client's own stream helper), a forced tool_use and
the follow-up with its tool_result, thinking blocks, count_tokens, a JSON schema output
(output_config.format, ending the turn), bad requests (400s in Anthropic's error shape naming the
field), an unknown model (404), API keys as x-api-key or Bearer, errors raised outside the routes
(429, 413), and the stream formatter on hand-written answers.

A random model writes gibberish, so tool calls come from forcing them (tool_choice any / tool)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from agent_models import HERMES, REASONING, WEATHER, templated_checkpoint
from app_server import AppServer

from deepinfer.entrypoints.openai.messages_output import MessageContext, MessageEvents, stop_reason
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.serving.chat.output import ChatOutputPlan
from deepinfer.serving.chat.reasoning import make_reasoning_parser
from deepinfer.serving.chat.tool_parsers import TOOL_PARSERS

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
QUESTION = "What is the weather in Paris?"
USER = [{"role": "user", "content": QUESTION}]
KEY = "sk-test-key"
# sampling fields the newest client no longer declares (older ones and raw HTTP send them)
GREEDY = {"temperature": 0}


def _client(server: AppServer, **kwargs) -> anthropic.Anthropic:
    """The official client over a real connection (it brings an HTTP stack of its own)."""
    kwargs.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.listen(), max_retries=0, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def server(hermes_server):
    """The tiny llama with the Hermes template, served as "tiny": the session's (tests/entrypoints/conftest.py)."""
    return hermes_server


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def _prompt_tokens(server: AppServer, messages: list[dict], **extra) -> int:
    """The chat route's prompt token count for the same conversation."""
    chat = server.openai().chat.completions.create(model="tiny", messages=messages, max_tokens=1, **extra)
    return chat.usage.prompt_tokens


def _input_tokens(message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_a_plain_message_answers_as_the_chat_route(server, client):
    message = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, system="Be brief.", messages=USER)
    chat = server.openai().chat.completions.create(model="tiny", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, *USER])
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert _input_tokens(message) == chat.usage.prompt_tokens and message.usage.output_tokens == 8
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "tiny"


def test_system_blocks_and_several_turns(server, client):
    turns = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Sunny"}, {"type": "text",
                                                                                          "text": "and warm."}]},
             {"role": "user", "content": [{"type": "text", "text": "And in Rome?"}]}]
    system = [{"type": "text", "text": "You know the weather."}, {"type": "text", "text": "Be brief."}]
    message = client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, system=system, messages=turns,
                                     metadata={"user_id": "u-1"})
    same = [{"role": "system", "content": "You know the weather.\nBe brief."}, USER[0],
            {"role": "assistant", "content": "Sunny\nand warm."}, {"role": "user", "content": "And in Rome?"}]
    chat = server.openai().chat.completions.create(model="tiny", temperature=0, max_tokens=6, messages=same)
    assert message.content[0].text == chat.choices[0].message.content
    assert _input_tokens(message) == chat.usage.prompt_tokens > _prompt_tokens(server, USER)


def test_stop_sequences(client):
    request = dict(model="tiny", max_tokens=12, extra_body=GREEDY, messages=USER)
    text = client.messages.create(**request).content[0].text
    stop = text[3:6]
    assert stop.strip() and text.find(stop) == 3, text  # a stop string that first occurs at 3
    message = client.messages.create(stop_sequences=["NEVER-WRITTEN", stop], **request)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[:3]


def test_streamed_events_come_in_order_and_add_up(client):
    request = dict(model="tiny", max_tokens=10, extra_body=GREEDY, messages=USER)
    whole = client.messages.create(**request)
    events = list(client.messages.create(stream=True, **request))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert all(e.delta.type == "text_delta" and e.index == 0 for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10
    with client.messages.stream(**request) as stream:  # the client's helper accumulates the events
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", whole.content[0].text)]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10 and _input_tokens(final) == _input_tokens(whole)


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_use_whole_and_streamed(client, choice):
    request = dict(model="tiny", max_tokens=150, extra_body=GREEDY, messages=USER, tools=[TOOL], tool_choice=choice)
    message = client.messages.create(**request)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    assert message.stop_reason == "tool_use"
    jsonschema.validate(block.input, TOOL["input_schema"])

    events = list(client.messages.create(stream=True, **request))
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == block.input
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**request) as stream:
        (final,) = stream.get_final_message().content
    assert final.type == "tool_use" and final.input == block.input


def test_a_tool_result_follow_up(server, client):
    first = client.messages.create(model="tiny", max_tokens=150, extra_body=GREEDY, messages=USER, tools=[TOOL],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (call,) = first.content
    turns = [*USER, {"role": "assistant", "content": first.content},  # the client's own blocks, sent back
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": [{"type": "text", "text": "22 degrees"}]}]}]
    follow = client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, messages=turns, tools=[TOOL])
    same = [*USER, {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"}]
    chat = server.openai().chat.completions.create(model="tiny", temperature=0, max_tokens=6, messages=same,
                                                   tools=[WEATHER])
    assert _input_tokens(follow) == chat.usage.prompt_tokens > _input_tokens(first)
    assert follow.content[0].text == chat.choices[0].message.content
    counted = client.messages.count_tokens(model="tiny", messages=turns, tools=[TOOL])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_count_tokens_is_the_prompt_of_the_same_messages(server, client):
    system = "Be brief."
    counted = client.messages.count_tokens(model="tiny", system=system, messages=USER)
    message = client.messages.create(model="tiny", max_tokens=1, system=system, messages=USER)
    assert counted.input_tokens == _input_tokens(message) == _prompt_tokens(
        server, [{"role": "system", "content": system}, *USER])
    with_tools = client.messages.count_tokens(model="tiny", messages=USER, tools=[TOOL])
    assert with_tools.input_tokens == _prompt_tokens(server, USER, tools=[WEATHER]) > counted.input_tokens


def test_a_json_schema_output(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    message = client.messages.create(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "A digit?"}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     extra_body={"temperature": 1.0})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


BAD = [  # (body fields, what the message must name)
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [
        {"type": "image"}]}]}]}, "messages[0].content[0].content[0]"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                            "input": "x"}]}, *USER]}, "messages[1].content[0].input"),
    ({"messages": [*USER, {"role": "assistant", "content": "Sure"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "name"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{**TOOL, "name": "a b"}]}, "tools[0].name"),
    ({"tools": [{**TOOL, "input_schema": "x"}]}, "tools[0].input_schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"frequency": 1}, "frequency"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nothing"}}}}, "output_config"),
    ({"max_tokens": 10**6}, "messages"),  # context_length_exceeded, as the chat route names it
]


def _body(fields: dict) -> dict:
    body = {"model": "tiny", "max_tokens": 4, "messages": USER, **fields}
    return {key: value for key, value in body.items() if value is not None}


@pytest.mark.parametrize("fields,named", BAD, ids=[f"{named}-{i}" for i, (_, named) in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_field(server, fields, named):
    resp = server.client.post("/v1/messages", json=_body(fields))
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and named in body["error"]["message"], body


def test_bad_requests_through_the_client(client, server):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "critic", "content": "x"}])
    assert info.value.body["error"]["type"] == "invalid_request_error" and "role" in info.value.message
    resp = server.client.post("/v1/messages/count_tokens", json={"model": "tiny"})
    assert resp.status_code == 400 and "messages" in resp.json()["error"]["message"]
    resp = server.client.post("/v1/messages", content=b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(client, server):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert info.value.status_code == 404 and info.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in info.value.body["error"]["message"]
    resp = server.client.post("/v1/messages/count_tokens", json={"model": "claude-nope", "messages": USER})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


@pytest.mark.slow
def test_api_keys_as_x_api_key_or_bearer(tiny_checkpoint, tmp_path):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path / "keyed"), HERMES)
    with AppServer("--model", path, "--served-model-name", "tiny", api_key=KEY) as keyed:
        request = dict(model="tiny", max_tokens=2, messages=USER)
        assert _client(keyed, api_key=KEY).messages.create(**request).usage.output_tokens == 2  # x-api-key
        assert _client(keyed, api_key=None, auth_token=KEY).messages.count_tokens(model="tiny", messages=USER)
        with pytest.raises(anthropic.AuthenticationError) as info:
            _client(keyed, api_key="wrong").messages.create(**request)
        assert info.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                               "message": "x-api-key: invalid API key"}}
        resp = keyed.client.post("/v1/messages", json=_body({}))
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert keyed.client.post("/v1/chat/completions", headers={"x-api-key": KEY}, json={
            "messages": USER}).status_code == 401  # the OpenAI routes keep their Bearer check


def test_errors_from_outside_the_routes_take_anthropics_shape():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from deepinfer.entrypoints.openai.body import BodySizeLimit
    from deepinfer.entrypoints.openai.errors import install_error_handlers
    from deepinfer.serving.errors import too_busy

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/messages")
    @app.post("/v1/chat/completions")
    async def busy():
        raise too_busy("the server is busy", 1)

    app.add_middleware(BodySizeLimit, max_bytes=100)
    with TestClient(app) as test:
        resp = test.post("/v1/messages", json={})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert resp.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": "the server is busy"}}
        resp = test.post("/v1/messages", content=b"x" * 200)
        assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"
        assert test.post("/v1/chat/completions", json={}).json()["error"]["code"] == "queue_full"  # untouched


# -- thinking ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reasoning_server(tiny_checkpoint, tmp_path_factory):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("r1")), REASONING)
    with AppServer("--model", path, "--served-model-name", "tiny", "--reasoning-parser", "deepseek_r1") as app:
        yield app


@pytest.mark.slow
def test_an_unfinished_reasoning_section_is_a_thinking_block(reasoning_server):
    client = _client(reasoning_server)
    request = dict(model="tiny", max_tokens=12, extra_body=GREEDY, messages=USER, thinking={
        "type": "enabled", "budget_tokens": 1024})
    message = client.messages.create(**request)
    chat = reasoning_server.openai().chat.completions.create(model="tiny", temperature=0, max_tokens=12,
                                                             messages=USER).choices[0].message
    (block,) = message.content
    assert block.type == "thinking" and block.thinking == chat.reasoning_content and block.signature == ""
    events = list(client.messages.create(stream=True, **request))
    assert events[1].content_block.type == "thinking"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta") == block.thinking
    with client.messages.stream(**request) as stream:
        assert stream.get_final_message().content == message.content


def _output(delta: str, finish_reason: str | None = None, stop: str | int | None = None) -> RequestOutput:
    c = CompletionOutput(0, delta_text=delta, token_ids=[1], finish_reason=finish_reason, stop_reason=stop)
    return RequestOutput("r", None, [1, 2, 3], [c], finished=finish_reason is not None, num_cached_tokens=2)


def _events(plan: ChatOutputPlan, pieces: list[str], finish_reason: str = "stop") -> list[dict]:
    events = MessageEvents(MessageContext("msg_1", "tiny", 3), plan.stream())
    out = events.start()
    for i, piece in enumerate(pieces):
        last = _output(piece, finish_reason if i == len(pieces) - 1 else None)
        out += events.step(last)
    return out


def _blocks(events: list[dict]) -> list[tuple[str, str]]:
    """(block type, its deltas joined) per block, checking each block's start/stop framing."""
    blocks, index = [], -1
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            index += 1
            assert event["index"] == index
            blocks.append([event["content_block"]["type"], ""])
        elif event["type"] == "content_block_delta":
            assert event["index"] == index
            blocks[-1][1] += next(v for k, v in event["delta"].items() if k != "type")
        else:
            assert event == {"type": "content_block_stop", "index": index}
    return [tuple(b) for b in blocks]


def test_the_stream_formatter_on_a_reasoning_answer_with_a_call():
    plan = ChatOutputPlan(TOOL_PARSERS["hermes"](), make_reasoning_parser("deepseek_r1"), inside=True)
    text = 'Let me think.\n</think>\n\nChecking.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    events = _events(plan, list(text))
    assert events[0]["type"] == "message_start" and events[0]["message"]["usage"]["input_tokens"] == 3
    assert _blocks(events) == [("thinking", "Let me think.\n"), ("text", "Checking."), ("tool_use", '{"x": 1}')]
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                          "usage": {"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 0,
                                    "cache_read_input_tokens": 2}}
    assert events[-1] == {"type": "message_stop"}
    whole = MessageContext("msg_1", "tiny", 3).message(plan.parse(text), _output(text, "stop"))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][2]["input"] == {"x": 1} and whole["content"][0]["signature"] == ""


def test_the_stream_formatter_leaves_out_blank_text_and_sends_one_empty_block():
    plan = ChatOutputPlan(reasoning=make_reasoning_parser("deepseek_r1"), inside=True)
    assert _blocks(_events(plan, ["plan", "</think>", "\n\n", "Yes", " no"])) == [("thinking", "plan"),
                                                                                ("text", "Yes no")]
    assert _blocks(_events(ChatOutputPlan(), ["  ", "\n"])) == [("text", "")]


@pytest.mark.parametrize("finish_reason,stop,calls,expected", [
    ("length", None, 1, ("max_tokens", None)), ("stop", 2, 1, ("tool_use", None)),
    ("stop", "END", 0, ("stop_sequence", "END")), ("stop", 2, 0, ("end_turn", None)),
    ("stop", None, 0, ("end_turn", None))])
def test_stop_reasons(finish_reason, stop, calls, expected):
    assert stop_reason(CompletionOutput(0, finish_reason=finish_reason, stop_reason=stop), calls) == expected
