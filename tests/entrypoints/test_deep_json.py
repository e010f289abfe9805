"""JSON nested inside a client's strings is read under the body's bounds: tool-call `arguments`
nested 5,000 deep in the history of /v1/chat/completions, /v1/responses (`input` function_call
items) and /tokenize (`messages`), and a JSON schema sent as text, are a 400 naming the field and
the depth limit (json.loads used to raise RecursionError: a 500), found by a scan before anything
is parsed. Arguments within the limit are still read and rendered."""

from __future__ import annotations

import json

import pytest
from test_hostile_inputs import serve

from deepinfer import LLM
from deepinfer.json_bounds import MAX_JSON_DEPTH, parse_nested_json
from deepinfer.serving.chat.tool_parsers import TOOL_PARSERS

CMPL, CHAT, RESPONSES, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"
LIMIT = f"the limit is {MAX_JSON_DEPTH}"


def nested(depth: int) -> str:
    """JSON text of objects `depth` deep: {"a": {"a": ... 0 ...}}."""
    return '{"a": ' * depth + "0" + "}" * depth


DEEP = nested(5000)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), max_num_seqs=4)


def chat_history(arguments: str) -> list[dict]:
    """A user turn, an assistant call with `arguments` (messages[1].tool_calls[0]), its result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return [{"role": "user", "content": "Look it up."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "found"}]


def responses_input(arguments: str) -> list[dict]:
    """The same history as Responses `input` items (the call is input[1])."""
    return [{"type": "message", "role": "user", "content": "Look it up."},
            {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "found"}]


def requests(arguments: str) -> list[tuple[str, dict, str, str]]:
    """(path, body, param, field) of the three routes that read a history with `arguments`."""
    return [
        (CHAT, {"messages": chat_history(arguments), "max_tokens": 4, "temperature": 0}, "messages",
         "messages[1].tool_calls[0].function.arguments"),
        (RESPONSES, {"input": responses_input(arguments), "max_output_tokens": 4, "temperature": 0}, "input",
         "input[1].arguments"),
        (TOKENIZE, {"messages": chat_history(arguments)}, "messages", "messages[1].tool_calls[0].function.arguments"),
    ]


SCHEMAS = [  # a JSON schema sent as a string, 5,000 deep
    (CMPL, {"prompt": "Answer:", "max_tokens": 4, "guided_json": DEEP}, "guided_json"),
    (CHAT, {"messages": chat_history("{}"), "max_tokens": 4, "structured_outputs": {"json": DEEP}},
     "structured_outputs"),
]


def test_arguments_nested_5000_deep_are_a_400_naming_the_field_on_every_route(llm, monkeypatch):
    async def scenario(client):
        deep = [await client.post(path, json=body) for path, body, _, _ in requests(DEEP)]
        schemas = [await client.post(path, json=body) for path, body, _ in SCHEMAS]
        within = [await client.post(path, json=body) for path, body, _, _ in requests(nested(MAX_JSON_DEPTH - 8))]
        return deep, schemas, within

    deep, schemas, within = serve(llm, scenario, monkeypatch)
    for resp, (path, _, param, field) in zip(deep, requests(DEEP), strict=True):
        assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
        error = resp.json()["error"]
        assert error["param"] == param, (path, error)
        assert f"{field}: nests arrays and objects 5000 deep; {LIMIT}" in error["message"], (path, error)
    for resp, (path, _, param) in zip(schemas, SCHEMAS, strict=True):
        assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
        error = resp.json()["error"]
        assert error["param"] == param and f"5000 deep; {LIMIT}" in error["message"], (path, error)
    for resp, (path, _, _, _) in zip(within, requests(DEEP), strict=True):
        assert resp.status_code == 200, (path, resp.text[:300])


@pytest.mark.parametrize("text,words", [
    (DEEP, "nests arrays and objects 5000 deep"),
    ("[" * 5000, "nests arrays and objects 5000 deep"),  # unterminated: still refused before parsing
    ('{"a": [1, 2', "is not valid JSON (Expecting ',' delimiter at line 1 column 12)"),
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('{"a": 1e999}', "the number 1e999 is out of range"),
    ('{"a": ' + "9" * 5000 + "}", "a number of 5000 characters is too long; the limit is 100"),
    ('{"a": "\\ud800"}', "holds a lone UTF-16 surrogate"),
])
def test_nested_json_refusals_name_the_field(text, words):
    with pytest.raises(ValueError) as caught:
        parse_nested_json(text, "tool.arguments")
    assert str(caught.value).startswith("tool.arguments") and words in str(caught.value), str(caught.value)


def test_nested_json_within_the_bounds_is_parsed():
    assert parse_nested_json(nested(MAX_JSON_DEPTH), "f") == json.loads(nested(MAX_JSON_DEPTH))
    assert parse_nested_json('{"brackets in strings": "[[[[{{{{", "ok": "\\u00e9\\ud83d\\ude00"}', "f") == {
        "brackets in strings": "[[[[{{{{", "ok": "\u00e9\U0001f600"}
    with pytest.raises(ValueError, match=f"f nests arrays and objects {MAX_JSON_DEPTH + 1} deep"):
        parse_nested_json(nested(MAX_JSON_DEPTH + 1), "f")


def test_an_answer_that_writes_arguments_5000_deep_is_content_not_a_crash():
    """The model's own text: a call whose arguments nest 5,000 deep is not a call (json.loads
    gives up), so the answer stays content."""
    text = '<tool_call>\n{"name": "lookup", "arguments": ' + DEEP + '}\n</tool_call>'
    parsed = TOOL_PARSERS["hermes"]().parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])
