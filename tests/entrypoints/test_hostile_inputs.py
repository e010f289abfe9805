"""Hostile structured output and per-request lists against an in-process server (the app served
through httpx's ASGI transport, its engine thread and tokenizer pool running as in `deepinfer
serve`): what llguidance refuses is a 400 naming the param, huge lists are refused at once, a
grammar that dies mid-generation ends its request alone with one log line, unknown fields are
a 400 naming them; `/health` and another user's stream never stall, and every KV block is free
afterwards."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from deepinfer import LLM
from deepinfer.entrypoints.openai.server import ServerSettings, build_app
from deepinfer.structured_output import GrammarCompiler

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Answer:"}]
SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
LARK_ROW = "start: " + " | ".join(f'"w{i}"' for i in range(5000))  # one row of 5001 items (limit 2000)
LARK_20K = "start: " + " | ".join(f'"w{i}"' for i in range(20000))


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), max_num_seqs=8)


def serve(llm, scenario, monkeypatch, **settings):
    """Run `scenario(client)` against a fresh app over `llm`'s engine (kept open for the next app),
    served with ServerSettings(model_name="m", **settings)."""
    monkeypatch.setattr(llm.engine, "close", lambda: None)
    app = build_app(llm.engine, ServerSettings(model_name="m", **settings))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                return await scenario(client)

    result = asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()  # every block back in the pool
    return result


REFUSED = [  # (name, path, body, param, words the message must hold)
    ("recursion", CMPL, {"guided_grammar": 'start: "a" start'}, "guided_grammar", "guided_grammar: cannot be used"),
    ("self-ref schema", CMPL, {"guided_json": SELF_REF}, "guided_json", "guided_json: cannot be used"),
    ("regex blowup", CMPL, {"guided_regex": "(a{1000}){1000}"}, "guided_regex", "too many expressions"),
    ("wide row", CHAT, {"structured_outputs": {"grammar": LARK_ROW}}, "structured_outputs",
     "structured_outputs.grammar: cannot be used"),
    ("20k alternatives", CMPL, {"guided_grammar": LARK_20K}, "guided_grammar", "the limit is 131072"),
    ("self-ref json_schema", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SELF_REF}}}, "response_format", "response_format.json_schema.schema: cannot be used"),
    ("regex in structured_outputs", CHAT, {"structured_outputs": {"regex": "(a{1000}){1000}"}},
     "structured_outputs", "structured_outputs.regex: cannot be used"),
    ("choice banned by bad_words", CMPL, {"guided_choice": ["yes"], "bad_words": ["yes"]}, "guided_choice",
     "bad_words"),
    ("50k choices", CMPL, {"guided_choice": [f"word{i}" for i in range(50_000)]}, "guided_choice",
     "guided_choice: has 50000 strings; the limit is 1024"),
    ("100k choices", CHAT, {"guided_choice": [f"word{i}" for i in range(100_000)]}, "guided_choice",
     "guided_choice: has 100000 strings"),
    ("20k bad words", CMPL, {"bad_words": [f"word{i}" for i in range(20_000)]}, "bad_words",
     "bad_words: has 20000 words; the limit is 1024"),
    ("40k bad words", CHAT, {"bad_words": [f"word{i}" for i in range(40_000)]}, "bad_words", "bad_words: has 40000"),
    ("10k stop strings", CMPL, {"stop": [f"s{i}" for i in range(10_000)]}, "stop", "stop: has 10000 strings"),
    ("10k logit_bias", CMPL, {"logit_bias": {str(i): 1.0 for i in range(10_000)}}, "logit_bias",
     "logit_bias: has 10000 entries"),
]


def _body(path: str, fields: dict) -> dict:
    base = {"prompt": "Answer:"} if path == CMPL else {"messages": MSG}
    return {**base, "max_tokens": 8, "temperature": 0, **fields}


async def _health_latencies(client, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        start = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.02)
    return latencies


async def _normal_stream(client) -> tuple[list[float], str]:
    """A plain streamed request beside the hostile ones: the gaps between its events (each event
    an error-free chunk), its text."""
    body = _body(CMPL, {"max_tokens": 48, "ignore_eos": True, "stream": True})
    gaps, text, last = [], "", time.monotonic()
    async with client.stream("POST", CMPL, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    return gaps, text


def _record_compiles(monkeypatch) -> list[str]:
    """The thread name of every structured-output compile (GrammarCompiler.prepare), in order."""
    threads: list[str] = []
    prepare = GrammarCompiler.prepare

    def recorded(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(GrammarCompiler, "prepare", recorded)
    return threads


@pytest.mark.slow
def test_hostile_inputs_are_400s_and_nobody_else_waits(llm, monkeypatch, caplog):
    """Every hostile body is a 400 naming its param with llguidance's short reason: a list over
    its limit before any grammar is compiled, a grammar llguidance refuses after one compile; all
    of that work runs in the tokenizer pool (never on the event loop nor the engine thread), so
    meanwhile /health answers every poll and a normal stream gets all its tokens. Work is counted,
    not timed (a loaded machine stretches every duration alike)."""
    compiles = _record_compiles(monkeypatch)

    async def scenario(client):
        stop = asyncio.Event()
        health = asyncio.create_task(_health_latencies(client, stop))
        normal = asyncio.create_task(_normal_stream(client))
        answers = []
        for name, path, fields, param, words in REFUSED:
            before = len(compiles)
            resp = await client.post(path, json=_body(path, fields))
            answers.append((name, param, words, resp.status_code, resp.json(), len(compiles) - before))
        gaps, text = await normal
        stop.set()
        return answers, await health, gaps, text

    with caplog.at_level(logging.INFO):
        answers, health, gaps, text = serve(llm, scenario, monkeypatch)
    for name, param, words, status, body, num_compiles in answers:
        assert status == 400, (name, body)
        error = body["error"]
        assert error["param"] == param and words in error["message"], (name, error)
        assert len(error["message"]) < 500 and "<state>" not in error["message"], (name, error)
        over_a_size_limit = " has " in words or "the limit is" in words  # refused before any compile
        assert num_compiles == (0 if over_a_size_limit else 1), (name, num_compiles)
    assert compiles and all(t.startswith("deepinfer-tokenize") for t in compiles), set(compiles)
    assert health, "the /health poller got no answer"  # every answer it got was a 200
    assert len(gaps) >= 48, len(gaps)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.slow
def test_the_engine_thread_compiles_nothing(llm, monkeypatch):
    """The pool compiled the grammar; the engine's add path and the worker reuse it."""

    def refuse(*args):
        raise AssertionError("compiled on the engine thread")

    monkeypatch.setattr(llm.engine.outputs.grammars, "compile", refuse)
    monkeypatch.setattr(llm.engine.runner.steps.structured, "_compile", refuse)

    async def scenario(client):
        return await client.post(CMPL, json=_body(CMPL, {"guided_regex": "[0-9]{3}", "max_tokens": 10}))

    resp = serve(llm, scenario, monkeypatch)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].isdigit()


