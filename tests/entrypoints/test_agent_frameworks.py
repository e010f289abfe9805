"""Agent frameworks against `deepinfer serve` (AppServer on a real 127.0.0.1 port) on a tiny random
model whose Hermes/Qwen chat template writes calls as `<tool_call>...</tool_call>`, each tag ONE
special token of the tokenizer (as in Qwen's files): an openai-agents `Agent` and a LangGraph
ReAct agent (`create_react_agent` over `langchain_openai.ChatOpenAI`), each with two tools, and
forced `tool_use` blocks through `/v1/messages` with the official `anthropic` client.

What is real and what is forced. A random model writes gibberish, so:
- The first turn's call is forced by the framework's own request field: openai-agents sends
  `tool_choice` "required" or a tool's name from `ModelSettings`; the LangGraph agent's model binds
  its tools with `tool_choice` "required". The server turns that into a grammar over the tag's
  token id; the model picks which tool and what arguments within it. Real: the framework parses
  our `tool_calls`, validates the arguments against its own schema and runs the tool (a counter
  records each run); its result depends on the arguments the model chose.
- The framework sends the result back (checked in the request bodies the client sent: a `tool`
  message with the result, `tool_choice` no longer forced) and our server answers the second turn.
  That answer's text is forced: a test hook turns the tool's returned string into a one-choice
  grammar (`structured_outputs.choice`, a DeepInfer field sent as `extra_body`) for the second
  request - openai-agents through a `RunHooks.on_tool_end`, LangGraph through its dynamic-model
  callable, which reads the ToolMessage from the graph state. So the final answer contains the
  tool's result because the harness forced the model to quote it; the route from the tool's output
  through the framework, the server and back into the framework's final answer is real.
- The Messages API part forces calls (`tool_choice` any / tool) with several seeded random input
  schemas; the arguments are the model's, and must pass jsonschema, whole and streamed.
- Last, the tool shape the `llm` CLI sends (`"description": null`) is accepted as no description.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from typing import Annotated, Literal

import anthropic
import httpx
import jsonschema
import pytest
from agent_models import HERMES, random_schema, templated_checkpoint
from app_server import AppServer
from pydantic import Field

TAGS = ("<tool_call>", "</tool_call>")
QUESTION = "What is the weather in Paris?"


def _quote(result: str) -> str:
    return f"Tool result: {result}"


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tokenizer_dir, tmp_path_factory):
    """The tiny Llama with a Hermes template and `<tool_call>`/`</tool_call>` as special tokens."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path = templated_checkpoint(tiny_checkpoint("llama", vocab_size=49216), str(tmp_path_factory.mktemp("tags")),
                                HERMES)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in TAGS], special_tokens=True)
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 1 for t in TAGS)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:  # save_pretrained wrote the old one
        f.write(HERMES)
    with AppServer("--model", path, "--served-model-name", "tiny") as app:
        app.listen()
        yield app


def _recorder(bodies: list[dict]):
    def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            bodies.append(json.loads(request.content))
    return record


def _async(hook):
    async def call(request: httpx.Request) -> None:
        hook(request)
    return call


def _second_turn_was_sent_the_result(bodies: list[dict], result: str) -> None:
    """The first request forced a call; the second carried the tool's result and forced none."""
    first, second = bodies
    assert first["tool_choice"] != "auto" and len(first["tools"]) == 2
    assert second.get("tool_choice", "auto") == "auto" and len(second["tools"]) == 2
    (tool_message,) = [m for m in second["messages"] if m["role"] == "tool"]
    assert tool_message["content"] == result
    assert second["structured_outputs"] == {"choice": [_quote(result)]}


# -- openai-agents ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice,streamed", [("required", False), ("add", True)])
def test_openai_agents_two_tools_call_one_and_quote_its_result(server, tool_choice, streamed):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        RunHooks,
        Runner,
        function_tool,
    )
    from openai import AsyncOpenAI

    ran: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        ran.append(("get_weather", result := f"42-degrees-XYZ-{city}-{unit}"))
        return result

    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> str:
        """a + b."""
        ran.append(("add", result := f"sum-{a + b}-QRS"))
        return result

    extra_body: dict = {}  # the second turn's forced answer goes in here

    class QuoteTheResult(RunHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            extra_body["structured_outputs"] = {"choice": [_quote(str(result))]}

    bodies: list[dict] = []

    def make_agent(http: httpx.AsyncClient) -> Agent:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http)
        return Agent(name="weather", instructions="Answer with the tools' help.", tools=[get_weather, add],
                     model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                     model_settings=ModelSettings(tool_choice=tool_choice, parallel_tool_calls=False, temperature=0,
                                                  max_tokens=160, extra_body=extra_body))

    config = RunConfig(tracing_disabled=True)

    async def run():
        async with httpx.AsyncClient(event_hooks={"request": [_async(_recorder(bodies))]}, timeout=120) as http:
            agent, hooks = make_agent(http), QuoteTheResult()
            if not streamed:
                return await Runner.run(agent, QUESTION, max_turns=4, run_config=config, hooks=hooks)
            result = Runner.run_streamed(agent, QUESTION, max_turns=4, run_config=config, hooks=hooks)
            async for _ in result.stream_events():  # our streamed tool-call deltas, read by the SDK
                pass
            return result

    result = asyncio.run(run())
    (name, tool_result), = ran  # exactly one tool ran, once
    if tool_choice != "required":
        assert name == tool_choice
    assert result.final_output == _quote(tool_result)
    _second_turn_was_sent_the_result(bodies, tool_result)
    assert bodies[0]["tool_choice"] == (
        "required" if tool_choice == "required" else {"type": "function", "function": {"name": tool_choice}})


