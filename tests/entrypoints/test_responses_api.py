"""The Responses API (POST /v1/responses) on the tiny model with a hermes tool template, through the
official openai client: text input and instructions (the same prompt and answer as the chat
route), the streamed events (and the client's own stream helper, which checks them), function
tools and their calls, `function_call_output` with `previous_response_id` (the same prompt as
sending the whole history), the stored responses' LRU, bad requests, and an openai-agents run on
the Responses model with a function tool and a structured final output. Raw streams (text and a
function call) pass `responses_stream.check_response_stream`, which fails on broken variants of them."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from agent_models import WEATHER
from pydantic import BaseModel
from responses_stream import check_response_stream, parse_events

from deepinfer.serving.store import ResponseStore
from deepinfer.serving.tenancy import EVERYONE

pytestmark = [pytest.mark.parity]

TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
        "parameters": WEATHER["function"]["parameters"], "strict": True}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(hermes_server):
    """The tiny llama with the Hermes template, served as "tiny": the session's (tests/entrypoints/conftest.py)."""
    return hermes_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_text_input_answers_as_the_chat_route(client):
    response = client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", temperature=0,
                                       max_output_tokens=8)
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == 8
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.object == "response" and response.id.startswith("resp_") and response.instructions == "Be brief."
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"


def test_streamed_events_add_up_to_the_response(client):
    request = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                   temperature=0, max_output_tokens=10)
    events = list(client.responses.create(stream=True, **request))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == client.responses.create(**request).output_text


