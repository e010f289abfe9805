"""vLLM sampling fields: min_tokens, include_stop_str_in_output, logit_bias, bad_words,
prompt_logprobs and `Logprob` ranks, each against an independent reference (HF transformers on
the same tiny random checkpoint, torch's sort, or a token forced by logit_bias)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_reference

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers.logits_processors import banned_token_ids
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata
from deepinfer.outputs import Logprob

EOS = 2  # tiny_models' eos_token_id
PROMPT = [5, 17, 301, 44, 9000, 12, 7, 600, 81, 3, 77, 1200, 4, 55, 900, 31, 18, 2000, 6]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    # max_num_batched_tokens 8 cuts the 19-token prompt into three prefill chunks
    return LLM(tiny_checkpoint("llama"), num_blocks=64, block_size=8, max_model_len=128,
               max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return hf_reference(tiny_checkpoint("llama"))


def _assert_rank(rank: int, row: torch.Tensor, token: int, eps: float = 1e-4) -> None:
    """rank agrees with torch's sort of the reference row [V], up to reference noise: tokens
    within eps of the token's logprob may sit on either side of it."""
    values = torch.sort(row, descending=True).values  # [V]
    v = float(row[token])
    assert int((values > v + eps).sum()) + 1 <= rank <= int((values >= v - eps).sum()), (rank, token)


def _generate(llm, prompt, **fields):
    return llm.generate([prompt], SamplingParams(**fields))[0]


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, named", [
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logit_bias={3: 100.5}), "logit_bias values .* for token id 3"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
    (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
])
def test_bad_values_name_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**fields)


def test_logit_bias_string_keys_become_ids():
    assert SamplingParams(logit_bias={"7": -3}).logit_bias == {7: -3.0}


def test_logit_bias_id_outside_vocab_is_refused_on_add_and_the_batch_runs(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="logit_bias token id 1000000 is outside the vocabulary"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match=r"prompts\[1\]: logit_bias"):
        llm.generate([PROMPT, {"prompt_token_ids": PROMPT}], [SamplingParams(max_tokens=2),
                                                             SamplingParams(max_tokens=2, logit_bias={10**6: 1.0})],
                     use_tqdm=False)
    assert not engine.has_unfinished_requests()
    engine.kv_manager.check_no_leaks()


# ---- logit_bias ----------------------------------------------------------------------------------

def test_logit_bias_plus_100_forces_the_token(llm):
    for temperature in (0.0, 1.0):
        out = _generate(llm, PROMPT, max_tokens=6, temperature=temperature, seed=3, logit_bias={4321: 100})
        assert out.outputs[0].token_ids == [4321] * 6


def test_logit_bias_shifts_greedy_choice_like_the_reference(llm, hf_model):
    """+bias on the runner-up flips greedy exactly when the reference's margin is smaller."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([PROMPT])).logits[0, -1]  # [V]
    top = torch.topk(logits, 2)
    first, second = top.indices.tolist()
    margin = float(top.values[0] - top.values[1])
    assert _generate(llm, PROMPT, max_tokens=1, temperature=0.0,
                     logit_bias={second: margin + 0.05}).outputs[0].token_ids == [second]
    assert _generate(llm, PROMPT, max_tokens=1, temperature=0.0,
                     logit_bias={second: max(0.0, margin - 0.05)}).outputs[0].token_ids == [first]


# ---- min_tokens ----------------------------------------------------------------------------------

def test_min_tokens_masks_eos_forced_by_bias(llm):
    out = _generate(llm, PROMPT, max_tokens=10, temperature=0.0, min_tokens=4, logit_bias={EOS: 100})
    c = out.outputs[0]
    assert c.token_ids[-1] == EOS and len(c.token_ids) == 5 and EOS not in c.token_ids[:4]
    assert c.finish_reason == "stop"
    plain = _generate(llm, PROMPT, max_tokens=10, temperature=0.0, logit_bias={EOS: 100}).outputs[0]
    assert plain.token_ids == [EOS]


def test_min_tokens_masks_stop_token_ids(llm):
    out = _generate(llm, PROMPT, max_tokens=10, temperature=1.0, seed=1, min_tokens=3,
                    stop_token_ids=[777], logit_bias={777: 100})
    assert out.outputs[0].token_ids[3] == 777 and 777 not in out.outputs[0].token_ids[:3]
    assert out.outputs[0].stop_reason == 777


# ---- bad_words -----------------------------------------------------------------------------------

def test_single_token_bad_word_never_emitted_even_as_forced_argmax(llm):
    tok = llm.engine.tokenizer
    word_ids = tok.encode(" hello", add_special_tokens=False)
    plain_ids = tok.encode("hello", add_special_tokens=False)
    assert len(word_ids) == 1 and len(plain_ids) == 1
    bias = {word_ids[0]: 100, plain_ids[0]: 100}
    for temperature in (0.0, 1.0):
        out = _generate(llm, PROMPT, max_tokens=8, temperature=temperature, seed=2, bad_words=["hello"],
                        logit_bias=bias)
        assert not set(out.outputs[0].token_ids) & set(bias), out.outputs[0].token_ids
    forced = _generate(llm, PROMPT, max_tokens=3, temperature=0.0, logit_bias=bias).outputs[0].token_ids
    assert set(forced) <= set(bias)


def test_multi_token_bad_word_bans_only_after_its_prefix():
    params = SamplingParams(bad_words=["x"])
    params._bad_words_token_ids = ((10, 11, 12), (40,))
    assert banned_token_ids(params, [1, 2]) == {40}
    assert banned_token_ids(params, [1, 10, 11]) == {12, 40}
    assert banned_token_ids(params, [10, 11, 5]) == {40}


def test_multi_token_bad_word_never_completed(llm):
    """The word's tokens are each made the argmax in turn; the last one must never follow."""
    tok = llm.engine.tokenizer
    ids = tok.encode(" unbelievably", add_special_tokens=False)
    assert len(ids) >= 2
    bias = {t: 100 - 5 * i for i, t in enumerate(ids)}  # the word's first token wins, then ...
    out = _generate(llm, PROMPT, max_tokens=12, temperature=0.0, bad_words=["unbelievably"], logit_bias=bias)
    tokens = out.outputs[0].token_ids
    n = len(ids)
    assert all(tokens[i:i + n] != ids for i in range(len(tokens))), tokens
    assert ids[-1] in _generate(llm, PROMPT, max_tokens=12, temperature=0.0,
                                logit_bias={ids[-1]: 100}).outputs[0].token_ids


