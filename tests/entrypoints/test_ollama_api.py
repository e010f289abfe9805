"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/embed, /api/version) through the
official `ollama` client on a real port, on the tiny random model with a hermes tool template: a chat
answer equals the chat route's (same prompt tokens, same greedy text), whole and streamed as NDJSON
lines adding up to it; generate through the chat template and raw (equal to /v1/completions); options
(stop, num_predict -> done_reason "length"); a JSON schema `format`; a tool call (the random model's
answer forced by `format` to the bare JSON of a call, which the lenient reader of auto mode turns into
`message.tool_calls`) and the follow-up with its `tool` message; embeddings of a sentence-transformers
checkpoint equal to /v1/embeddings'; bad bodies (400 `{"error": ...}` naming the field), an unknown
model (Ollama's 404) and the API key.
"""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest
from agent_models import HERMES, WEATHER
from app_server import AppServer
from embedding_models import make_st_checkpoint

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 8}
KEY = "sk-ollama-key"
# a tool as the ollama client sends it (its Tool model keeps only some schema keywords)
TOOL = ollama.Tool.model_validate(WEATHER).model_dump(exclude_none=True, by_alias=True)
CALL_FORMAT = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                  "properties": {"city": {"const": "Paris"}, "unit": {"const": "celsius"}}}}}


@pytest.fixture(scope="module")
def server(hermes_server):
    """The tiny llama with the Hermes template, served as "tiny": the session's (tests/entrypoints/conftest.py)."""
    return hermes_server


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.listen(), timeout=120)


def _openai_chat(server, messages, max_tokens=8, **extra):
    return server.openai().chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                   max_tokens=max_tokens, **extra)


def test_version_tags_and_show(server, client):
    assert server.client.get("/api/version").json()["version"]
    (model,) = client.list().models
    assert model.model == "tiny:latest" and model.size > 0 and len(model.digest) == 64
    assert model.details.family == "llama" and model.details.format == "safetensors"
    assert model.details.parameter_size and model.details.quantization_level
    tags = server.client.get("/api/tags").json()["models"][0]
    assert tags["name"] == "tiny:latest" and {"modified_at", "size", "digest", "details"} <= set(tags)
    for name in ("tiny", "tiny:latest"):
        shown = client.show(name)
        assert shown.template == HERMES and shown.details.family == "llama"
        assert set(shown.capabilities) == {"completion", "tools"}
        assert shown.modelinfo["llama.context_length"] == server.llm.engine.max_model_len
    (loaded,) = client.ps().models  # the one model, loaded for as long as the server runs
    assert loaded.model == "tiny:latest" and loaded.size > 0 and loaded.expires_at.year > 2300


def test_chat_answers_as_the_chat_route_whole_and_streamed(server, client):
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    whole = client.chat(model="tiny", messages=messages, options=GREEDY)
    chat = _openai_chat(server, messages)
    assert whole.message.role == "assistant" and whole.message.content == chat.choices[0].message.content
    assert (whole.done, whole.done_reason, whole.eval_count) == (True, "length", 8)
    assert whole.prompt_eval_count == chat.usage.prompt_tokens
    assert whole.total_duration >= whole.eval_duration >= 0 and whole.load_duration == 0
    chunks = list(client.chat(model="tiny:latest", messages=messages, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True] and len(chunks) > 2
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert (chunks[-1].done_reason, chunks[-1].eval_count, chunks[-1].message.content) == ("length", 8, "")


def test_a_raw_stream_is_ndjson_by_default(server):
    resp = server.client.post("/api/chat", json={"model": "tiny", "messages": USER, "options": GREEDY})
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in resp.text.splitlines()]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])
    assert lines[-1]["created_at"].endswith("Z") and isinstance(lines[-1]["total_duration"], int)


def test_generate_through_the_template_and_raw(server, client):
    whole = client.generate(model="tiny", prompt=USER[0]["content"], system="Be brief.", options=GREEDY)
    chat = _openai_chat(server, [{"role": "system", "content": "Be brief."}, *USER])
    assert whole.response == chat.choices[0].message.content and whole.done_reason == "length"
    assert whole.prompt_eval_count == chat.usage.prompt_tokens
    streamed = list(client.generate(model="tiny", prompt=USER[0]["content"], system="Be brief.", options=GREEDY,
                                    stream=True))
    assert "".join(c.response for c in streamed) == whole.response and streamed[-1].done
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, options=GREEDY)
    completion = server.openai().completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                                    max_tokens=8)
    assert raw.response == completion.choices[0].text and raw.prompt_eval_count == completion.usage.prompt_tokens
    loaded = client.generate(model="tiny")  # no prompt: Ollama's "the model is loaded"
    assert loaded.done and loaded.done_reason == "load"


def test_options_stop_and_num_predict(client):
    text = client.chat(model="tiny", messages=USER, options={"temperature": 0, "num_predict": 12}).message.content
    stop = text[3:6]
    assert stop.strip() and text.find(stop) == 3, text
    stopped = client.chat(model="tiny", messages=USER, options={"temperature": 0, "num_predict": 12,
                                                                "stop": ["NEVER-WRITTEN", stop]})
    assert (stopped.message.content, stopped.done_reason) == (text[:3], "stop")
    short = client.chat(model="tiny", messages=USER, options={"temperature": 0, "num_predict": 3, "num_ctx": 4096,
                                                              "top_k": 5, "seed": 1, "repeat_penalty": 1.0})
    assert (short.eval_count, short.done_reason) == (3, "length")


