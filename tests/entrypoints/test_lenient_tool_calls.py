"""Lenient tool calls with `tool_choice="auto"`: a ```json fenced or bare `{"name", "arguments"}`
object naming one of the request's tools, with arguments that pass its schema, is a call; prose
holding JSON that is not a call, an unknown name or arguments that do not validate stay content.

Each accepted and each rejected shape goes through the parser whole and streamed one character
at a time (the two must agree, and a rejected shape is released as content before the answer
ends once it cannot be a call); then through `deepinfer serve` with the official openai client,
the tiny random model's answer forced to the shape by a regex (whole and streamed).
"""

from __future__ import annotations

import json

import pytest
from agent_models import ADD, WEATHER

from deepinfer.serving.chat.tool_parsers import FunctionSpec, ToolCallStream
from deepinfer.serving.chat.tool_parsers.hermes import HermesToolParser
from deepinfer.serving.chat.tool_parsers.lenient import LenientToolParser
from deepinfer.serving.chat.tool_parsers.schema_check import matches_schema

TOOLS = [WEATHER, ADD]
FUNCTIONS = [FunctionSpec(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
W = '{"city": "Paris", "unit": "celsius"}'
CALL = f'{{"name": "get_weather", "arguments": {W}}}'

ACCEPTED = {  # answer -> (name, arguments)
    "fenced": (f"```json\n{CALL}\n```", ("get_weather", W)),
    "fenced, no info string": (f"```\n{CALL}\n```\n", ("get_weather", W)),
    "fenced, closing fence left out": (f"```json\n{CALL}\n", ("get_weather", W)),
    "bare": (CALL, ("get_weather", W)),
    "bare, spaced, parameters key": ('\n  {"name": "add", "parameters": {"a": 2, "b": 40}}\n',
                                     ("add", '{"a": 2, "b": 40}')),
    "tagged": (f"<tool_call>\n{CALL}\n</tool_call>", ("get_weather", W)),
}
REJECTED = {  # answers that stay content, whole
    "prose with JSON": f'The API returns {CALL} when asked.',
    "prose before a fence": f"Here you go:\n```json\n{CALL}\n```",
    "JSON that is not a call": '{"city": "Paris", "unit": "celsius"}',
    "unknown name": f'{{"name": "get_time", "arguments": {W}}}',
    "arguments that do not validate": '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',
    "missing a required argument": '```json\n{"name": "add", "arguments": {"a": 1}}\n```',
    "text after the call": f"{CALL}\nThat is the call I would make.",
    "another language's fence": f"```python\n{CALL}\n```",
    "inline code": "`x` is a variable",
    "an open object": f'{CALL[:-12]}',
}


def _parser() -> LenientToolParser:
    return LenientToolParser(HermesToolParser(), FUNCTIONS)


def _streamed(text: str) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], content sent before the final feed) of `text` fed one character at a time."""
    stream, content, calls = ToolCallStream(_parser()), "", {}
    for i, char in enumerate(text + "\0"):
        delta, deltas = stream.feed("" if char == "\0" else char, final=i == len(text))
        early = content if i == len(text) else None
        content += delta
        for d in deltas:
            entry = calls.setdefault(d["index"], ["", ""])
            entry[0] = d["function"].get("name", entry[0])
            entry[1] += d["function"].get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)], early


@pytest.mark.parametrize("shape", ACCEPTED)
def test_accepted_shapes_are_calls_whole_and_streamed(shape):
    text, (name, arguments) = ACCEPTED[shape]
    parsed = _parser().parse(text)
    assert parsed.content is None and [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == [
        (name, arguments)], parsed  # main (the Hermes parser alone): content for all but the tagged call
    content, calls, _ = _streamed(text)
    assert (content.strip(), calls) == ("", [(name, arguments)])


@pytest.mark.parametrize("shape", REJECTED)
def test_rejected_shapes_stay_content_whole_and_streamed(shape):
    text = REJECTED[shape]
    parsed = _parser().parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])
    content, calls, early = _streamed(text)
    assert (content, calls) == (text, [])
    if shape != "an open object":  # could still have become a call until the end
        assert early.strip(), "held back until the end"


def test_a_possible_call_is_held_back_while_streamed():
    stream = ToolCallStream(_parser())
    text = f"```json\n{CALL}\n```"
    assert all(stream.feed(char) == ("", []) for char in text)
    content, deltas = stream.feed("", final=True)
    assert content == "" and [d["function"]["name"] for d in deltas] == ["get_weather"]


@pytest.mark.parametrize("value, ok", [
    ({"city": "Paris", "unit": "celsius"}, True), ({"city": "", "unit": "celsius"}, False),
    ({"city": "Paris"}, False), ({"city": "Paris", "unit": "celsius", "x": 1}, False),
    ({"city": 3, "unit": "celsius"}, False), ({"city": "Paris", "unit": True}, False)])
def test_schema_check(value, ok):
    assert matches_schema(value, WEATHER["function"]["parameters"]) is ok


def test_schema_check_bounds_refs_and_unions():
    schema = {"type": "object", "properties": {"n": {"$ref": "#/$defs/small"}, "v": {"anyOf": [
        {"type": "null"}, {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]}},
        "$defs": {"small": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10}}}
    assert matches_schema({"n": 9, "v": None}, schema) and matches_schema({"n": 0, "v": [1, 2]}, schema)
    assert not matches_schema({"n": 10}, schema) and not matches_schema({"n": True}, schema)
    assert not matches_schema({"v": [1, 2, 3]}, schema) and not matches_schema({"v": ["a"]}, schema)


def test_schema_check_is_bounded_on_hostile_schemas(monkeypatch):
    """The client's schema is never compiled in auto mode: a `$ref` inside an `anyOf` of itself would
    make the walk exponential, and `$defs` that is not an object must not raise. Both end in "no"."""
    import deepinfer.serving.chat.tool_parsers.schema_check as schema_check

    visits = 0
    walk = schema_check._matches

    def counted(*args):
        nonlocal visits
        visits += 1
        return walk(*args)

    monkeypatch.setattr(schema_check, "_matches", counted)
    loop = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}] * 3}}, "$ref": "#/$defs/a"}
    assert not matches_schema({"x": 1}, loop)
    assert visits <= schema_check.MAX_STEPS + 1
    assert not matches_schema({"x": 1}, {"$defs": [1], "$ref": "#/$defs/a"})
    assert not matches_schema({"x": 1}, {"definitions": "x", "$ref": "#/definitions/a"})


# -- the server: the tiny model's answer forced to each shape (the session's hermes_server) -------


SERVED = [("fenced", True), ("bare", True), ("tagged", True), ("prose with JSON", False),
          ("unknown name", False)]


def _exactly(text: str) -> str:
    """A regex (llguidance's syntax) matching `text` only."""
    return "".join(c if c.isalnum() or c == " " else f"\\x{{{ord(c):x}}}" for c in text)


def _ask(client, text: str, stream: bool):
    request = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                   tool_choice="auto", temperature=0, max_tokens=200, extra_body={"guided_regex": _exactly(text)})
    if not stream:
        message = client.chat.completions.create(**request).choices[0].message
        return message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    content, calls = "", {}
    for chunk in client.chat.completions.create(stream=True, **request):
        content += chunk.choices[0].delta.content or ""
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, [d.function.name, ""])
            entry[1] += d.function.arguments or ""
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("shape, is_call", SERVED, ids=[s for s, _ in SERVED])
def test_served_answers_in_auto_mode(hermes_server, shape, is_call):
    text, call = ACCEPTED[shape] if is_call else (REJECTED[shape], None)
    client = hermes_server.openai()
    whole = _ask(client, text, stream=False)
    assert whole == ((None, [call]) if is_call else (text, [])), whole  # main: fenced and bare are content
    assert _ask(client, text, stream=True) == whole
    if is_call:
        json.loads(whole[1][0][1])
