"""Forced calls that end, and complete calls kept when an answer is cut, in every tool-call format:

- the forced grammar lets the model end after each complete call, with a newline (or two blank
  characters) before its EOS; the template's separator leads into another call only when parallel
  calls are allowed, and a newline alone commits to nothing (a real Qwen writes `</tool_call>`,
  `\\n`, then EOS: read as "another call", it wrote calls until max_tokens);
- an answer max_tokens cut after three complete calls and inside a fourth has three calls and
  finish_reason "length", whole and streamed, in the chat, Responses, Anthropic and Ollama shapes;
- a stream cut anywhere never sends arguments that do not parse.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from agent_models import ADD, WEATHER

from deepinfer.entrypoints.openai.messages_output import MessageContext, MessageEvents
from deepinfer.entrypoints.openai.ollama_output import OllamaReply
from deepinfer.entrypoints.openai.openai_output import ChatFormatter
from deepinfer.entrypoints.openai.responses_output import output_items, status_of
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.serving.chat.output import ChatOutputPlan
from deepinfer.serving.chat.tool_parsers import TOOL_PARSERS, FunctionSpec, ToolCallStream
from deepinfer.serving.chat.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

EOS = 2
FUNCTIONS = [FunctionSpec(t["function"]["name"], t["function"]["parameters"]) for t in (WEATHER, ADD)]
W = '{"city": "Paris", "unit": "celsius"}'
A = '{"a": 2, "b": 3}'


def _ds(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


# format -> (one call as its template writes it, another, the separator between them,
#            the section around the calls: (before, after))
CALLS = {
    "hermes": (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
               f'<tool_call>\n{{"name": "add", "arguments": {A}}}\n</tool_call>', "\n", ("", "")),
    "llama3_json": (f'{{"name": "get_weather", "parameters": {W}}}', f'{{"name": "add", "parameters": {A}}}', "; ",
                    ("", "")),
    "mistral": (f"[TOOL_CALLS]get_weather[ARGS]{W}", f"[TOOL_CALLS]add[ARGS]{A}", "", ("", "")),
    "mistral_list": (f'{{"name": "get_weather", "arguments": {W}}}', f'{{"name": "add", "arguments": {A}}}', ", ",
                     ("[TOOL_CALLS][", "]")),
    "deepseek_v3": (_ds("get_weather", W), _ds("add", A), "\n", (CALLS_BEGIN, CALLS_END)),
}


def _parser(name: str):
    if name == "mistral_list":
        return TOOL_PARSERS["mistral"]()
    return TOOL_PARSERS[name](chat_template="[ARGS]" if name == "mistral" else "")


def _answer(name: str, num_calls: int, blank: str = "") -> str:
    """`num_calls` calls (alternating functions) as the format writes them, `blank` before the closing marker."""
    first, second, separator, (before, after) = CALLS[name]
    calls = separator.join((first, second)[i % 2] for i in range(num_calls))
    return before + calls + blank + after


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer_dir):
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[EOS])


def _accepts(ll_tokenizer, grammar: str, text: str, then_eos: bool = True) -> bool:
    """Whether the grammar takes `text` (tokenized as the model would write it), then EOS."""
    import llguidance

    tokenizer, ll = ll_tokenizer
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not matcher.consume_token(token):
            return False
    return not then_eos or matcher.consume_token(EOS)


@pytest.mark.parametrize("name", CALLS)
def test_a_forced_answer_may_end_after_each_complete_call(ll_tokenizer, name):
    parser = _parser(name)
    for parallel in (False, True):
        grammar = parser.call_grammar(FUNCTIONS, parallel)
        assert _accepts(ll_tokenizer, grammar, _answer(name, 1)), (name, parallel)
        for blank in ("\n", " \n", "\n\n"):  # a newline (or two blanks) and then EOS ends the answer
            assert _accepts(ll_tokenizer, grammar, _answer(name, 1) + blank), (name, parallel, blank)
        assert not _accepts(ll_tokenizer, grammar, _answer(name, 1) + "\n\n\n")  # blanks do not run on
        assert _accepts(ll_tokenizer, grammar, _answer(name, 2)) == parallel, (name, parallel)
        assert _accepts(ll_tokenizer, grammar, _answer(name, 3) + "\n") == parallel, (name, parallel)


@pytest.mark.parametrize("name", ["hermes", "deepseek_v3"])
def test_a_newline_after_a_call_does_not_commit_to_another(ll_tokenizer, name):
    """The template writes "\\n" between calls: after it both EOS and the next call are allowed."""
    parser = _parser(name)
    grammar = parser.call_grammar(FUNCTIONS, parallel=True)
    before, after = CALLS[name][3]
    one_and_newline = before + CALLS[name][0] + "\n"
    assert _accepts(ll_tokenizer, grammar, one_and_newline + after)  # ends: one call
    assert _accepts(ll_tokenizer, grammar, one_and_newline + CALLS[name][1] + after)  # or goes on into a second
    assert len(parser.parse(one_and_newline + after).tool_calls) == 1
    assert len(parser.parse(one_and_newline + CALLS[name][1] + after).tool_calls) == 2


def test_hermes_newline_then_eos_is_one_call_and_newline_call_is_two(ll_tokenizer):
    parser = TOOL_PARSERS["hermes"]()
    call = CALLS["hermes"][0]
    for parallel in (False, True):
        grammar = parser.call_grammar(FUNCTIONS, parallel)
        assert _accepts(ll_tokenizer, grammar, call + "\n")
        assert _accepts(ll_tokenizer, grammar, call + "\n<tool_call>", then_eos=False) == parallel
    assert len(parser.parse(call + "\n").tool_calls) == 1


def _walk(ll_tokenizer, grammar: str, rng: np.random.Generator, eos_chance: float) -> str:
    """Tokens drawn uniformly from what the grammar allows (EOS at `eos_chance` when allowed) until EOS."""
    import llguidance

    tokenizer, ll = ll_tokenizer
    matcher, ids = llguidance.LLMatcher(ll, grammar, log_level=0), []
    while True:
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(mask[:len(tokenizer)])
        token = EOS if mask[EOS] and rng.random() < eos_chance else int(rng.choice(allowed))
        assert matcher.consume_token(token) and len(ids) < 600, matcher.get_error()
        if token == EOS:
            return tokenizer.decode(ids)
        ids.append(token)


@pytest.mark.parametrize("name", CALLS)
def test_random_walks_of_forced_grammars_end_and_parse(ll_tokenizer, name):
    """Every walk ends, and its calls parse (one when parallel calls are off; that more may follow is
    test_a_forced_answer_may_end_after_each_complete_call's)."""
    parser, rng = _parser(name), np.random.default_rng(7)
    for parallel in (False, True):
        grammar = parser.call_grammar(FUNCTIONS, parallel)
        for _ in range(4):
            text = _walk(ll_tokenizer, grammar, rng, eos_chance=1 / 3)
            calls = parser.parse(text).tool_calls
            assert calls and (parallel or len(calls) == 1), text


# -- answers max_tokens cut ------------------------------------------------------------------------


def _cut_answer(name: str) -> str:
    """Three complete calls and the start of a fourth, cut inside its arguments."""
    first, second, separator, (before, _) = CALLS[name]
    fourth = separator + second
    return before + separator.join((first, second, first)) + fourth[:fourth.index('"a": ') + len('"a": ')]


@pytest.mark.parametrize("name", CALLS)
def test_a_cut_answer_keeps_its_complete_calls(name):
    parser, text = _parser(name), _cut_answer(name)
    cut = parser.parse(text, cut=True)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in cut.tool_calls] == \
        [("get_weather", json.loads(W)), ("add", json.loads(A)), ("get_weather", json.loads(W))]
    assert cut.content is None
    assert parser.parse(text).tool_calls == []  # an answer that stopped so is no call section: all content


