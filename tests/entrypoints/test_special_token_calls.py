"""Forced tool calls (and the reasoning section before them) when a format's markers are single
tokens of the tokenizer: added tokens that are special (`[TOOL_CALLS]` in Mistral's files) or not
(Qwen 2.5's `<tool_call>` in a GGUF is USER_DEFINED, an added token that is not special).
llguidance lexes every added token as a special token, so a grammar that spells the marker as a
string never matches it: the grammars must refer to the token by id (`<[id]>`).

Unit tests build each format's grammar against a tokenizer with all markers added, compile it as
the server does and walk it with random allowed tokens; the decoded walk must parse as calls whose
arguments validate. The server tests drive `deepinfer serve` on a tiny random model whose
tokenizer has `<tool_call>`/`</tool_call>` as single tokens and a Hermes/Qwen template, through
the official openai client (whole and streamed, `required` and a named function, 20 seeded random
schemas).
"""

from __future__ import annotations

import json
import os
import random

import jsonschema
import numpy as np
import pytest
from agent_models import ADD, HERMES, WEATHER, random_function, streamed_chat, templated_checkpoint
from app_server import AppServer

from deepinfer.serving.chat.constraints import forced_call
from deepinfer.serving.chat.reasoning import make_reasoning_parser
from deepinfer.serving.chat.tool_parsers import (
    TOOL_PARSERS,
    FunctionSpec,
    make_tool_parser,
    skipped_when_decoded,
)
from deepinfer.serving.chat.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from deepinfer.structured_output import GrammarCompiler

MARKERS = sorted({m for cls in TOOL_PARSERS.values() for m in cls.markers} | {"<think>", "</think>"})
EOS = 2
FUNCTIONS = [FunctionSpec(t["function"]["name"], t["function"]["parameters"]) for t in (WEATHER, ADD)]
TEMPLATE_OF = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS] [ARGS]",
               "deepseek_v3": DeepSeekV3ToolParser.markers[0]}
KINDS = {"added": False, "special": True}  # the markers as added tokens that are not special, or special


def _with_markers(base_dir: str, path: str, special: bool) -> str:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.add_tokens([AddedToken(m, special=special, normalized=False) for m in MARKERS],
                         special_tokens=special)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(KINDS))
