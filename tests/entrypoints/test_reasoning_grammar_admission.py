"""Grammar admission is the same with and without `--reasoning-parser`. With one, a chat answer's
grammar is "the reasoning section, then the request's grammar", and llguidance builds the part
after the section only when generation reaches it: the refused grammars (endless recursion, a
schema that refers to itself, a regex that blows up, a choice whose only first token bad_words
bans, a forced call of a self-referencing tool) used to be admitted (200) and fail mid-answer.
Now each is the same 400, naming the same param with the same message, on /v1/chat/completions,
/v1/responses and /v1/completions, and a grammar admitted without a parser is admitted with one.
`LLM.chat(..., reasoning_parser=...)` refuses them as `LLM.chat` without one does."""

from __future__ import annotations

import pytest
from test_hostile_inputs import CHAT, CMPL, MSG, SELF_REF, _body, serve

from deepinfer import LLM, SamplingParams
from deepinfer.structured_output import StructuredOutputsParams

RESPONSES = "/v1/responses"
REGEX_BLOWUP = "(a{1000}){1000}"
ENDLESS = 'start: "a" start'  # recursion without a way out
SELF_REF_TOOL = {"type": "function", "function": {"name": "nest", "parameters": SELF_REF}}

REFUSED = [  # (name, path, fields, param)
    ("endless recursion", CHAT, {"guided_grammar": ENDLESS}, "guided_grammar"),
    ("self-ref json_schema", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SELF_REF}}}, "response_format"),
    ("regex blowup", CHAT, {"structured_outputs": {"regex": REGEX_BLOWUP}}, "structured_outputs"),
    ("choice banned by bad_words", CHAT, {"guided_choice": ["yes"], "bad_words": ["yes"]}, "guided_choice"),
    ("forced call of a self-ref tool", CHAT, {"tools": [SELF_REF_TOOL], "tool_choice": "required"}, "tools"),
    ("self-ref text.format", RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x",
                                                             "schema": SELF_REF}}}, "text"),
    ("endless recursion, completions", CMPL, {"guided_grammar": ENDLESS}, "guided_grammar"),
    ("regex blowup, completions", CMPL, {"guided_regex": REGEX_BLOWUP}, "guided_regex"),
]
ADMITTED = [  # (name, path, fields): Earley parsing takes left recursion
    ("left recursion", CHAT, {"guided_grammar": 'start: start "a" | "a"'}),
    ("a schema", RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}}),
]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), max_num_seqs=4)


def _request(path: str, fields: dict) -> dict:
    if path == RESPONSES:
        return {"input": "Answer:", "max_output_tokens": 8, "temperature": 0, **fields}
    return _body(path, fields)


def _answers(llm, monkeypatch, reasoning_parser: str | None) -> list[tuple[int, dict]]:
    """(status, body) of every REFUSED and ADMITTED request, served with `reasoning_parser`."""
    cases = [(path, fields) for _, path, fields, _ in REFUSED] + [(path, fields) for _, path, fields in ADMITTED]

    async def scenario(client):
        return [await client.post(path, json=_request(path, fields)) for path, fields in cases]

    answers = serve(llm, scenario, monkeypatch, reasoning_parser=reasoning_parser, tool_call_parser="hermes")
    return [(resp.status_code, resp.json()) for resp in answers]


@pytest.fixture(scope="module")
def plain(llm):
    """The answers without a reasoning parser: the same for every parser compared with them, served once."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _answers(llm, monkeypatch, None)


@pytest.mark.slow
@pytest.mark.parametrize("reasoning_parser", ["deepseek_r1", "qwen3"])
def test_a_reasoning_parser_refuses_the_same_grammars(llm, plain, monkeypatch, reasoning_parser):
    reasoning = _answers(llm, monkeypatch, reasoning_parser)
    for (name, _, _, param), (status, body), (plain_status, plain_body) in zip(
            REFUSED, reasoning, plain, strict=False):
        assert plain_status == 400 and plain_body["error"]["param"] == param, (name, plain_body)
        assert status == 400, (name, reasoning_parser, status, body)
        assert body["error"] == plain_body["error"], (name, body["error"], plain_body["error"])
    for (name, _, _), (status, body), (plain_status, _) in zip(
            ADMITTED, reasoning[len(REFUSED):], plain[len(REFUSED):], strict=True):
        assert (plain_status, status) == (200, 200), (name, reasoning_parser, body)


@pytest.mark.parametrize("reasoning_parser", [None, "deepseek_r1", "qwen3"])
@pytest.mark.parametrize("spec, words", [
    pytest.param({"regex": REGEX_BLOWUP}, "structured_output.regex cannot be used: lexer error: too many expressions",
                 id="regex blowup", marks=pytest.mark.slow),
    pytest.param({"json": SELF_REF}, "structured_output.json cannot be used: parser error: Too many items",
                 id="self-ref schema"),
])
def test_llm_chat_refuses_the_same_grammars(llm, reasoning_parser, spec, words):
    params = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError) as caught:
        llm.chat(MSG, params, reasoning_parser=reasoning_parser, use_tqdm=False)
    assert words in str(caught.value), str(caught.value)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()