# ---- stop strings --------------------------------------------------------------------------------

def test_include_stop_str_in_output(llm):
    tok = llm.engine.tokenizer
    word = tok.encode(" cat", add_special_tokens=False)[0]
    kw = dict(max_tokens=8, temperature=0.0, logit_bias={word: 100}, stop=["cat"])
    without = _generate(llm, PROMPT, **kw).outputs[0]
    with_stop = _generate(llm, PROMPT, include_stop_str_in_output=True, **kw).outputs[0]
    assert without.text == " " and with_stop.text == " cat"
    assert with_stop.stop_reason == "cat" and with_stop.finish_reason == "stop"


def test_min_tokens_delays_stop_strings(llm):
    tok = llm.engine.tokenizer
    word = tok.encode(" cat", add_special_tokens=False)[0]
    out = _generate(llm, PROMPT, max_tokens=8, temperature=0.0, logit_bias={word: 100}, stop=["cat"],
                    min_tokens=3).outputs[0]
    # as vLLM: the stop check starts with the min_tokens-th token, which completes "cat" again
    assert out.text == " cat cat " and len(out.token_ids) == 3 and out.stop_reason == "cat"


# ---- logprobs and ranks --------------------------------------------------------------------------

def test_logprob_objects_with_exact_ranks(llm, hf_model):
    out = _generate(llm, PROMPT, max_tokens=5, temperature=1.0, seed=7, logprobs=3).outputs[0]
    ref = torch.log_softmax(hf_model(input_ids=torch.tensor([PROMPT + out.token_ids[:-1]])).logits[0].detach(), -1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]  # [V]
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        order = torch.sort(row, descending=True).indices.tolist()
        _assert_rank(entry[token].rank, row, token)
        assert entry[token].decoded_token == llm.engine.tokenizer.decode([token])
        top = sorted((t for t in entry if entry[t].rank <= 3), key=lambda t: entry[t].rank)
        assert top == order[:3]
        assert abs(entry[token].logprob - float(row[token])) < 1e-3


def test_sampler_rank_matches_sort_with_processing():
    """The rank is under the raw logits even when bias changes the choice."""
    torch.manual_seed(0)
    logits = torch.randn(3, 500)  # [N, V]
    params = [SamplingParams(temperature=0.0, logprobs=0, logit_bias={17: 100}) for _ in range(3)]
    md = SamplingMetadata.from_rows(["a", "b", "c"], params, [[1]] * 3, [[]] * 3, "cpu")
    results = Sampler()(logits, md)
    for row, r in zip(logits, results, strict=True):
        assert r.token_id == 17
        assert r.rank == torch.sort(row, descending=True).indices.tolist().index(17) + 1


# ---- prompt_logprobs -----------------------------------------------------------------------------

