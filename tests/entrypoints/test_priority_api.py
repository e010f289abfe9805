"""The server's side of scheduling: a body's `priority` reaches the engine (and fcfs refuses one
other than 0 with a 400 naming it, as vLLM); the client a request counts for in the fair share is
a hash of the API key it presented (several keys may be accepted), else its `user`."""

from __future__ import annotations

import hashlib

import pytest
from app_server import AppServer, serve_args

from deepinfer.serving.tenancy import api_keys

KEYS = ("key-one", "key-two", "key-three")


def _recording(app: AppServer) -> list[dict]:
    """Record the keywords of every engine.add_request the engine thread makes."""
    engine, calls = app.llm.engine, []
    original = engine.add_request

    def add_request(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    engine.add_request = add_request
    return calls


@pytest.fixture(scope="module")
def priority_app(tiny_checkpoint):
    flags = ["--model", tiny_checkpoint("llama"), "--scheduling-policy", "priority", "--priority-range=-10:",
             "--api-key", f"{KEYS[0]},{KEYS[1]}", "--api-key", KEYS[2]]
    with AppServer(*flags) as app:
        yield app, _recording(app)


@pytest.fixture(scope="module")
def fcfs_app(tiny_checkpoint):
    with AppServer("--model", tiny_checkpoint("llama")) as app:
        yield app, _recording(app)


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_priority_reaches_the_engine_with_the_key_as_client(priority_app):
    app, calls = priority_app
    body = {"prompt": "Hello", "max_tokens": 2, "priority": 7}
    for key in KEYS:
        assert app.client.post("/v1/completions", json=body, headers=_bearer(key)).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": -3, "user": "alice"}
    assert app.client.post("/v1/chat/completions", json=chat, headers=_bearer(KEYS[0])).status_code == 200
    assert [c["priority"] for c in calls[-4:]] == [7, 7, 7, -3]
    client_ids = [c["client_id"] for c in calls[-4:]]
    expected = ["key:" + hashlib.sha256(k.encode()).hexdigest()[:16] for k in KEYS]
    assert client_ids == expected + expected[:1]  # with keys, the key (not `user`) names the client
    assert not any(k in cid for k in KEYS for cid in client_ids)  # never the key itself
    wrong = app.client.post("/v1/completions", json=body, headers=_bearer("key-four"))
    assert wrong.status_code == 401


def test_every_generation_api_counts_for_the_key_it_presented(priority_app):
    app, calls = priority_app
    model = app.client.get("/v1/models", headers=_bearer(KEYS[0])).json()["data"][0]["id"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "model": model}
    sent = [("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, _bearer(KEYS[1])),
            ("/v1/messages", {**chat, "max_tokens": 2}, {"x-api-key": KEYS[2]}),
            ("/api/chat", {**chat, "stream": False, "options": {"num_predict": 2}}, _bearer(KEYS[0])),
            ("/api/generate", {"model": model, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
             _bearer(KEYS[1]))]
    for path, body, headers in sent:
        answer = app.client.post(path, json=body, headers=headers)
        assert answer.status_code == 200, (path, answer.text)
    expected = ["key:" + hashlib.sha256(k.encode()).hexdigest()[:16] for k in (KEYS[1], KEYS[2], KEYS[0], KEYS[1])]
    assert [c.get("client_id") for c in calls[-4:]] == expected


def test_fcfs_refuses_a_priority_with_a_400_naming_it(fcfs_app):
    app, calls = fcfs_app
    resp = app.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "priority": 2})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "priority" and "got 2" in error["message"] and "fcfs" in error["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 1}
    assert app.client.post("/v1/chat/completions", json=chat).status_code == 400
    bad = app.client.post("/v1/completions", json={"prompt": "Hello", "priority": "high"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    ok = app.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "priority": 0, "user": "bob"})
    assert ok.status_code == 200
    assert calls[-1].get("priority", 0) == 0
    assert calls[-1]["client_id"] == "user:" + hashlib.sha256(b"bob").hexdigest()[:16]  # no keys: `user`


def test_api_key_flag_takes_several_keys():
    args = serve_args(["--api-key", "a", "--api-key", "b, c", "--api-key", "a"])
    assert args.api_key == "a,b, c,a"
    assert api_keys(args.api_key) == ("a", "b", "c") == api_keys(["a,b", " c", ""])
    assert api_keys(None) == () == api_keys("")
    assert serve_args(["--api-key", "solo"]).api_key == "solo"