@pytest.mark.slow
def test_a_grammar_dead_end_mid_generation_is_a_400_and_one_log_line(llm, monkeypatch, caplog):
    """"hello world" is two tokens, and bad_words bans the pair: after "hello" no token is left.
    Whole: a 400; streamed: one error event after the first token, then [DONE]."""
    fields = {"guided_choice": ["hello world"], "bad_words": ["hello world"], "max_tokens": 10}

    async def scenario(client):
        whole = await client.post(CMPL, json=_body(CMPL, fields))
        async with client.stream("POST", CMPL, json=_body(CMPL, {**fields, "stream": True})) as resp:
            events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
        return whole, events

    with caplog.at_level(logging.INFO):
        whole, events = serve(llm, scenario, monkeypatch)
    assert whole.status_code == 400, whole.text
    error = whole.json()["error"]
    assert error["code"] == "structured_output_failed" and "banned by bad_words" in error["message"], error
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "structured_output_failed"
    assert "hello" in "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 2, [r.getMessage() for r in records]  # one line per failed request
    assert all(r.exc_info is None and len(r.getMessage().splitlines()) == 1 for r in records)


UNKNOWN = [(CMPL, {"max_tokns": 5}, "max_tokns"), (CHAT, {"temprature": 0.5}, "temprature"),
           (CMPL, {"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options")]


def test_unknown_fields_are_a_400_naming_them_and_client_fields_are_accepted(llm, monkeypatch):
    client_fields = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "seed": 3,
                     "n": 1, "stream_options": {"include_usage": True}, "stream": True}
    chat_fields = {**client_fields, "logprobs": True, "top_logprobs": 2, "parallel_tool_calls": True}

    async def scenario(client):
        refused = [await client.post(path, json=_body(path, fields)) for path, fields, _ in UNKNOWN]
        ok = [await client.post(CMPL, json=_body(CMPL, client_fields)),
              await client.post(CHAT, json=_body(CHAT, chat_fields))]
        tools = await client.post(CHAT, json=_body(CHAT, {"tools": [{"type": "function"}]}))
        return refused, ok, tools

    refused, ok, tools = serve(llm, scenario, monkeypatch)
    for resp, (_, _, param) in zip(refused, UNKNOWN, strict=True):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and "Unrecognized request argument supplied" in error["message"], error
    assert refused[0].json()["error"]["message"].endswith("max_tokns")
    for resp in ok:
        assert resp.status_code == 200 and "data: [DONE]" in resp.text, resp.text
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools", tools.text  # no function
