"""vLLM's tokenizer routes and the model card route on the tiny model (hermes tool template):
/tokenize of a prompt and of a chat (with tools) in vLLM's shapes, counted as the chat route counts
its prompt; /detokenize back; GET /v1/models/{id}; the API key; bad bodies as 400s naming the field."""

from __future__ import annotations

import pytest
from agent_models import HERMES, WEATHER, templated_checkpoint
from app_server import AppServer

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("hermes")), HERMES)
    with AppServer("--model", path, "--served-model-name", "org/tiny", api_key=KEY) as app:
        yield app


def _post(server, path: str, body: dict):
    return server.client.post(path, json=body, headers=AUTH)


def test_tokenize_a_prompt_and_back(server):
    tokenizer = server.llm.get_tokenizer()
    text = "Hello world, ça va? 日本"
    resp = _post(server, "/tokenize", {"model": "org/tiny", "prompt": text})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body == {"count": len(body["tokens"]), "max_model_len": server.llm.engine.max_model_len,
                    "tokens": tokenizer(text)["input_ids"], "token_strs": None}
    strs = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])
    assert _post(server, "/detokenize", {"model": "org/tiny", "tokens": body["tokens"]}).json() == {
        "prompt": tokenizer.decode(body["tokens"])}
    assert tokenizer.decode(strs["tokens"]) == text


def test_tokenize_a_chat_counts_what_the_chat_route_sends(server):
    for extra in ({}, {"tools": [WEATHER]}):
        counted = _post(server, "/tokenize", {"messages": CHAT, **extra}).json()
        answer = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **extra}).json()
        assert counted["count"] == answer["usage"]["prompt_tokens"] == len(counted["tokens"]), (counted, answer)
    with_tools = _post(server, "/detokenize", {"tokens": counted["tokens"]}).json()["prompt"]
    assert "<tools>" in with_tools and "get_weather" in with_tools and with_tools.endswith("<|im_start|>assistant\n")
    no_prompt = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < counted["count"]


def test_the_model_card(server):
    listed = server.client.get("/v1/models", headers=AUTH).json()["data"][0]
    assert server.client.get("/v1/models/org/tiny", headers=AUTH).json() == listed
    missing = server.client.get("/v1/models/other", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    client = server.openai(api_key=KEY)
    assert client.models.retrieve("org/tiny").id == "org/tiny"


BAD = [  # (path, body, status, param)
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "extra": 1}, 400, "extra"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_bodies_name_the_field(server, path, body, status, param):
    resp = _post(server, path, body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


def test_the_routes_need_the_key(server):
    assert server.client.post("/tokenize", json={"prompt": "a"}).status_code == 401
    assert server.client.post("/detokenize", json={"tokens": [1]}).status_code == 401
    assert server.client.get("/v1/models/org/tiny").status_code == 401