def _outputs(text: str, pieces: list[int], finish_reason: str) -> list[CompletionOutput]:
    """The steps of one streamed completion: its text cut at `pieces` (ends of each step), then finished."""
    steps, start = [], 0
    for i, end in enumerate([*pieces, len(text)]):
        last = i == len(pieces)
        steps.append(CompletionOutput(0, text[:end], token_ids=list(range(end)), delta_text=text[start:end],
                                      delta_token_ids=[0] * (end - start), finish_reason=finish_reason if last
                                      else None))
        start = end
    return steps


def _request(c: CompletionOutput) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [c], finished=c.finished)


def test_every_api_returns_the_complete_calls_of_a_cut_answer():
    plan = ChatOutputPlan(TOOL_PARSERS["hermes"]())
    (c,) = _outputs(_cut_answer("hermes"), [], "length")
    names = ["get_weather", "add", "get_weather"]
    chat = ChatFormatter("id", "m", None, 3, None, plan=plan).final(_request(c))["choices"][0]
    assert chat["finish_reason"] == "length" and chat["message"]["content"] is None
    assert [call["function"]["name"] for call in chat["message"]["tool_calls"]] == names
    message = MessageContext("id", "m", 3).message(plan.read(c), _request(c))
    assert message["stop_reason"] == "max_tokens"
    assert [(b["type"], b["name"]) for b in message["content"]] == [("tool_use", n) for n in names]
    items = output_items(plan.read(c), status_of(_request(c)))
    assert status_of(_request(c)) == "incomplete"
    assert [(i["type"], i["name"], i["status"]) for i in items] == [("function_call", n, "completed") for n in names]
    ollama = OllamaReply("m", True, plan, 3).whole(_request(c))
    assert ollama["done_reason"] == "length"
    assert [call["function"]["name"] for call in ollama["message"]["tool_calls"]] == names


