"""Hostile bodies on every POST route of an in-process server (HTTP only; the routes and their
fields are tabled in hostile_routes.py). The server parses tool calls (hermes) and reasoning
(deepseek_r1) and pools embeddings (--pooling mean), so the tools, thinking and embedding paths
are reached.

Every hostile body is a 4xx (never a 5xx) in the route's API error shape (OpenAI's, Anthropic's
on /v1/messages*, Ollama's on /api/*) whose message names the field:

- a 7.5 MB wrong-typed list in the route's main field (1.5 million nulls; 1.5 million `{}` as chat
  messages). Its cost is counted, not timed: the CPU time of the whole process (every thread of
  the server) for the hostile body is at most COST_FACTOR times that of a same-run baseline, the
  same bytes under a field the route does not know (refused as unknown), so that refusing it costs
  what reading it costs. Meanwhile another client's streamed completion finishes within its own
  tokens plus SLACK_STEPS engine steps of its admission, with all its tokens, and a /health sent
  after the hostile body is answered before it;
- a value nested 100,000 deep (arrays, objects) in the main field;
- Infinity, -Infinity, NaN and 1e400 in each number field;
- a list or an object ([], ["x"], {}, {"a": 1}) in each enum-like field;

and /api/chat with a 946 KB history of tool calls and their replies costs at most TOOL_COST_FACTOR
times the CPU time of a same-size history of plain user messages. After every test nothing runs,
every KV block is free and the server answers a normal request.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import pytest
from agent_models import HERMES, templated_checkpoint
from app_server import AppServer
from hostile_routes import MODEL, NON_FINITE, ROUTE, ROUTES, body_with, case_id, raw_with, refusal_problem
from server_probe import HANG_S, JSON, StepLog, async_client, check_whole

NUM_ITEMS = 1_500_000  # 7.5 MB of `null,`
DEPTH = 100_000
COST_FACTOR = 5
TOOL_COST_FACTOR = 5
TOOL_BODY_BYTES = 946_000
OTHER_TOKENS = 16
SLACK_STEPS = 2
OTHER = {"prompt": "Once upon a time", "max_tokens": OTHER_TOKENS, "ignore_eos": True, "temperature": 0,
         "stream": True, "stream_options": {"include_usage": True}}
UNKNOWN_FIELD = "x_padding_field"
LIST_CASES = [(route.path, route.main, "null") for route in ROUTES] + [("/v1/chat/completions", "messages", "{}")]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("hostile")), HERMES)
    with AppServer("--model", path, "--served-model-name", MODEL, "--tool-call-parser", "hermes",
                   "--reasoning-parser", "deepseek_r1", "--pooling", "mean", "--max-model-len", "512",
                   "--max-num-seqs", "8") as server:
        yield server


@pytest.fixture(autouse=True)
def whole_afterwards(server):
    yield
    check_whole(server)


def _list_text(element: str) -> str:
    return "[" + ",".join([element] * NUM_ITEMS) + "]"


def _list_bodies(path: str, field: str, element: str) -> tuple[bytes, bytes]:
    """(hostile, baseline): the list in `field`; the same list under a field the route does not know."""
    route, items = ROUTE[path], _list_text(element)
    return raw_with(route, (field,), items), raw_with(route, (UNKNOWN_FIELD,), items)


async def _cpu(client, path: str, raw: bytes):
    """The answer, and the CPU time the process (all its threads) spent until it came."""
    start = time.process_time()
    resp = await client.post(path, content=raw, headers=JSON)
    return resp, time.process_time() - start


def _ids(cases) -> list[str]:
    return [f"{path}-{field}-{element}" for path, field, element in cases]


@pytest.mark.parametrize(("path", "field", "element"), LIST_CASES, ids=_ids(LIST_CASES))
def test_a_7_5_mb_wrong_typed_list_costs_what_reading_it_costs(server, path, field, element):
    hostile, baseline = _list_bodies(path, field, element)
    assert 4_000_000 < len(hostile) < 8_000_000 and abs(len(hostile) - len(baseline)) < 100

    async def scenario():
        async with async_client(server) as client:
            await _cpu(client, path, baseline)  # warm-up
            baselines = [await _cpu(client, path, baseline) for _ in range(3)]
            return await _cpu(client, path, hostile), baselines

    (resp, cost), baselines = server.call(scenario(), HANG_S)
    base_cost = statistics.median(cost for _, cost in baselines)
    print(f"\n{path} {field}: {len(hostile)} bytes, CPU {cost:.3f} s; baseline {base_cost:.3f} s")
    assert refusal_problem(path, resp, (field,)) is None, refusal_problem(path, resp, (field,))
    assert all(base.status_code < 500 for base, _ in baselines), baselines[0][0].text[:300]
    assert cost <= COST_FACTOR * base_cost, (
        f"{path}: refusing {len(hostile)} bytes of wrong-typed {field} cost {cost:.3f} s of CPU, "
        f"over {COST_FACTOR}x the {base_cost:.3f} s of the same bytes in an unknown field")


@pytest.mark.parametrize(("path", "field", "element"), LIST_CASES, ids=_ids(LIST_CASES))
def test_a_7_5_mb_wrong_typed_list_stalls_nobody(server, monkeypatch, path, field, element):
    hostile, _ = _list_bodies(path, field, element)
    log = StepLog(server.llm.engine, monkeypatch)

    async def noted(order: list[str], label: str, request):
        resp = await request
        order.append(label)
        return resp

    async def scenario():
        order: list[str] = []
        async with async_client(server, "10.0.0.1") as attacker, async_client(server, "10.0.0.2") as other, \
                async_client(server, "10.0.0.3") as watcher:
            sent = asyncio.create_task(noted(order, "hostile", attacker.post(path, content=hostile, headers=JSON)))
            await asyncio.sleep(0)  # the hostile body goes in first
            health = asyncio.create_task(noted(order, "health", watcher.get("/health")))
            stream = asyncio.create_task(noted(order, "other", other.post("/v1/completions", json=OTHER)))
            return await sent, await health, await stream, order

    resp, health, stream, order = server.call(scenario(), HANG_S)
    assert refusal_problem(path, resp, (field,)) is None, refusal_problem(path, resp, (field,))
    assert health.status_code == 200, health.text
    assert order.index("health") < order.index("hostile"), f"/health was answered after the hostile body: {order}"
    assert stream.status_code == 200, stream.text[:300]
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == OTHER_TOKENS, chunks[-1]
    steps = log.steps_to_finish(chunks[0]["id"])
    assert steps <= OTHER_TOKENS + SLACK_STEPS, (
        f"another client's {OTHER_TOKENS}-token completion took {steps} engine steps from its admission")


DEEP = {"arrays": "[" * DEPTH + "]" * DEPTH, "objects": '{"a":' * DEPTH + "1" + "}" * DEPTH}


@pytest.mark.parametrize("path", [route.path for route in ROUTES])
def test_a_value_nested_100_000_deep_is_a_4xx_naming_its_field(server, path):
    route = ROUTE[path]
    problems = []
    for kind, text in DEEP.items():
        resp = server.client.post(path, content=raw_with(route, (route.main,), text), headers=JSON)
        problem = refusal_problem(path, resp, (route.main,))
        if problem:
            problems.append(f"{route.main} = 100,000-deep {kind}: {problem}")
    assert not problems, "\n".join(problems)


NUMBER_CASES = [(route.path, number) for route in ROUTES for number in route.numbers]


@pytest.mark.parametrize(("path", "number"), NUMBER_CASES,
                         ids=[f"{path}-{case_id(number)}" for path, number in NUMBER_CASES])
def test_a_non_finite_number_is_a_4xx_naming_its_field(server, path, number):
    problems = []
    for literal in NON_FINITE:
        resp = server.client.post(path, content=raw_with(ROUTE[path], number, literal), headers=JSON)
        problem = refusal_problem(path, resp, number)
        if problem:
            problems.append(f"{case_id(number)} = {literal}: {problem}")
    assert not problems, "\n".join(problems)


ENUM_CASES = [(route.path, enum) for route in ROUTES for enum in route.enums]


@pytest.mark.parametrize(("path", "enum"), ENUM_CASES, ids=[f"{path}-{case_id(e.path)}" for path, e in ENUM_CASES])
def test_a_list_or_object_in_an_enum_like_field_is_a_4xx_naming_it(server, path, enum):
    problems = []
    for value in enum.values:
        body = body_with(ROUTE[path], enum.path, value, enum.context)
        resp = server.client.post(path, json=body)
        problem = refusal_problem(path, resp, enum.path)
        if problem:
            problems.append(f"{case_id(enum.path)} = {json.dumps(value)}: {problem}")
    assert not problems, "\n".join(problems)


def _tool_history(num_calls: int) -> list[dict]:
    """One assistant message calling f0..f{n-1}, then their replies, the last call's first: each
    reply answers the call at the end of the unanswered ones."""
    calls = [{"function": {"name": f"f{i}", "arguments": {}}} for i in range(num_calls)]
    replies = [{"role": "tool", "content": "r", "tool_name": f"f{i}"} for i in reversed(range(num_calls))]
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}, *replies]


def _plain_history(num_messages: int, num_bytes: int) -> list[dict]:
    """`num_messages` user messages whose JSON is about `num_bytes` long."""
    width = max(1, (num_bytes - num_messages * len('{"role":"user","content":""},')) // num_messages)
    return [{"role": "user", "content": "x" * width}] * num_messages


def _chat_raw(messages: list[dict]) -> bytes:
    body = {"model": MODEL, "stream": False, "options": {"num_predict": 2}, "messages": messages}
    return json.dumps(body, separators=(",", ":")).encode()


def test_api_chat_tool_replies_cost_what_plain_messages_cost(server):
    """A 946 KB /api/chat history of thousands of tool calls and replies costs at most
    TOOL_COST_FACTOR times the CPU time of a same-size history of plain user messages (matching a
    reply to its call is linear, not a scan of the unanswered calls per reply)."""
    per_call = len(_chat_raw(_tool_history(1001))) - len(_chat_raw(_tool_history(1000)))
    num_calls = (TOOL_BODY_BYTES - len(_chat_raw(_tool_history(0)))) // per_call
    tools = _chat_raw(_tool_history(num_calls))
    plain = _chat_raw(_plain_history(num_calls + 2, len(tools)))
    assert abs(len(tools) - len(plain)) < 0.01 * len(tools) and len(tools) <= TOOL_BODY_BYTES

    async def scenario():
        async with async_client(server) as client:
            await _cpu(client, "/api/chat", plain)  # warm-up
            return await _cpu(client, "/api/chat", plain), await _cpu(client, "/api/chat", tools)

    (plain_resp, plain_cost), (tools_resp, tools_cost) = server.call(scenario(), HANG_S)
    print(f"\n/api/chat {len(tools)} bytes: {num_calls} tool calls and replies {tools_cost:.3f} s of CPU, "
          f"plain messages {plain_cost:.3f} s")
    assert plain_resp.status_code < 500 and tools_resp.status_code < 500, tools_resp.text[:300]
    assert tools_cost <= TOOL_COST_FACTOR * plain_cost, (
        f"{num_calls} tool replies cost {tools_cost:.3f} s of CPU, over {TOOL_COST_FACTOR}x the "
        f"{plain_cost:.3f} s of as many bytes of plain messages")
