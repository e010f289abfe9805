"""Structured output through the app of `deepinfer serve` (in this process): OpenAI's
response_format (json_object, json_schema), vLLM's structured_outputs and guided_* fields, bad
specs refused with a 400 naming the param, and the acceptance test: 20 seeded random JSON schemas
sent by the official openai client to the default model, every answer parsed with `json.loads`
and validated with `jsonschema`."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

_CHAT, _CMPL = "/v1/chat/completions", "/v1/completions"
_MSG = [{"role": "user", "content": "Answer:"}]


@pytest.fixture(scope="module")
def tiny_server(tiny_app_server):
    """The session's tiny llama app (tests/entrypoints/conftest.py)."""
    return tiny_app_server


def _post(server, path, body) -> httpx.Response:
    return server.client.post(path, json=body, timeout=120)


BAD = [  # (name, path, body, param, words the message must hold)
    ("bad guided_regex", _CMPL, {"prompt": "x", "guided_regex": "[0-9"}, "guided_regex", "guided_regex"),
    ("bad guided_json", _CMPL, {"prompt": "x", "guided_json": {"type": "nothing"}}, "guided_json", "guided_json"),
    ("guided_json not JSON", _CMPL, {"prompt": "x", "guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ("empty guided_choice", _CHAT, {"messages": _MSG, "guided_choice": []}, "guided_choice", "guided_choice"),
    ("guided_choice of ints", _CHAT, {"messages": _MSG, "guided_choice": [1, 2]}, "guided_choice", None),
    ("bad guided_grammar", _CMPL, {"prompt": "x", "guided_grammar": "start: 'a' | "}, "guided_grammar",
     "guided_grammar"),
    ("two kinds in structured_outputs", _CMPL, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("unknown structured_outputs key", _CMPL, {"prompt": "x", "structured_outputs": {"yaml": "a"}},
     "structured_outputs", "yaml"),
    ("bad structured_outputs regex", _CHAT, {"messages": _MSG, "structured_outputs": {"regex": "(a"}},
     "structured_outputs", "structured_outputs.regex"),
    ("json_schema without schema", _CHAT, {"messages": _MSG, "response_format": {"type": "json_schema"}},
     "response_format", "json_schema"),
    ("invalid json_schema", _CHAT, {"messages": _MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "zero"}}}},
     "response_format", "response_format.json_schema.schema"),
    ("unknown response_format", _CMPL, {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format",
     "yaml"),
    ("two constraints", _CHAT, {"messages": _MSG, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex", "both"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_specs_get_a_400_naming_the_param(tiny_server, case):
    _, path, body, param, words = case
    resp = _post(tiny_server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert words is None or words in error["message"], error


GOOD = [  # (path, extra body fields, check of the text)
    (_CMPL, {"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    (_CMPL, {"guided_regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
    (_CHAT, {"structured_outputs": {"regex": r"(yes|no), [a-z]{1,6}"}},
     lambda t: re.fullmatch(r"(yes|no), [a-z]{1,6}", t)),
    (_CHAT, {"structured_outputs": {"grammar": 'root ::= "<" [a-c] [a-c]? ">"'}},
     lambda t: re.fullmatch(r"<[a-c]{1,2}>", t)),
    (_CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}}},
     lambda t: 0 <= json.loads(t)["n"] <= 99 and set(json.loads(t)) == {"n"}),
    (_CHAT, {"guided_json": json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                         "maxItems": 3})},
     lambda t: 1 <= len(json.loads(t)) <= 3 and all(isinstance(b, bool) for b in json.loads(t))),
]


@pytest.mark.parametrize("path,extra,check", GOOD, ids=[f"{i}-{next(iter(g[1]))}" for i, g in enumerate(GOOD)])
def test_constrained_answers_on_a_random_model(tiny_server, path, extra, check):
    for seed in range(3):
        body = {"max_tokens": 60, "temperature": 1.0, "seed": seed, **extra}
        body |= {"prompt": "Answer:"} if path == _CMPL else {"messages": _MSG}
        resp = _post(tiny_server, path, body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        text = choice["text"] if path == _CMPL else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and check(text), (text, choice["finish_reason"])


def test_logprobs_stay_finite_under_a_mask(tiny_server):
    """Tokens the grammar forbids have logprob -inf, which JSON cannot carry: the server clamps."""
    body = {"prompt": "Answer:", "max_tokens": 10, "temperature": 0.0, "logprobs": 5, "guided_choice": ["ab", "cd"]}
    resp = _post(tiny_server, _CMPL, body)
    assert resp.status_code == 200, resp.text
    logprobs = resp.json()["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] and all(-1e4 <= x <= 0 for x in logprobs["token_logprobs"])
    assert all(-1e4 <= x <= 0 for top in logprobs["top_logprobs"] for x in top.values())


def test_json_object_streams_a_json_prefix(tiny_server):
    """json_object on a random model: the streamed text is JSON (or a prefix of it when cut at
    max_tokens), starting with an object."""
    body = {"messages": _MSG, "max_tokens": 40, "temperature": 0.0, "stream": True,
            "response_format": {"type": "json_object"}}
    text = ""
    with tiny_server.client.stream("POST", _CHAT, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    assert text.startswith("{"), text


# -- acceptance: 20 random schemas, the official client, the default model ------------------------


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 2-4 fields: string (bounded by maxLength), integer, number (both with
    bounds), boolean, enum, array (bounded by maxItems) and, at the top level, a nested object."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth == 0 else [])
    properties = {}
    for i in range(rng.randint(2, 4)):
        kind = rng.choice(kinds)
        name = rng.choice(["name", "city", "count", "score", "size", "label", "active", "tags", "info", "year"])
        properties[f"{name}_{i}"] = _field(rng, kind, depth)
    required = sorted(properties) if rng.random() < 0.7 else sorted(properties)[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _field(rng: random.Random, kind: str, depth: int) -> dict:
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(4, 16)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "small", "large", "on", "off"], 3)}
    if kind == "array":
        items = rng.choice([{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0, "maximum": 9}])
        return {"type": "array", "items": items, "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


@pytest.mark.real_model
@pytest.mark.slow
def test_openai_client_json_schema_answers_validate(default_server):
    client = default_server.openai(api_key="none", timeout=600)
    model = client.models.list().data[0].id
    rng = random.Random(1234)
    schemas = [random_schema(rng) for _ in range(20)]

    def ask(i: int) -> tuple[dict, str, str]:
        schema = schemas[i]
        resp = client.chat.completions.create(
            model=model, max_tokens=400, temperature=0.0,
            messages=[{"role": "user", "content": f"Give one example object for this JSON schema: {schema}"}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return schema, resp.choices[0].message.content, resp.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    for schema, content, finish_reason in answers:
        assert finish_reason == "stop", (schema, content)
        jsonschema.validate(json.loads(content), schema)