def _streamed_calls(parser, text: str, cut: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """([(name, arguments)], the content pieces) of `text` streamed one character a step, then ended."""
    stream, calls, content = ToolCallStream(parser), [], []
    for i, char in enumerate([*text, ""]):
        piece, deltas = stream.feed(char, final=i == len(text), cut=cut)
        content.append(piece)
        for delta in deltas:
            assert delta["index"] == len(calls) and set(delta) == {"index", "id", "type", "function"}
            calls.append((delta["function"]["name"], delta["function"]["arguments"]))
    return calls, content


@pytest.mark.parametrize("name", CALLS)
def test_a_stream_cut_anywhere_sends_only_arguments_that_parse(name):
    """Every prefix of a three-call answer, streamed and cut there: each sent call's arguments parse,
    and the calls are those of the whole cut answer."""
    parser, text = _parser(name), _answer(name, 3)
    for end in range(len(text) + 1):
        calls, _ = _streamed_calls(parser, text[:end], cut=True)
        for _, arguments in calls:
            assert isinstance(json.loads(arguments), dict), (text[:end], arguments)
        whole = parser.parse(text[:end], cut=True).tool_calls
        assert calls == [(c.function.name, c.function.arguments) for c in whole], text[:end]


def test_every_api_streams_the_complete_calls_of_a_cut_answer():
    plan, text = ChatOutputPlan(TOOL_PARSERS["hermes"]()), _cut_answer("hermes")
    names = ["get_weather", "add", "get_weather"]
    pieces = list(range(1, len(text), 3))
    formatter = ChatFormatter("id", "m", None, 3, None, plan=plan)
    chunks = [formatter.chunk(_request(c)) for c in _outputs(text, pieces, "length")]
    arguments: dict[int, str] = {}
    for chunk in filter(None, chunks):
        for delta in chunk["choices"][0]["delta"].get("tool_calls", []):
            arguments[delta["index"]] = arguments.get(delta["index"], "") + delta["function"]["arguments"]
    assert [json.loads(arguments[i]) for i in sorted(arguments)] == [json.loads(a) for a in (W, A, W)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    events = MessageEvents(MessageContext("id", "m", 3), plan.stream())
    sent = [e for c in _outputs(text, pieces, "length") for e in events.step(_request(c))]
    blocks = [e["content_block"]["name"] for e in sent if e["type"] == "content_block_start"]
    inputs = [json.loads(e["delta"]["partial_json"]) for e in sent if e["type"] == "content_block_delta"]
    assert blocks == names and len(inputs) == 3
    assert next(e for e in sent if e["type"] == "message_delta")["delta"]["stop_reason"] == "max_tokens"

    reply = OllamaReply("m", True, plan, 3)
    lines = [line for c in _outputs(text, pieces, "length") for line in reply.step(_request(c))]
    calls = [call["function"]["name"] for line in lines for call in line["message"].get("tool_calls", [])]
    assert calls == names and lines[-1]["done_reason"] == "length"
