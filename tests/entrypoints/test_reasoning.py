"""Reasoning parsers: a `<think>` section split off into reasoning_content, whole and streamed (split
at every character boundary), grammars that begin only after the section (llguidance walked by
hand-written text), and `deepinfer serve --reasoning-parser deepseek_r1` on a tiny random model whose
template opens the section, through the official openai client (message.reasoning_content,
delta.reasoning_content, a JSON schema and a forced tool call after the section), and `LLM.chat`.

A random model seldom writes `</think>` by itself; the tests that need it push the three tokens of
`</think>` with logit_bias (the grammar still has the last word after the section)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from agent_models import REASONING, WEATHER, templated_checkpoint
from app_server import AppServer

from deepinfer.serving.chat.constraints import ConstrainedOutput, constrained
from deepinfer.serving.chat.reasoning import make_reasoning_parser

pytestmark = [pytest.mark.parity]

R1, QWEN3 = make_reasoning_parser("deepseek_r1"), make_reasoning_parser("qwen3")
CASES = [  # (parser, begins inside, answer, reasoning, content)
    (R1, True, "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
    (R1, True, "<think>\nHmm, 2 + 2</think>4", "\nHmm, 2 + 2", "4"),
    (R1, True, "thinking and never done </thin", "thinking and never done </thin", None),
    (R1, False, "Just the answer <think> here", None, "Just the answer <think> here"),
    (QWEN3, False, "<think>\nplan\n</think>\n\nAnswer: yes", "\nplan\n", "Answer: yes"),
    (QWEN3, False, "No thinking, </think> here", None, "No thinking, </think> here"),
    (QWEN3, False, "  <thi", None, "  <thi"),
    (QWEN3, True, "plan</think>done", "plan", "done"),
]


@pytest.mark.parametrize("parser,inside,text,reasoning,content", CASES)
def test_whole_and_streamed_answers_split_the_same(parser, inside, text, reasoning, content):
    assert parser.split(text, inside) == (reasoning, content)
    for pieces in [list(text), *([text[:k], text[k:]] for k in range(len(text) + 1))]:
        stream, got_reasoning, got_content = parser.stream(inside), "", ""
        for i, piece in enumerate([*pieces, ""]):
            r, c = stream.feed(piece, final=i == len(pieces))
            got_reasoning, got_content = got_reasoning + r, got_content + c
        assert (got_reasoning, got_content) == (reasoning or "", content or ""), pieces


def test_the_prompt_says_whether_the_answer_begins_inside():
    assert R1.inside_at_start("<|im_start|>assistant\n") and not QWEN3.inside_at_start("<|im_start|>assistant\n")
    assert QWEN3.inside_at_start("assistant\n<think>\n") and R1.inside_at_start("assistant\n<think>\n")
    assert not R1.inside_at_start("assistant\n<think>\n\n</think>\n\n")  # a template that turned thinking off


@pytest.fixture(scope="module")
def matcher_for(tokenizer_dir):
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[2])

    def accepts(spec, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, spec.grammar_text, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    return accepts


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def test_a_schema_applies_only_after_the_section(matcher_for):
    from deepinfer.structured_output import StructuredOutputsParams

    inside = constrained(StructuredOutputsParams(json=SCHEMA), R1, inside=True)
    assert isinstance(inside, ConstrainedOutput) and inside.kind == "json"
    assert matcher_for(inside, 'free text, even {"ok": 3} </thi nk>, then</think>\n\n{"ok": true}')
    assert not matcher_for(inside, 'thought</think>{"ok": 3}')
    assert not matcher_for(inside, '{"ok": true}')  # the section must end first
    outside = constrained(StructuredOutputsParams(json=SCHEMA), QWEN3, inside=False)
    assert matcher_for(outside, '{"ok": false}') and matcher_for(outside, '<think>hm</think>\n{"ok": false}')
    assert not matcher_for(outside, 'hm</think>{"ok": false}')


# -- the server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("r1")), REASONING)
    with AppServer("--model", path, "--served-model-name", "tiny", "--reasoning-parser", "deepseek_r1",
                   "--tool-call-parser", "hermes") as app:
        yield app


QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def end_bias(server) -> dict[str, int]:
    ids = server.client.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    return {str(t): 100 for t in ids}


def _streamed(client, **request) -> tuple[str, str, dict, str]:
    """(reasoning, content, {index: [name, arguments]}, finish_reason) from the deltas."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_an_unfinished_section_is_all_reasoning(server):
    client = server.openai()
    request = dict(model="tiny", messages=QUESTION, temperature=0, max_tokens=12)
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content is None and message.reasoning_content
    reasoning, content, _, finish = _streamed(client, **request)
    assert (reasoning, content, finish) == (message.reasoning_content, "", "length")


def test_a_json_schema_after_the_section(server, end_bias):
    client = server.openai()
    for seed in range(2):
        request = dict(model="tiny", messages=QUESTION, temperature=1.0, seed=seed, max_tokens=400,
                       logit_bias=end_bias, response_format={"type": "json_schema", "json_schema": {
                           "name": "answer", "schema": SCHEMA}})
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert "</think>" not in choice.message.reasoning_content
        reasoning, content, _, _ = _streamed(client, **request)
        assert (reasoning, content) == (choice.message.reasoning_content, choice.message.content)


def test_a_forced_tool_call_after_the_section(server, end_bias):
    client = server.openai()
    request = dict(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="required", temperature=1.0,
                   seed=5, max_tokens=400, logit_bias=end_bias, parallel_tool_calls=False)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content, choice
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    reasoning, content, calls, finish = _streamed(client, **request)
    assert (reasoning, content.strip(), finish) == (choice.message.reasoning_content, "", "tool_calls")
    assert calls == {0: [call.function.name, call.function.arguments]}


def test_llm_chat_with_a_reasoning_parser(tiny_checkpoint, tmp_path):
    from deepinfer import LLM, SamplingParams

    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path / "r1"), REASONING)
    with LLM(path) as llm:
        out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=10), reasoning_parser="deepseek_r1",
                       use_tqdm=False)[0].outputs[0]
    assert out.reasoning_content == out.text and out.tool_calls is None  # no </think>: all reasoning