@pytest.mark.parametrize("num_top", [0, 4])
def test_prompt_logprobs_match_hf_over_chunks(llm, hf_model, num_top):
    out = _generate(llm, PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=num_top)
    ref = torch.log_softmax(hf_model(input_ids=torch.tensor([PROMPT])).logits[0].detach(), -1)  # [L, V]
    entries = out.prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    for i in range(1, len(PROMPT)):
        row, token, entry = ref[i - 1], PROMPT[i], entries[i]
        assert abs(entry[token].logprob - float(row[token])) < 1e-3
        order = torch.sort(row, descending=True).indices.tolist()
        _assert_rank(entry[token].rank, row, token)
        top = sorted((t for t in entry if entry[t].rank <= num_top), key=lambda t: entry[t].rank)
        assert top == order[:num_top]
        for t in top:
            assert abs(entry[t].logprob - float(row[t])) < 1e-3


def test_prompt_logprobs_not_taken_from_a_prefix_hit(llm, hf_model):
    """A second identical prompt would hit the prefix cache; with prompt_logprobs it computes all."""
    first = _generate(llm, PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=1)
    again = _generate(llm, PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=1)
    assert again.num_cached_tokens == 0
    assert [e and {t: round(v.logprob, 4) for t, v in e.items()} for e in again.prompt_logprobs] == \
        [e and {t: round(v.logprob, 4) for t, v in e.items()} for e in first.prompt_logprobs]
    assert _generate(llm, PROMPT, max_tokens=1, temperature=0.0).prompt_logprobs is None
    assert not llm.engine.runner.steps.prompt_logprobs._entries  # nothing kept after the requests ended
    llm.engine.kv_manager.check_no_leaks()


# ---- speculative decoding ------------------------------------------------------------------------

def test_ngram_speculation_keeps_plain_output_with_fields(tiny_checkpoint, llm):
    """Biased toward a phrase the prompt repeats (so n-gram drafts get verified), with a banned
    word and EOS held back by min_tokens: the verified output equals plain decoding's."""
    tok = llm.engine.tokenizer
    phrase = tok.encode(" one two three four five", add_special_tokens=False)
    prompt = PROMPT[:3] + phrase * 3
    fields = dict(max_tokens=16, temperature=0.0, min_tokens=6, bad_words=["three"],
                  logit_bias={**{t: 30.0 for t in phrase}, EOS: 29.0})
    engine = dict(num_blocks=64, block_size=8, max_model_len=128, max_num_batched_tokens=16)
    spec = LLM(tiny_checkpoint("llama"), speculative_method="ngram", num_speculative_tokens=3, **engine)
    got = spec.generate([prompt], SamplingParams(**fields))[0].outputs[0]
    expected = llm.generate([prompt], SamplingParams(**fields))[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert phrase[2] not in got.token_ids and EOS not in got.token_ids[:6]
    metrics = spec.get_metrics()
    assert metrics["spec_decode_num_draft_tokens"] > 0 and metrics["spec_decode_num_accepted_tokens"] > 0


def test_prompt_logprobs_gathered_over_chunks_and_restarted_by_a_recompute():
    """PromptLogprobs alone, with logits = hidden rows: chunks, a recompute from position 0 after
    a preemption, then the sampling chunk hands over every entry once."""
    from deepinfer.contracts.plan import ModelOutput, SampleResult, ScheduledRequest
    from deepinfer.worker.prompt_logprobs import PromptLogprobs

    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    logits = torch.randn(len(prompt), 12, generator=torch.Generator().manual_seed(0))  # [L, V], row p: position p
    collector, params = PromptLogprobs(), SamplingParams(prompt_logprobs=2)

    def chunk(start, end, samples=False):
        s = ScheduledRequest("r", prompt[start:end], start, ([],), sampling_params=params if samples else None,
                             prompt_token_ids=prompt, prompt_logprobs=2)
        collector.collect([(s, 0)], logits[start:end], lambda rows: rows)
        return s

    chunk(0, 4)
    chunk(0, 3)  # preempted and recomputed: starts afresh
    chunk(3, 7)
    last = chunk(7, 10, samples=True)
    output = ModelOutput(samples={"r": [SampleResult(0, 0.0)]})
    collector.attach([last], output)
    entries = output.samples["r"][0].prompt_logprobs
    ref = torch.log_softmax(logits, dim=-1)  # [L, V]
    assert entries[0] is None and len(entries) == len(prompt)
    for i in range(1, len(prompt)):
        (token, lp, rank), *top = entries[i]
        assert token == prompt[i] and abs(lp - float(ref[i - 1, token])) < 1e-5
        _assert_rank(rank, ref[i - 1], token, eps=0.0)
        assert [t for t, _, _ in top] == torch.topk(ref[i - 1], 2).indices.tolist()
    assert not collector._entries
