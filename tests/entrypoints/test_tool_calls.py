"""Tool calling: the four parsers on hand-written answers (whole, and streamed split at every
character boundary), their forced-call grammars walked by random tokens, and `deepinfer serve`
on a tiny random model with a hand-written template per format, driven by the official openai
client (a full round trip, streamed and not; a named function; 20 seeded random schemas whose
forced arguments pass jsonschema), bad requests, `LLM.chat(tools=...)` and an openai-agents run.

A random model writes gibberish, so real calls come from forcing them (`tool_choice` "required"
or a named function); free parsing is tested on the hand-written answers.
"""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import numpy as np
import pytest
from agent_models import ADD, TOOL_TEMPLATES, WEATHER, random_function, templated_checkpoint
from app_server import AppServer

from deepinfer.serving.chat.tool_parsers import (
    TOOL_PARSERS,
    FunctionSpec,
    ToolCallStream,
    detect_tool_parser,
)
from deepinfer.serving.chat.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

pytestmark = [pytest.mark.parity]

W = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"text": "a </tool_call> [TOOL_CALLS] } ] \\" \\\\", "n": [1, {"x": null}], "é": "日本"}'


BROKEN = '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'


def _ds(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


# parser -> [(answer, content of the whole answer, [(name, arguments text)])]
ANSWERS = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None, [("get_weather", W)]),
        (f'Let me see.\n<tool_call>\n{{"name": "a", "arguments": {TRICKY}}}\n</tool_call>\n<tool_call>\n'
         f'{{"arguments": {{}}, "name": "b"}}\n</tool_call>\n', "Let me see.", [("a", TRICKY), ("b", "{}")]),
        (f'<tool_call>{{"name": "f", "arguments": {W}}}', None, [("f", W)]),  # closing tag left out
        ("The <tool_ is a tag; <tool_call> too.", "The <tool_ is a tag; <tool_call> too.", []),
        (BROKEN, None, []),  # the object never closes: all content (streamed too: no call was complete)
        ("plain words", "plain words", []),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", W)]),
        (f'<|python_tag|>{{"name": "a", "parameters": {TRICKY}}}; {{"parameters": {{}}, "name": "b"}}', None,
         [("a", TRICKY), ("b", "{}")]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("  The <|python way", "  The <|python way", []),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}]', None, [("get_weather", W)]),
        (f'Sure. [TOOL_CALLS] [{{"name": "a", "arguments": {TRICKY}}}, {{"name": "b", "arguments": {{}}}}]',
         "Sure.", [("a", TRICKY), ("b", "{}")]),
        (f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]b[ARGS]{{}}", None, [("get_weather", W), ("b", "{}")]),
        ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ],
    "deepseek_v3": [
        (f"{CALLS_BEGIN}{_ds('get_weather', W)}{CALLS_END}", None, [("get_weather", W)]),
        (f"Checking.{CALLS_BEGIN}{_ds('a', TRICKY)}\n{_ds('b', '{}')}{CALLS_END}", "Checking.",
         [("a", TRICKY), ("b", "{}")]),
        (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{W}", None, [("f", W)]),  # markers left out
        (f"{CALLS_BEGIN}{CALL_BEGIN}code{SEP}f\n", f"{CALLS_BEGIN}{CALL_BEGIN}code{SEP}f\n", []),
    ],
}
CASES = [(name, *case) for name, cases in ANSWERS.items() for case in cases]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=IDS)
def test_parse_whole_answers(name, text, content, calls):
    parsed = TOOL_PARSERS[name]().parse(text)
    assert parsed.content == (text if not calls else content)
    assert [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)
    for c in parsed.tool_calls:
        json.loads(c.function.arguments)


