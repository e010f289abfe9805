"""Structured output: every sequence a random tiny model samples under a regex / choice / JSON
schema / grammar constraint matches it (checked with Python's `re` and the `jsonschema` package,
independently of the grammar engine), also with n-gram speculative decoding and with preemption;
bad specs are refused when the request is added; matchers are freed."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.spec_decode.rejection import RejectionSampler, VerifyRow
from deepinfer.structured_output import StructuredOutputsParams
from deepinfer.worker.structured import StructuredOutputs, unpack_bitmask

CODE = r"[0-9]{3}-[a-z]{2,5}"
LIST = r"(1[0-9]-){6}[0-9]{2}"  # ~25 characters: long enough to preempt and to draft
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
CHOICES = ["positive", "negative", "neutral"]
SPECS = [({"regex": CODE}, lambda t: re.fullmatch(CODE, t)),
         ({"choice": CHOICES}, lambda t: t in CHOICES),
         ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
         ({"grammar": 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[a-c]{1,3}/'},
          lambda t: re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3}){0,2}\)", t)),
         ({"grammar": 'root ::= "x" [0-9] [0-9]? "y"'}, lambda t: re.fullmatch(r"x[0-9]{1,2}y", t))]


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), max_num_seqs=16)


def _check(outputs, match) -> None:
    for out in outputs:
        assert out.error is None, out.error
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.text, completion.finish_reason)
        assert match(completion.text), completion.text


@pytest.mark.parametrize("spec,match", SPECS, ids=["regex", "choice", "json", "lark", "gbnf"])
def test_random_model_samples_only_what_the_spec_allows(tiny_llm, spec, match):
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_output=spec)
              for seed in range(6)]
    params.append(SamplingParams(max_tokens=200, temperature=0.0, structured_output=spec))
    _check(tiny_llm.generate(["Answer:"] * len(params), params, use_tqdm=False), match)
    assert tiny_llm.engine.runner.steps.structured.num_matchers == 0  # finished requests freed theirs


def test_json_object_beside_a_free_request(tiny_llm):
    """json_object gives a JSON object; a request without a spec in the same batch runs as usual."""
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    obj = SamplingParams(max_tokens=200, temperature=0.0, structured_output=StructuredOutputsParams(json_object=True))
    outs = tiny_llm.generate(["Hello", "Data:"], [free, obj], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12 and outs[0].error is None
    completion = outs[1].outputs[0]
    if completion.finish_reason == "stop":  # a random model may not close it within max_tokens
        assert isinstance(json.loads(completion.text), dict)
    else:
        assert completion.text.startswith("{")


BAD = [({"regex": "[0-9"}, "structured_output.regex"),
       ({"json": "{not json"}, "structured_output.json"),
       ({"json": {"type": "nothing"}}, "structured_output.json"),
       ({"json": {"type": "string", "maxLength": -1}}, "structured_output.json"),
       ({"json": 5}, "structured_output.json"),
       ({"choice": []}, "structured_output.choice"),
       ({"choice": ["a", 3]}, "structured_output.choice"),
       ({"grammar": "start: 'a' | "}, "structured_output.grammar"),
       ({"grammar": 42}, "structured_output.grammar"),
       ({"json_object": "yes"}, "structured_output.json_object"),
       ({"regex": "a", "choice": ["a"]}, "exactly one"),
       ({}, "exactly one"),
       ({"schema": {}}, "unknown field 'schema'")]


@pytest.mark.parametrize("spec,field", BAD, ids=[f"{i}-{next(iter(b[0]), 'none')}" for i, b in enumerate(BAD)])
def test_bad_specs_are_refused_naming_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(structured_output=spec)


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens \(3\) cannot be combined with structured_output"):
        SamplingParams(structured_output={"regex": "[ab]"}, min_tokens=3, max_tokens=8)
    assert SamplingParams(structured_output={"regex": "[ab]"}, min_tokens=0).min_tokens == 0


def test_bad_spec_is_refused_at_add_request_and_the_batch_runs(tiny_llm):
    """A spec broken after construction is caught when the request is added, not mid-batch."""
    good = SamplingParams(max_tokens=40, temperature=0.0, structured_output={"regex": CODE})
    bad = SamplingParams(max_tokens=40, temperature=0.0)
    bad.structured_output = {"regex": "([0-9]"}
    with pytest.raises(ValueError, match=r"structured_output\.regex .*'\(\[0-9\]'"):
        tiny_llm.engine.add_request("x", bad)
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutputsParams"):
        SamplingParams(structured_output="[0-9]+")
    with pytest.raises(ValueError, match=r"prompts\[1\]: structured_output\.regex"):
        tiny_llm.generate(["Code:", "Code:"], [good, bad], use_tqdm=False)
    _check(tiny_llm.generate(["Code:"], [good], use_tqdm=False), lambda t: re.fullmatch(CODE, t))
    tiny_llm.engine.kv_manager.check_no_leaks()


def test_abort_frees_the_matcher(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_output={"regex": LIST})
    rid = engine.add_request("Count:", params)
    for _ in range(3):
        engine.step()
    assert engine.runner.steps.structured.num_matchers == 1
    assert engine.abort_request(rid)
    assert engine.runner.steps.structured.num_matchers == 0
    engine.step()  # hands back the abort
    engine.kv_manager.check_no_leaks()


def _greedy_texts(llm, prompts, pattern=LIST):
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output={"regex": pattern})  # LIST: 21 tokens
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check(outs, lambda t: re.fullmatch(pattern, t))
    return [o.outputs[0].token_ids for o in outs]


# the prompts repeat the pattern's pieces, so n-gram lookup proposes drafts (some the grammar refuses)
PROMPTS = ["10-11-12-13-14-15-16 and 10-11-12", "11-11-11-11-11-11-11-11", "19-18-17-16-15-14 then 19-18",
           "ab-ab-ab-12-12-12-ab-ab"]


@pytest.mark.slow
def test_preemption_keeps_the_matchers(tiny_checkpoint, tiny_llm):
    """A pool too small for all requests preempts and recomputes them; the constrained greedy
    outputs equal those of a run without preemption."""
    truth = _greedy_texts(tiny_llm, PROMPTS)
    small = LLM(tiny_checkpoint("llama"), block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=24,
                max_model_len=96, enable_prefix_caching=False)
    assert _greedy_texts(small, PROMPTS) == truth
    assert small.get_metrics()["num_preemptions"] > 0
    assert small.engine.runner.steps.structured.num_matchers == 0
    small.engine.kv_manager.check_no_leaks()


@pytest.mark.slow
def test_ngram_speculation_keeps_greedy_output_and_the_grammar(tiny_checkpoint, tiny_llm):
    """With n-gram drafts verified under the per-row masks, constrained greedy output is the same
    as plain decoding's; drafts were proposed and some were refused."""
    truth = _greedy_texts(tiny_llm, PROMPTS)
    spec = LLM(tiny_checkpoint("llama"), speculative_method="ngram", num_speculative_tokens=3, max_num_seqs=8)
    assert _greedy_texts(spec, PROMPTS) == truth
    metrics = spec.get_metrics()
    assert metrics["spec_decode_num_draft_tokens"] > metrics["spec_decode_num_accepted_tokens"] > 0
    sampled = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured_output={"regex": LIST})
               for s in range(4)]
    _check(spec.generate(PROMPTS, sampled, use_tqdm=False), lambda t: re.fullmatch(LIST, t))
    assert spec.engine.runner.steps.structured.num_matchers == 0