def marked_tokenizer(request, tokenizer_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    path = _with_markers(tokenizer_dir, str(tmp_path_factory.mktemp(f"tok-{request.param}")), KINDS[request.param])
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert all(len(tokenizer(m, add_special_tokens=False)["input_ids"]) == 1 for m in MARKERS)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def _walk(rng: np.random.Generator, matcher, vocab_size: int, max_steps: int = 400) -> list[int]:
    """Tokens drawn uniformly from what the grammar allows (EOS one time in three when allowed)."""
    ids = []
    for _ in range(max_steps):
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(mask[:vocab_size])
        token = EOS if mask[EOS] and rng.random() < 1 / 3 else int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        if token == EOS:
            return ids
        ids.append(token)
    raise AssertionError("the walk did not end")


def _check_arguments(call) -> None:
    schema = next(f.parameters for f in FUNCTIONS if f.name == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def _decoded(tokenizer, ids: list[int], marker_ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=not skipped_when_decoded(tokenizer, marker_ids))


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_forced_grammars_refer_to_single_token_markers_by_id(marked_tokenizer, name):
    from deepinfer.structured_output import StructuredOutputsParams

    tokenizer, compiler = marked_tokenizer
    tokenizer.chat_template = TEMPLATE_OF[name]
    parser = make_tool_parser(name, tokenizer)
    assert parser.special_ids == {m: tokenizer.convert_tokens_to_ids(m) for m in parser.markers}
    rng = np.random.default_rng(1)
    for parallel in (False, True):
        grammar = parser.call_grammar(FUNCTIONS, parallel)
        assert not any(json.dumps(marker) in grammar for marker in parser.markers), grammar
        assert any(f"<[{token_id}]>" in grammar for token_id in parser.special_ids.values()), grammar
        compiled = compiler.prepare(StructuredOutputsParams(grammar=grammar))  # main: refused for added tokens
        for _ in range(3):
            ids = _walk(rng, compiled.matcher.deep_copy(), len(tokenizer))
            parsed = parser.parse(_decoded(tokenizer, ids, parser.special_ids.values()))
            assert parsed.tool_calls and (parallel or len(parsed.tool_calls) == 1), tokenizer.decode(ids)
            for call in parsed.tool_calls:
                _check_arguments(call)


def test_llama3_forced_call_may_open_with_the_python_tag_token(marked_tokenizer):
    from deepinfer.structured_output import StructuredOutputsParams

    tokenizer, compiler = marked_tokenizer
    tokenizer.chat_template = TEMPLATE_OF["llama3_json"]
    parser = make_tool_parser("llama3_json", tokenizer)
    tag = tokenizer.convert_tokens_to_ids("<|python_tag|>")
    compiled = compiler.prepare(StructuredOutputsParams(grammar=parser.call_grammar(FUNCTIONS, False)))
    matcher = compiled.matcher.deep_copy()
    assert matcher.consume_token(tag), matcher.get_error()
    rest = _walk(np.random.default_rng(2), matcher, len(tokenizer))
    (call,) = parser.parse(_decoded(tokenizer, [tag, *rest], [tag])).tool_calls
    _check_arguments(call)


def test_reasoning_end_token_opens_the_forced_call(marked_tokenizer):
    """`</think>` as one token ends the reasoning section; the call's `<tool_call>` token follows."""
    tokenizer, compiler = marked_tokenizer
    tokenizer.chat_template = TEMPLATE_OF["hermes"]
    parser, reasoning = make_tool_parser("hermes", tokenizer), make_reasoning_parser("deepseek_r1", tokenizer)
    spec = forced_call(parser.call_grammar(FUNCTIONS, False), reasoning, inside=True)
    matcher = compiler.prepare(spec).matcher.deep_copy()
    ids = [*tokenizer("Paris, so the weather tool.", add_special_tokens=False)["input_ids"],
           tokenizer.convert_tokens_to_ids("</think>"), *tokenizer("\n", add_special_tokens=False)["input_ids"],
           tokenizer.convert_tokens_to_ids("<tool_call>")]
    for token in ids:  # main: the `</think>` token is refused (the grammar spells it)
        assert matcher.consume_token(token), (tokenizer.convert_ids_to_tokens(token), matcher.get_error())
    ids += _walk(np.random.default_rng(3), matcher, len(tokenizer))
    marker_ids = [*parser.special_ids.values(), *reasoning.special_ids.values()]
    text = _decoded(tokenizer, ids, marker_ids)
    reasoning_text, content = reasoning.split(text, inside=True)
    assert reasoning_text == "Paris, so the weather tool."
    (call,) = parser.parse(content).tool_calls
    _check_arguments(call)


# -- the server: a Hermes/Qwen template whose tags are single tokens ---------------------------------


@pytest.fixture(scope="module", params=list(KINDS))
def tag_server(request, tiny_checkpoint, tokenizer_dir, tmp_path_factory):
    base = tiny_checkpoint("llama", vocab_size=49216)
    path = templated_checkpoint(base, str(tmp_path_factory.mktemp(f"tagged-{request.param}")), HERMES)
    _with_markers(tokenizer_dir, path, KINDS[request.param])
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:  # save_pretrained wrote the old one
        f.write(HERMES)
    with AppServer("--model", path, "--served-model-name", "tiny") as server:
        yield server


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _validate(call, tools) -> None:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_calls_whole_and_streamed(tag_server, choice):
    client, tools = tag_server.openai(), [WEATHER, ADD]
    request = dict(model="tiny", messages=QUESTION, tools=tools, tool_choice=choice, parallel_tool_calls=False,
                   temperature=0, max_tokens=150)
    whole = client.chat.completions.create(**request).choices[0]  # main: a 400 (the grammar refused)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    _validate(call, tools)
    if isinstance(choice, dict):
        assert call.function.name == "add"
    content, streamed, finish = streamed_chat(client, **request)
    assert (content.strip(), finish) == ("", "tool_calls")
    assert streamed == [(call.function.name, call.function.arguments)]


@pytest.mark.slow
def test_twenty_random_schemas_give_valid_arguments(tag_server):
    client = tag_server.openai(timeout=300)
    rng = random.Random(39)
    for i in range(20):
        tools = [random_function(random.Random(rng.randrange(1 << 30)), i)]
        stream = i % 2 == 1
        request = dict(model="tiny", messages=QUESTION, tools=tools, tool_choice="required",
                       parallel_tool_calls=False, temperature=1.0, seed=i, max_tokens=400)
        if stream:
            content, calls, finish = streamed_chat(client, **request)
            assert finish == "tool_calls" and not content.strip(), (tools, content)
            ((name, arguments),) = calls
        else:
            answer = client.chat.completions.create(**request).choices[0]
            assert answer.finish_reason == "tool_calls", (tools, answer)
            (call,) = answer.message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        assert name == tools[0]["function"]["name"]
        jsonschema.validate(json.loads(arguments), tools[0]["function"]["parameters"])