def _streamed(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of an answer fed in `pieces`, checking the delta shapes."""
    stream, content, calls = ToolCallStream(parser), "", []
    for i, piece in enumerate([*pieces, ""]):
        text, deltas = stream.feed(piece, final=i == len(pieces))
        content += text
        for delta in deltas:
            if "id" in delta:  # a header: the name, first
                assert delta["index"] == len(calls) and delta["type"] == "function" and delta["function"]["name"]
                calls.append([delta["function"]["name"], delta["function"]["arguments"]])
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=IDS)
def test_streams_split_at_every_boundary_add_up_to_the_whole(name, text, content, calls):
    parser = TOOL_PARSERS[name]()
    expected = text if not calls else (content or "")
    for pieces in [list(text), *([text[:k], text[k:]] for k in range(len(text) + 1))]:
        got_content, got_calls = _streamed(parser, pieces)
        assert got_calls == calls, pieces
        assert got_content.strip() == expected.strip() if calls else got_content == expected, pieces


def test_a_call_is_streamed_whole_once_it_is_complete():
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    assert stream.feed('Hi <tool_call>\n{"name": "get_wea') == ("Hi", [])
    assert stream.feed('ther", "arguments": {"city": "Pa') == ("", [])  # its arguments do not parse yet
    assert stream.feed('ris"}}\n</tool_') == ("", [])
    content, deltas = stream.feed('call>')
    assert content == "" and deltas == [{"index": 0, "id": deltas[0]["id"], "type": "function",
                                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_parsers_are_detected_from_chat_templates(tokenizer_dir):
    for name, template in TOOL_TEMPLATES.items():
        assert detect_tool_parser(template).name == name
    with open(f"{tokenizer_dir}/chat_template.jinja") as f:
        assert detect_tool_parser(f.read()) is None  # ChatML without tools


# -- forced-call grammars, walked by random tokens ------------------------------------------------

FUNCTIONS = [FunctionSpec(t["function"]["name"], t["function"]["parameters"]) for t in (WEATHER, ADD)]


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer_dir):
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[2])


def _random_walk(rng: np.random.Generator, matcher, vocab_size: int, max_steps: int = 400) -> list[int]:
    """Tokens drawn uniformly from what the grammar allows (EOS one time in three when allowed)."""
    ids = []
    for _ in range(max_steps):
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(mask[:vocab_size])
        token = 2 if mask[2] and rng.random() < 1 / 3 else int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        if token == 2:
            return ids
        ids.append(token)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_forced_grammars_only_allow_calls_that_parse_and_validate(ll_tokenizer, name):
    import llguidance

    tokenizer, ll = ll_tokenizer
    parser = TOOL_PARSERS[name](chat_template="[ARGS]" if name == "mistral" else "")
    rng = np.random.default_rng(0)
    for parallel in (False, True):
        grammar = parser.call_grammar(FUNCTIONS, parallel)
        for _ in range(4):
            matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
            parsed = parser.parse(tokenizer.decode(_random_walk(rng, matcher, len(tokenizer))))
            assert parsed.tool_calls and (parallel or len(parsed.tool_calls) == 1)
            for call in parsed.tool_calls:
                schema = next(f.parameters for f in FUNCTIONS if f.name == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), schema)


# -- the server, one per format --------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(TOOL_TEMPLATES))
def tool_server(request, tiny_checkpoint, tmp_path_factory):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp(request.param)),
                                TOOL_TEMPLATES[request.param])
    with AppServer("--model", path, "--served-model-name", "tiny") as server:
        server.parser = request.param
        yield server


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
EOS = 2  # the tokenizer's <|im_end|>


def _validate(call, tools) -> None:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def _stream_calls(client, **request) -> tuple[str, list, str]:
    """(content, [(id, name, arguments)], finish_reason) of a streamed answer, from its deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, [delta.id, delta.function.name, ""])
            entry[2] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_round_trip_whole_and_streamed(tool_server):
    client, tools = tool_server.openai(), [WEATHER, ADD]
    request = dict(model="tiny", messages=QUESTION, tools=tools, tool_choice="required", parallel_tool_calls=False,
                   temperature=0, max_tokens=150)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    _validate(call, tools)
    assert call.type == "function" and (len(call.id) == 9 if tool_server.parser == "mistral" else call.id)
    content, streamed, finish = _stream_calls(client, **request)
    assert (content.strip(), finish) == ("", "tool_calls")
    assert [(name, arguments) for _, name, arguments in streamed] == [(call.function.name, call.function.arguments)]

    history = [*QUESTION, whole.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    rendered = tool_server.client.post("/tokenize", json={"messages": history, "tools": tools}).json()
    text = tool_server.client.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    arguments = json.loads(call.function.arguments)  # as the template writes them (tojson escapes non-ASCII)
    assert "22 degrees and sunny" in text
    assert json.dumps(arguments) in text or json.dumps(arguments, ensure_ascii=False) in text
    final = client.chat.completions.create(model="tiny", messages=history, tools=tools, temperature=0, max_tokens=8)
    assert final.choices[0].message.role == "assistant" and final.usage.prompt_tokens == rendered["count"]
    content, _, finish = _stream_calls(client, model="tiny", messages=history, tools=tools, temperature=0,
                                       max_tokens=8)
    assert finish in ("stop", "length", "tool_calls")
    if not final.choices[0].message.tool_calls:
        assert content == final.choices[0].message.content


def test_named_function_and_parallel_calls(tool_server):
    client, tools = tool_server.openai(), [WEATHER, ADD]
    named = client.chat.completions.create(model="tiny", messages=QUESTION, tools=tools, temperature=0.8, seed=3,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=100).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["add"], named
    _validate(named.message.tool_calls[0], tools)
    counts = []
    # one or more calls, each valid, ended by the model (EOS is allowed after each); in the second half
    # EOS is discouraged where it is not the only choice, so that the random model goes on into parallel calls
    for seed, bias in [(seed, {}) for seed in range(8)] + [(seed, {str(EOS): -100}) for seed in range(8)]:
        answer = client.chat.completions.create(model="tiny", messages=QUESTION, tools=tools, temperature=1.0,
                                                seed=seed, tool_choice="required", max_tokens=400,
                                                logit_bias=bias).choices[0]
        assert answer.finish_reason == "tool_calls", answer
        for call in answer.message.tool_calls:
            _validate(call, tools)
        counts.append(len(answer.message.tool_calls))
    # DeepSeek's section closes with a marker, not EOS: this random model always closes it after one call
    # (test_forced_call_endings.py walks its grammar into parallel calls)
    assert max(counts) > 1 or tool_server.parser == "deepseek_v3", counts


def test_twenty_random_schemas_give_valid_arguments(tool_server):
    client = tool_server.openai(timeout=300)
    rng = random.Random(2024)
    seeds = [rng.randrange(1 << 30) for _ in range(20)]

    def ask(i: int):
        tools = [random_function(random.Random(seeds[i]), i)]
        answer = client.chat.completions.create(model="tiny", messages=QUESTION, tools=tools, tool_choice="required",
                                                parallel_tool_calls=False, temperature=1.0, seed=i,
                                                max_tokens=400).choices[0]
        return tools, answer

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20)))
    for tools, answer in answers:
        assert answer.finish_reason == "tool_calls", (tools, answer)
        (call,) = answer.message.tool_calls
        assert call.function.name == tools[0]["function"]["name"]
        _validate(call, tools)