# -- the worker's masks, against the vocabulary itself -------------------------------------------


@pytest.fixture(scope="module")
def structured(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    return StructuredOutputs(tok, [tok.eos_token_id]), tok


def _row(rid, spec, outputs=(), drafts=None, greedy=True):
    params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=None if greedy else 3, structured_output=spec)
    tokens = [outputs[-1] if outputs else 1] + list(drafts or [])
    return ScheduledRequest(rid, tokens, 10, ([],), sampling_params=params, prompt_token_ids=[1],
                            output_token_ids=list(outputs), verify=drafts is not None)


def _allowed(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def test_choice_mask_matches_the_vocabulary(structured):
    """The tokens allowed first are exactly those whose text starts one of the choices."""
    so, tok = structured
    vocab = len(tok)
    logits = torch.zeros(2, vocab)  # [2, V]: row 0 constrained, row 1 free
    masked = so.apply(logits, [_row("a", {"choice": CHOICES}), _row("b", None)])
    pieces = [tok.decode([t]) for t in range(vocab)]
    expected = {t for t, p in enumerate(pieces) if p and any(c.startswith(p) for c in CHOICES)}
    allowed = _allowed(masked)
    assert allowed[0] == expected and len(expected) >= 3
    assert allowed[1] == set(range(vocab)) and torch.equal(masked[1], logits[1])
    # after "positive" the grammar is complete: only EOS
    positive = tok.encode("positive", add_special_tokens=False)
    done = so.apply(logits[:1], [_row("a", {"choice": CHOICES}, outputs=positive)])
    assert _allowed(done) == [{tok.eos_token_id}]
    so.release(["a", "b"])


def test_an_output_token_the_grammar_refuses_names_the_request(structured):
    so, tok = structured
    logits = torch.zeros(1, len(tok))  # [1, V]
    with pytest.raises(ValueError, match="request 'w': output token .* does not fit"):
        so.apply(logits, [_row("w", {"regex": "[0-9]+"}, outputs=tok.encode("a", add_special_tokens=False))])
    so.release(["w"])


def test_unpack_bitmask_bit_order():
    words = torch.tensor([[0b101, -1 << 31]], dtype=torch.int32)  # [1, 2]
    allowed = unpack_bitmask(words, 64)[0].nonzero().flatten().tolist()
    assert allowed == [0, 2, 63]


@pytest.mark.parametrize("greedy", [True, False])
def test_a_forbidden_draft_is_never_accepted(structured, greedy):
    """Drafts "1", then a letter the regex forbids there: the rows' masks follow the drafts, the
    rejection sampler stops at the letter even though every row's logits favour it, and the
    matcher is back where it was (drafts rolled back)."""
    so, tok = structured
    digits, letter = tok.encode("1", add_special_tokens=False), tok.encode("q", add_special_tokens=False)
    assert len(digits) == 1 and len(letter) == 1
    spec = {"regex": r"[0-9]{2}[a-p]{1,3}"}
    drafts = [digits[0], letter[0], digits[0]]
    logits = torch.zeros(4, len(tok))  # [k+1, V]
    logits[:, drafts] = 30.0  # every row prefers the drafts
    before = _allowed(so.apply(logits[:1], [_row("v", spec)]))[0]
    masked = so.apply(logits, [_row("v", spec, drafts=drafts, greedy=greedy)])
    allowed = _allowed(masked)
    assert digits[0] in allowed[0] and letter[0] not in allowed[1] and allowed[2] == allowed[1]
    assert allowed[0] == before == _allowed(so.apply(logits[:1], [_row("v", spec)]))[0]  # rolled back
    row = VerifyRow("v", _row("v", spec, greedy=greedy).sampling_params, [1], [], drafts)
    rejection = RejectionSampler(Sampler(0))
    for _ in range(1 if greedy else 20):
        tokens = [r.token_id for r in rejection(masked, [row])[0]]
        assert tokens[0] == digits[0] and tokens[1] != letter[0] and len(tokens) == 2
        assert re.fullmatch(r"[0-9]", tok.decode(tokens[1:])), tok.decode(tokens[1:])
    so.release(["v"])


# -- compiled completely before admission; a dead end fails its request alone ------------------------

REFUSED = [({"grammar": 'start: "a" start'}, "structured_output.grammar cannot be used"),
           ({"json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
            "structured_output.json cannot be used"),
           ({"regex": "(a{1000}){1000}"}, "structured_output.regex cannot be used"),
           ({"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(5000))}, "structured_output.grammar")]


@pytest.mark.parametrize("spec,words", REFUSED, ids=["recursion", "self-ref", "regex", "wide-row"])
def test_what_llguidance_refuses_is_a_value_error_at_add_time(tiny_llm, spec, words):
    """Each passes validate_grammar but fails in a real matcher: refused before any step runs."""
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        engine.add_request("Answer:", SamplingParams(max_tokens=20, temperature=0.0, structured_output=spec))
    assert len(str(info.value)) < 400 and "<" not in str(info.value)  # llguidance's first lines, no state dump
    assert not engine.has_unfinished_requests()
    engine.kv_manager.check_no_leaks()


def test_a_grammar_whose_first_tokens_bad_words_ban_is_refused_at_add_time(tiny_llm):
    params = SamplingParams(max_tokens=5, structured_output={"choice": ["yes"]}, bad_words=["yes"])
    with pytest.raises(ValueError, match="structured_output.choice allows no first token that bad_words"):
        tiny_llm.engine.add_request("Answer:", params)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_the_grammar_compiled_at_add_time_is_used_by_the_worker(tiny_llm, monkeypatch):
    def no_compile(*args):
        raise AssertionError("the worker compiled a grammar")

    monkeypatch.setattr(tiny_llm.engine.runner.steps.structured, "_compile", no_compile)
    spec = StructuredOutputsParams(regex=CODE)
    outs = tiny_llm.generate(["Code:"], [SamplingParams(max_tokens=40, temperature=0.0, structured_output=spec)],
                             use_tqdm=False)
    _check(outs, lambda t: re.fullmatch(CODE, t))
    assert spec.compiled is not None


def test_a_mask_emptied_mid_generation_fails_that_request_alone_with_one_log_line(tiny_llm, caplog):
    """"hello world" is two tokens; banning the pair leaves the grammar nothing after "hello"."""
    bad = SamplingParams(max_tokens=20, temperature=0.0, structured_output={"choice": ["hello world"]},
                         bad_words=["hello world"])
    good = SamplingParams(max_tokens=40, temperature=0.0, structured_output={"regex": CODE})
    with caplog.at_level("INFO"):
        outs = tiny_llm.generate(["Answer:", "Code:"], [bad, good], use_tqdm=False)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "error" and failed.text == "hello", failed
    assert "every token its structured_output grammar allows is banned by bad_words" in str(outs[0].error)
    _check(outs[1:], lambda t: re.fullmatch(CODE, t))
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].exc_info is None and len(records[0].getMessage().splitlines()) == 1
    tiny_llm.engine.kv_manager.check_no_leaks()
    assert tiny_llm.engine.runner.steps.structured.num_matchers == 0
