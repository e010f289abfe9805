"""Forced tool calls of a real model end: the embedded SmolLM2-135M-Instruct with the Hermes/Qwen tool
template (`--chat-template`), sampled at temperature 1 over 20 seeds, through the official openai client
(chat `required`, a named function, Responses `required`) and the anthropic client (`tool_choice` any).

Every answer must end by itself with its calls (finish_reason "tool_calls", stop_reason "tool_use",
Responses status "completed" with function_call items), between one call and the number asked for: a
runaway (calls until max_tokens, finish_reason "length") counts as a failure. A real model likes a
newline after `</tool_call>`; when the grammar read it as the start of another call, such answers
wrote calls until max_tokens and came back with none.

Every request is seeded (Responses and Anthropic take the chat route's `seed` in `extra_body`), so an
answer is the same on every run. Unseeded, an answer sometimes goes on after its two calls: at
temperature 1, seeds 85 and 146 of 0-199 write Paris, Rome and then a third call that max_tokens cuts
(both complete calls are returned, status "incomplete"). That is this model's choice, not a grammar
that cannot end; the 20 seeds here make two calls at most and end by themselves.

One server for all seeds; the requests of a kind run at once (one batch). And a streamed answer cut by
max_tokens inside a call never sends arguments that do not parse: the cut call is dropped.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest
from agent_models import ADD, HERMES, WEATHER, streamed_chat
from app_server import AppServer

pytestmark = [pytest.mark.real_model]

SEEDS = range(20)
MAX_TOKENS = 100  # a call of this model is about 40 tokens: two fit, a runaway reaches the limit
QUESTION = "What is the weather in Paris and in Rome?"  # two calls asked for (this model makes one)
MAX_CALLS = 2
TOOLS = [WEATHER, ADD]


@pytest.fixture(scope="module")
def smol():
    with AppServer("--chat-template", HERMES, "--served-model-name", "m") as app:
        app.listen()
        yield app


def _all(ask) -> list:
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return list(pool.map(ask, SEEDS))


def _check_calls(kind: str, calls: list[tuple[str, str]], allowed: set[str]) -> None:
    assert 1 <= len(calls) <= MAX_CALLS, (kind, calls)
    for name, arguments in calls:
        assert name in allowed and isinstance(json.loads(arguments), dict), (kind, calls)


def test_forced_calls_end_by_themselves_in_every_api(smol):
    client = smol.openai(timeout=300)
    messages = [{"role": "user", "content": QUESTION}]
    names = {t["function"]["name"] for t in TOOLS}

    def chat(tool_choice):
        def ask(seed: int):
            return client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                                  temperature=1.0, seed=seed, max_tokens=MAX_TOKENS).choices[0]
        return ask

    for tool_choice, allowed in (("required", names),
                                 ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
        answers = _all(chat(tool_choice))
        assert [a.finish_reason for a in answers] == ["tool_calls"] * len(SEEDS), (tool_choice, answers)
        for a in answers:
            _check_calls(str(tool_choice), [(c.function.name, c.function.arguments) for c in a.message.tool_calls],
                         allowed)

    functions = [{"type": "function", **t["function"]} for t in TOOLS]
    responses = _all(lambda seed: client.responses.create(model="m", input=QUESTION, tools=functions,
                                                          tool_choice="required", temperature=1.0,
                                                          max_output_tokens=MAX_TOKENS, extra_body={"seed": seed}))
    for r in responses:
        assert r.status == "completed", r
        _check_calls("responses", [(i.name, i.arguments) for i in r.output if i.type == "function_call"], names)

    messages_client = anthropic.Anthropic(base_url=smol.listen(), api_key="unused", max_retries=0, timeout=300)
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in TOOLS]
    replies = _all(lambda seed: messages_client.messages.create(
        model="m", max_tokens=MAX_TOKENS, messages=messages, tools=anthropic_tools, tool_choice={"type": "any"},
        extra_body={"temperature": 1.0, "seed": seed}))
    for reply in replies:
        assert reply.stop_reason == "tool_use", reply
        _check_calls("anthropic", [(b.name, json.dumps(b.input)) for b in reply.content if b.type == "tool_use"],
                     names)


def test_a_streamed_answer_cut_inside_a_call_sends_only_arguments_that_parse(smol):
    """max_tokens ends the answers inside their first call (20 tokens) or after it (50: inside a
    second one, if the model goes on): every call a stream sent has arguments that parse."""
    client = smol.openai(timeout=300)
    messages = [{"role": "user", "content": QUESTION}]
    for max_tokens in (20, 50):
        answers = _all(lambda seed, max_tokens=max_tokens: streamed_chat(
            client, model="m", messages=messages, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=max_tokens))
        for content, calls, finish in answers:
            if max_tokens == 20:  # no call is complete: the cut text is the content, as in a whole answer
                assert finish == "length" and not calls and content.startswith("<tool_call>"), (content, calls)
            else:  # one call, and the model ended, or max_tokens cut a second one (dropped)
                assert finish == "tool_calls" and len(calls) == 1 or finish == "length" and len(calls) <= 1, \
                    (content, calls, finish)
            for _, arguments in calls:
                assert isinstance(json.loads(arguments), dict), (max_tokens, calls)
