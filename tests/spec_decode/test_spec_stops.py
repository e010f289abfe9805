"""Inside a verified run, stops apply token by token exactly as in plain decoding: EOS and stop
ids, stop strings, max_tokens; logprobs of accepted tokens are the target model's."""

from __future__ import annotations

import pytest
from spec_helpers import ScriptedDrafter

from deepinfer import LLM, SamplingParams

K = 5
VOCAB = 1024
PROMPTS = [[5, 17, 99, 256, 31, 7, 8], [400, 401, 402, 17, 99]]


@pytest.fixture(scope="module")
def llms(tiny_checkpoint):
    path = tiny_checkpoint("qwen2", vocab_size=VOCAB)
    plain = LLM(path, max_num_seqs=4)
    spec = LLM(path, max_num_seqs=4, speculative_method="ngram", num_speculative_tokens=K)
    long = plain.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, long, strict=True)}
    spec.engine.runner.steps.drafter = ScriptedDrafter(truth, K, VOCAB)  # every draft right: runs of k + 1 tokens
    return plain, spec, truth


def _both(llms, params: SamplingParams):
    plain, spec, _ = llms
    a = plain.generate(PROMPTS, params, use_tqdm=False)
    b = spec.generate(PROMPTS, params, use_tqdm=False)
    spec.engine.kv_manager.check_no_leaks()
    return [o.outputs[0] for o in a], [o.outputs[0] for o in b]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                          y.stop_reason)


def test_stop_token_inside_a_verified_run(llms):
    _, _, truth = llms
    stop_id = truth[tuple(PROMPTS[0])][8]  # mid-run of the second verification step
    plain, spec = _both(llms, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id]))
    _same(plain, spec)
    assert spec[0].finish_reason == "stop" and spec[0].stop_reason == stop_id


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_cuts_the_run(llms, max_tokens):
    plain, spec = _both(llms, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    _same(plain, spec)
    assert all(len(o.token_ids) == max_tokens for o in spec)


def test_stop_string_inside_a_verified_run(llms):
    plain_llm, spec_llm, truth = llms
    tok = plain_llm.get_tokenizer()
    text = tok.decode(truth[tuple(PROMPTS[1])][:12])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    plain, spec = _both(llms, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop], ignore_eos=True))
    _same(plain, spec)
    assert spec[1].finish_reason == "stop" and spec[1].stop_reason == stop
    assert len(spec[1].token_ids) < 12  # the tokens after the stop string were dropped


def test_logprobs_of_accepted_tokens_are_the_target_models(llms):
    plain, spec = _both(llms, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3))
    for x, y in zip(plain, spec, strict=True):
        assert x.token_ids == y.token_ids
        for a, b in zip(x.logprobs, y.logprobs, strict=True):
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
            assert [a[t].rank for t in a] == [b[t].rank for t in b]  # verification ranks as plain decoding
        assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3
    _, spec_llm, _ = llms
    assert spec_llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
