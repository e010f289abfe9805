"""The Responses API with a reasoning parser and with a LoRA adapter.

Reasoning: `--reasoning-parser deepseek_r1` on the tiny model under a template that opens `<think>`.
A random model seldom writes `</think>` by itself, so the tests bias the three tokens of `</think>`
(+100) and seed the sampler in every request the server hands its engine (`forced_think`): the
answer then holds a short section, `</think>` and more text after it. The whole response has a
reasoning item with the section and a message item with the rest (as the chat route splits it, and
as the raw completion text shows); the stream's `response.reasoning_text.delta` events add up to
that reasoning text, and the stream passes `responses_stream.check_response_stream`.

LoRA: with `--lora-modules b=...`, a response whose `model` names the adapter reports that name
(whole, streamed and retrieved) and runs the adapter: its text is the chat route's with the adapter
(which tests/lora/test_lora_server.py checks against PEFT) and differs from the base model's.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
from agent_models import REASONING, templated_checkpoint
from app_server import AppServer
from responses_stream import check_response_stream

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_adapters import make_adapters  # noqa: E402

QUESTION = "What is 2 + 2?"
THINK_SEED = 3
MAX_OUTPUT = 24


@pytest.fixture(scope="module")
def reasoning_server(tiny_checkpoint, tmp_path_factory):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("r1")), REASONING)
    with AppServer("--model", path, "--served-model-name", "tiny", "--reasoning-parser", "deepseek_r1") as app:
        yield app


@pytest.fixture
def forced_think(reasoning_server, monkeypatch):
    """Every request the engine gets from now on: `</think>`'s tokens at +100 and seed THINK_SEED."""
    tokens = reasoning_server.client.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False})
    bias = {int(t): 100.0 for t in tokens.json()["tokens"]}
    loop = reasoning_server.app.state.server.engine_loop
    add = loop.add

    async def biased_add(request_id, prompt_ids, params, *args, **kwargs):
        params = copy.copy(params)
        params.logit_bias, params.seed = bias, THINK_SEED
        return await add(request_id, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(loop, "add", biased_add)


def _request(**fields) -> dict:
    return {"model": "tiny", "input": QUESTION, "temperature": 1.0, "max_output_tokens": MAX_OUTPUT, **fields}


def _raw_answer(server) -> str:
    """The model's whole text for the same prompt, unparsed (the completions route)."""
    messages = [{"role": "user", "content": QUESTION}]
    prompt = server.client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
    out = server.client.post("/v1/completions", json={"model": "tiny", "prompt": prompt["tokens"], "temperature": 1.0,
                                                      "max_tokens": MAX_OUTPUT})
    assert out.status_code == 200, out.text
    return out.json()["choices"][0]["text"]


def test_a_whole_response_has_a_reasoning_item_and_a_message(reasoning_server, forced_think):
    """The section before `</think>` is the reasoning item's text, the rest the message's; the same
    split as the model's raw text and as the chat route's message."""
    response = reasoning_server.client.post("/v1/responses", json=_request()).json()
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and message["type"] == "message", response["output"]
    (part,) = reasoning["content"]
    assert part["type"] == "reasoning_text" and part["text"]
    answer = message["content"][0]["text"]
    assert answer and message["content"][0]["type"] == "output_text"
    raw = _raw_answer(reasoning_server)
    assert raw.startswith(part["text"] + "</think>") and raw.endswith(answer), (raw, part["text"], answer)
    chat = reasoning_server.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], temperature=1.0, max_tokens=MAX_OUTPUT)
    assert (part["text"], answer) == (chat.choices[0].message.reasoning_content, chat.choices[0].message.content)
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_a_streamed_response_sends_reasoning_text_deltas(reasoning_server, forced_think):
    """The stream opens a reasoning item, sends `response.reasoning_text.delta` events (OpenAI's name)
    that add up to the whole response's reasoning text, then the message's `output_text` deltas."""
    whole = reasoning_server.client.post("/v1/responses", json=_request()).json()
    raw = reasoning_server.client.post("/v1/responses", json=_request(stream=True))
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = check_response_stream(raw.content)
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert reasoning == whole["output"][0]["content"][0]["text"] and reasoning
    assert answer == whole["output"][1]["content"][0]["text"] and answer
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["usage"]["output_tokens_details"] == whole["usage"]["output_tokens_details"]


def test_the_openai_client_reads_the_reasoning_stream(reasoning_server, forced_think):
    """The official client parses every event into its typed models (the reasoning deltas and their
    `.done` as the reasoning_text events), and the final response carries the same text. (Its stream
    helper wants `response.completed`; a cut answer ends with `response.incomplete`.)"""
    client = reasoning_server.openai()
    events = list(client.responses.create(stream=True, **_request()))
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert deltas and type(deltas[0]).__name__ == "ResponseReasoningTextDeltaEvent"
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert type(done).__name__ == "ResponseReasoningTextDoneEvent"
    final = events[-1].response
    assert (events[-1].type, final.status) == ("response.incomplete", "incomplete")
    assert final.output[0].content[0].text == done.text == "".join(e.delta for e in deltas)
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")


# -- a LoRA adapter ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(tiny_checkpoint, tmp_path_factory):
    import app_server

    from deepinfer.entrypoints.openai.args import lora_settings

    base = tiny_checkpoint("llama")
    adapters = make_adapters(base, tmp_path_factory.mktemp("adapters"), {"b": dict(r=8, targets=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], alpha=8.0, seed=2)})
    flags = ["--model", base, "--served-model-name", "base", "--enable-lora", "--max-loras", "1",
             "--max-lora-rank", "8", "--lora-modules", f"b={adapters['b']}"]
    plain = app_server.server_settings
    with pytest.MonkeyPatch.context() as mp:  # the LoRA flags reach the settings as `deepinfer serve` builds them
        mp.setattr(app_server, "server_settings", lambda args: dataclasses.replace(plain(args), **lora_settings(args)))
        with AppServer(*flags) as server:
            yield server


LORA_REQUEST = {"input": QUESTION, "temperature": 0, "max_output_tokens": 8}


@pytest.mark.slow
def test_a_response_with_an_adapter_reports_its_name(lora_server):
    """`model` names the adapter in the whole response, in every streamed event's response and in
    the stored one (it used to be the base model's name)."""
    whole = lora_server.client.post("/v1/responses", json={"model": "b", **LORA_REQUEST}).json()
    assert whole["model"] == "b", whole
    assert lora_server.client.get(f"/v1/responses/{whole['id']}").json()["model"] == "b"
    raw = lora_server.client.post("/v1/responses", json={"model": "b", "stream": True, **LORA_REQUEST})
    events = check_response_stream(raw.content)
    assert {e["response"]["model"] for e in events if "response" in e} == {"b"}
    base = lora_server.client.post("/v1/responses", json={"model": "base", **LORA_REQUEST}).json()
    assert base["model"] == "base"


def test_a_response_with_an_adapter_runs_it(lora_server):
    """The adapter's text is the chat route's with the adapter, whole and streamed, and not the base's."""
    client = lora_server.openai()
    adapted = client.responses.create(model="b", **LORA_REQUEST)
    base = client.responses.create(model="base", **LORA_REQUEST)
    assert adapted.output_text != base.output_text, adapted.output_text
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=8)
    assert adapted.output_text == chat.choices[0].message.content
    events = list(client.responses.create(model="b", stream=True, **LORA_REQUEST))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == adapted.output_text