def test_function_calls_whole_and_streamed_then_the_result(client):
    request = dict(model="tiny", input=QUESTION, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                   temperature=0, max_output_tokens=150)
    first = client.responses.create(**request)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])

    events = list(client.responses.create(stream=True, **request))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments == call.arguments
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments
    with client.responses.stream(**request) as stream:  # the client's helper checks every event
        assert stream.get_final_response().output[0].arguments == call.arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"}
    follow = client.responses.create(model="tiny", previous_response_id=first.id, input=[result], tools=[TOOL],
                                     temperature=0, max_output_tokens=6)
    whole_history = client.responses.create(model="tiny", tools=[TOOL], temperature=0, max_output_tokens=6, input=[
        {"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result])
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == whole_history.usage.input_tokens > first.usage.input_tokens
    assert follow.output_text == whole_history.output_text
    assert client.responses.retrieve(follow.id).model_dump() == follow.model_dump()


STREAMED = [dict(model="tiny", input=QUESTION, temperature=0, max_output_tokens=10, stream=True),
            dict(model="tiny", input=QUESTION, tools=[TOOL], tool_choice="required", temperature=0,
                 max_output_tokens=150, stream=True)]


@pytest.mark.parametrize("request_body", STREAMED, ids=["text", "function_call"])
def test_raw_streams_pass_the_stream_check(server, request_body):
    """A text answer and a function call, read as raw SSE: well-formed, numbered, in order, no `[DONE]`."""
    raw = server.client.post("/v1/responses", json=request_body)
    assert raw.status_code == 200 and b"[DONE]" not in raw.content
    events = check_response_stream(raw.content)
    item_types = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert set(item_types) == {"function_call" if "tools" in request_body else "message"}


def _sse(events: list[dict]) -> bytes:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def _renumbered(events: list[dict]) -> list[dict]:
    return [{**e, "sequence_number": i} for i, e in enumerate(events)]


def _broken_streams(events: list[dict]) -> dict[str, bytes]:
    """Variants of a good stream that a client must not accept."""
    delta = next(i for i, e in enumerate(events) if e["type"].endswith(".delta"))
    done = next(i for i, e in enumerate(events) if e["type"] == "response.output_item.done")
    changed = [*events[:delta], {**events[delta], "delta": events[delta]["delta"] + "x"}, *events[delta + 1:]]
    late = _renumbered([*events[:delta], *events[delta + 1:done + 1], events[delta], *events[done + 1:]])
    final = events[-1]
    return {
        "chat's [DONE] after it": _sse(events) + b"data: [DONE]\n\n",
        "no terminal event": _sse(events[:-1]),
        "two events swapped": _sse([*events[:3], events[4], events[3], *events[5:]]),
        "numbered from 1": _sse([{**e, "sequence_number": e["sequence_number"] + 1} for e in events]),
        "an error event": _sse(_renumbered([*events[:-1], {"type": "error", "message": "x"}, final])),
        "a changed delta": _sse(changed),
        "a delta after its item is done": _sse(late),
        "an item missing from the response": _sse([*events[:-1], {
            **final, "response": {**final["response"], "output": []}}]),
        "a name unlike the data's type": _sse(events).replace(b"event: response.created", b"event: created", 1),
        "a terminal event before the last": _sse(_renumbered([*events[:-1], final, final])),
    }


@pytest.mark.parametrize("request_body", STREAMED, ids=["text", "function_call"])
def test_the_stream_check_refuses_broken_streams(server, request_body):
    """Each broken variant of a good raw stream fails the check: it is not a check that cannot fail."""
    events = parse_events(server.client.post("/v1/responses", json=request_body).content)
    for name, raw in _broken_streams(events).items():
        with pytest.raises(AssertionError):
            check_response_stream(raw)
            pytest.fail(f"accepted a stream with {name}")


def test_unknown_or_unstored_previous_responses(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_nope")
    assert info.value.body["code"] == "previous_response_not_found" and info.value.body["param"] == \
        "previous_response_id"
    unstored = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    assert server.client.get(f"/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="hi", previous_response_id=unstored.id)


def test_a_json_schema_output(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response = client.responses.create(model="tiny", input="A digit?", temperature=1.0, max_output_tokens=30,
                                       text={"format": {"type": "json_schema", "name": "d", "schema": schema}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_a_seed_repeats_the_sample_the_chat_route_draws(client):
    """`seed` (in extra_body) is the chat route's: the same seed, the same tokens, at temperature 1."""
    def sample(seed: int) -> str:
        return client.responses.create(model="tiny", input=QUESTION, temperature=1.0, max_output_tokens=12,
                                       store=False, extra_body={"seed": seed}).output_text

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=1.0, max_tokens=12, seed=5).choices[0].message.content
    assert sample(5) == sample(5) == chat
    assert len({sample(seed) for seed in range(4)}) > 1  # the seed is read: other seeds, other samples


def test_the_store_is_an_lru_bounded_in_count_and_characters():
    store = ResponseStore(max_responses=3, max_chars=380)  # a small entry: ~50 characters, the big one ~350
    for i in range(4):
        store.put(EVERYONE, {"id": f"r{i}"}, [{"role": "user", "content": "x"}], [])
    assert store.get(EVERYONE, "r0") is None and store.get(EVERYONE, "r1") is not None
    store.put(EVERYONE, {"id": "r4"}, [], [])  # r2, the least recently used, goes
    assert store.get(EVERYONE, "r2") is None and store.get(EVERYONE, "r1") is not None
    store.put(EVERYONE, {"id": "big"}, [{"role": "user", "content": "y" * 300}], [])
    assert store.get(EVERYONE, "big") is not None
    assert store.get(EVERYONE, "r3") is None and store.get(EVERYONE, "r1") is None


BAD = [  # (body fields, param)
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nothing"}}}}, "text"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "seed": 2**64}, "seed"),
    ({"input": "x", "seed": 1.5}, "seed"),
    ({"input": "x", "max_output_tokens": 10**6}, "input"),  # context_length_exceeded, as the chat route names it
    ({"input": "x", "frequency": 1}, "frequency"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_name_the_field(server, body, param):
    resp = server.client.post("/v1/responses", json=body)
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


class Forecast(BaseModel):
    sunny: bool


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_run_on_the_responses_model(server, streamed):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"22 degrees in {city}"

    client = AsyncOpenAI(base_url=f"{server.listen()}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool's help.", tools=[get_weather],
                  output_type=Forecast, model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120))
    config = RunConfig(tracing_disabled=True)
    if streamed:
        async def run():
            result = Runner.run_streamed(agent, QUESTION, max_turns=4, run_config=config)
            async for _ in result.stream_events():  # our SSE events, read by the SDK
                pass
            return result

        result = asyncio.run(run())
    else:
        result = Runner.run_sync(agent, QUESTION, max_turns=4, run_config=config)
    assert calls in (["Paris"], ["Rome"]) and isinstance(result.final_output, Forecast)