# -- LangGraph --------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # still langgraph.prebuilt's in 1.x
def test_langgraph_react_agent_two_tools_call_one_and_quote_its_result(server):
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    ran: list[tuple[str, str]] = []

    @tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        ran.append(("get_weather", result := f"42-degrees-XYZ-{city}-{unit}"))
        return result

    @tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> str:
        """a + b."""
        ran.append(("add", result := f"sum-{a + b}-QRS"))
        return result

    tools = [get_weather, add]
    bodies: list[dict] = []
    with httpx.Client(event_hooks={"request": [_recorder(bodies)]}, timeout=120) as http:
        llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=160,
                         max_retries=0, http_client=http)

        def model(state, runtime):
            """LangGraph's dynamic model: force a call first; after a tool ran, force quoting its result."""
            last = state["messages"][-1]
            if isinstance(last, ToolMessage):
                return llm.bind_tools(tools, parallel_tool_calls=False).bind(
                    extra_body={"structured_outputs": {"choice": [_quote(last.content)]}})
            return llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)

        agent = create_react_agent(model, tools)
        state = agent.invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 6})
    (name, tool_result), = ran
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    call_message, final = state["messages"][1], state["messages"][-1]
    assert [c["name"] for c in call_message.tool_calls] == [name]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert final.content == _quote(tool_result)
    _second_turn_was_sent_the_result(bodies, tool_result)
    assert bodies[0]["tool_choice"] == "required"


# -- /v1/messages with the anthropic client ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_messages_forced_tool_use_over_random_schemas(server, seed):
    """Two tools of seeded random input schemas; `any` and a named tool, whole and streamed."""
    rng = random.Random(3900 + seed)
    tools = [{"name": f"fn_{i}", "description": f"function {i}", "input_schema": random_schema(rng)}
             for i in range(2)]
    schemas = {t["name"]: t["input_schema"] for t in tools}
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    named = tools[seed % 2]["name"]
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": named}):
        request = dict(model="tiny", max_tokens=400, messages=[{"role": "user", "content": QUESTION}], tools=tools,
                       tool_choice=choice, extra_body={"temperature": 0})
        message = client.messages.create(**request)
        (block,) = message.content
        assert block.type == "tool_use" and block.id and message.stop_reason == "tool_use"
        assert block.name == named if choice["type"] == "tool" else block.name in schemas
        jsonschema.validate(block.input, schemas[block.name])

        with client.messages.stream(**request) as stream:
            events = list(stream)
            final = stream.get_final_message()
        starts = [e.content_block for e in events if e.type == "content_block_start"]
        assert [s.type for s in starts] == ["tool_use"] and final.stop_reason == "tool_use"
        partial = "".join(e.delta.partial_json for e in events
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        (streamed,) = final.content
        assert (streamed.name, streamed.input) == (starts[0].name, json.loads(partial))
        assert streamed.name == named if choice["type"] == "tool" else streamed.name in schemas
        jsonschema.validate(streamed.input, schemas[streamed.name])


# -- the `llm` CLI's tool shape ----------------------------------------------------------------------


def test_null_description_and_strict_are_absent_but_other_types_are_refused(server):
    """`llm --functions` sends `"description": null` for a function without a docstring (vLLM's fields
    are Optional too): a call is made; a description or strict of another type is still a 400."""
    def tool(**fields) -> dict:
        return {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"], "additionalProperties": False}, **fields}}

    request = {"model": "tiny", "messages": [{"role": "user", "content": "2 + 3?"}], "tool_choice": "required",
               "max_tokens": 40, "temperature": 0}
    answer = server.client.post("/v1/chat/completions", json={**request, "tools": [
        tool(description=None, strict=None)]})
    assert answer.status_code == 200, answer.text  # main: a 400, "description must be a string"
    (call,) = answer.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool()["function"]["parameters"])
    for fields in ({"description": 7}, {"strict": "yes"}, {"description": ["a"]}):
        refused = server.client.post("/v1/chat/completions", json={**request, "tools": [tool(**fields)]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", (fields, refused.text)