# -- bad requests ------------------------------------------------------------------------------------

_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
BAD = [  # (name, extra body fields, param, words in the message)
    ("tool without a name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
    ("name with a space", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "name"),
    ("a name twice", {"tools": [_F, _F]}, "tools", "twice"),
    ("not a function tool", {"tools": [{"type": "web_search"}]}, "tools", "function tool"),
    ("non-object schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools", "object"),
    ("schema not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools", "parameters"),
    ("unknown function field", {"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]},
     "tools", "args"),
    ("tool_choice of an unknown function", {"tools": [_F], "tool_choice": {"type": "function", "function": {
        "name": "g"}}}, "tool_choice", "not in tools"),
    ("tool_choice junk", {"tools": [_F], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("forced call with a bad schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nothing"}}}}}], "tool_choice": "required"},
     "tools", "tools[0].function.parameters"),
    ("arguments in the history not JSON", {"messages": [*QUESTION, {"role": "assistant", "tool_calls": [_CALL]}]},
     "messages", "messages[1].tool_calls[0].function.arguments"),
    ("a call in the history without a function", {"messages": [*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": "x"}]}]}, "messages", "messages[1].tool_calls[0]"),
    ("parallel_tool_calls not a boolean", {"tools": [_F], "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     None),
    ("chat_template_kwargs setting tools", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions", "tools"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_tool_requests_get_a_400_naming_the_field(tool_server, case):
    _, extra, param, words = case
    resp = tool_server.client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and (words is None or words in error["message"]), error


def test_a_template_without_a_tool_format_refuses_tools_but_not_tool_choice_none(tokenizer_dir):
    from transformers import AutoTokenizer

    from deepinfer.serving.chat.prompt import ChatSetup, prepare_chat
    from deepinfer.serving.chat.tool_parsers import make_tool_parser
    from deepinfer.serving.chat.tools import FieldError, tool_plan

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    setup = ChatSetup(make_tool_parser("auto", tokenizer))
    assert setup.tool_parser is None
    with pytest.raises(FieldError, match="--tool-call-parser") as info:
        prepare_chat(tokenizer, setup, QUESTION, tool_plan([WEATHER], "auto"))
    assert info.value.param == "tools"
    chat = prepare_chat(tokenizer, setup, QUESTION, tool_plan([WEATHER], "none"))
    assert chat.structured_output is None and chat.plan.tool_parser is None and chat.prompt_ids


# -- offline, and an agent -----------------------------------------------------------------------------


def test_llm_chat_parses_and_forces_tool_calls(tiny_checkpoint, tmp_path):
    from deepinfer import LLM, SamplingParams
    from deepinfer.serving.chat.tool_parsers import HermesToolParser

    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path / "hermes"), TOOL_TEMPLATES["hermes"])
    with LLM(path) as llm:
        forced = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=150), tools=[WEATHER, ADD],
                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                          use_tqdm=False)[0].outputs[0]
        free = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=6), tools=[WEATHER],
                        use_tqdm=False)[0].outputs[0]
        with pytest.raises(ValueError, match="tool_choice"):
            llm.chat(QUESTION, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    (call,) = forced.tool_calls
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    _validate(call, [WEATHER])
    expected = HermesToolParser().parse(forced.text).tool_calls  # the text stays whole
    assert [(c.function.name, c.function.arguments) for c in expected] == [("get_weather", call.function.arguments)]
    assert free.tool_calls == [] and free.text  # gibberish: no call in it


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_run_with_a_function_tool(tool_server, streamed):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return f"22 degrees {unit} in {city}"

    client = AsyncOpenAI(base_url=f"{tool_server.listen()}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool's help.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=160))
    question, config = "What is the weather in Paris?", RunConfig(tracing_disabled=True)
    if streamed:
        async def run():
            result = Runner.run_streamed(agent, question, max_turns=4, run_config=config)
            async for _ in result.stream_events():  # our tool-call deltas, read by the SDK
                pass
            return result

        result = asyncio.run(run())
    else:
        result = Runner.run_sync(agent, question, max_turns=4, run_config=config)
    assert len(calls) == 1 and calls[0][0] in ("Paris", "Rome")
    assert isinstance(result.final_output, str)  # the second turn (tool_choice reset to auto) answered