def test_a_json_schema_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    answer = client.chat(model="tiny", messages=[{"role": "user", "content": "A digit?"}], format=schema,
                         options={"temperature": 1.0, "seed": 3, "num_predict": 30})
    assert answer.done_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content), schema)
    anything = client.generate(model="tiny", prompt="JSON?", format="json", options={"seed": 4, "num_predict": 60})
    assert anything.response.lstrip().startswith("{")  # a JSON object, maybe cut by num_predict
    if anything.done_reason == "stop":
        assert isinstance(json.loads(anything.response), dict)


def test_a_tool_call_and_its_follow_up(server, client):
    request = dict(model="tiny", messages=USER, tools=[TOOL], format=CALL_FORMAT,
                   options={"temperature": 0, "num_predict": 100})
    answer = client.chat(**request)
    (call,) = answer.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    assert not answer.message.content and answer.done_reason == "stop"
    streamed = list(client.chat(stream=True, **request))
    calls = [c for chunk in streamed for c in chunk.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", call.function.arguments)]
    assert "".join(c.message.content for c in streamed).strip() == ""

    turns = [*USER, answer.message, {"role": "tool", "content": "22 degrees", "tool_name": "get_weather"}]
    follow = client.chat(model="tiny", messages=turns, tools=[TOOL], options=GREEDY)
    same = [*USER, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": json.dumps(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "22 degrees"}]
    chat = _openai_chat(server, same, tools=[TOOL])
    assert follow.prompt_eval_count == chat.usage.prompt_tokens > answer.prompt_eval_count
    assert follow.message.content == chat.choices[0].message.content


BAD = [  # (body fields, what the message must name)
    ({"model": None}, "model"),
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "x"}}]}]},
     "messages[1].tool_calls[0]"),
    ({"options": {"temperature": 5}}, "options.temperature"),
    ({"options": {"num_predict": 0}}, "options.num_predict"),
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": {"stop": [3]}}, "options.stop"),
    ({"format": "xml"}, "format"),
    ({"format": {"type": "nothing"}}, "format"),
    ({"think": True}, "think"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]"),
    ({"stream": "yes"}, "stream"),
    ({"frequency": 1}, "frequency"),
]


@pytest.mark.parametrize("fields,named", BAD, ids=[f"{named}-{i}" for i, (_, named) in enumerate(BAD)])
def test_bad_chat_bodies_are_400s_naming_the_field(server, fields, named):
    body = {key: value for key, value in {"model": "tiny", "messages": USER, **fields}.items() if value is not None}
    resp = server.client.post("/api/chat", json=body)
    assert resp.status_code == 400, resp.text
    assert set(resp.json()) == {"error"} and named in resp.json()["error"], resp.json()


@pytest.mark.parametrize("route,body,named", [
    ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"prompt": "x", "context": [1, 2]}, "context"),
    ("/api/generate", {"prompt": "x", "raw": True, "system": "s"}, "system"),
    ("/api/generate", {"prompt": 3}, "prompt"),
    ("/api/embed", {"input": []}, "input"),
    ("/api/embed", {"input": 3}, "input"),
    ("/api/embeddings", {}, "prompt"),
    ("/api/show", {}, "model"),
])
def test_bad_bodies_on_the_other_routes(server, route, body, named):
    resp = server.client.post(route, json={"model": "tiny", **body} if route != "/api/show" else body)
    assert resp.status_code == 400 and named in resp.json()["error"], resp.text


def test_an_unknown_model_is_ollamas_404(server, client):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="llama3:8b", messages=USER)
    assert info.value.status_code == 404 and info.value.error == 'model "llama3:8b" not found, try pulling it first'
    for route, body in (("/api/generate", {"prompt": "x"}), ("/api/show", {}), ("/api/embed", {"input": "x"})):
        resp = server.client.post(route, json={"model": "nope", **body})
        assert resp.status_code == 404 and "nope" in resp.json()["error"], (route, resp.text)
    with pytest.raises(ollama.ResponseError) as info:  # a bad body, through the client
        client.chat(model="tiny", messages=USER, options={"top_p": 2})
    assert info.value.status_code == 400 and "options.top_p" in info.value.error


@pytest.mark.slow
def test_embed_equals_the_embeddings_route(tokenizer_dir, tmp_path_factory):
    path = make_st_checkpoint(str(tmp_path_factory.mktemp("st") / "mean"), tokenizer_dir, "llama", "mean")
    with AppServer("--model", path, "--served-model-name", "st", api_key=KEY) as app:
        client = ollama.Client(host=app.listen(), headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        inputs = ["a cat sat", "on the mat, twice"]
        found = client.embed(model="st", input=inputs)
        reference = app.openai(api_key=KEY).embeddings.create(model="st", input=inputs)
        assert found.embeddings == [item.embedding for item in reference.data]
        assert client.embed(model="st:latest", input=inputs[0]).embeddings == found.embeddings[:1]
        assert client.embeddings(model="st", prompt=inputs[1]).embedding == found.embeddings[1]
        assert "embedding" in client.show("st").capabilities
        with pytest.raises(ollama.ResponseError) as info:  # the API key holds on /api as on /v1
            ollama.Client(host=app.url, headers={"Authorization": "Bearer wrong"}).list()
        assert info.value.status_code == 401 and "API key" in info.value.error
        resp = app.client.post("/api/embed", json={"model": "st", "input": "x"})
        assert resp.status_code == 401 and set(resp.json()) == {"error"}
