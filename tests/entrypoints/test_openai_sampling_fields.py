"""The server's vLLM sampling fields through the official openai client (on the app of `deepinfer
serve` in this process): logit_bias (OpenAI) and the extensions min_tokens,
include_stop_str_in_output, bad_words and prompt_logprobs; bad values are 400s naming the param;
logprobs keep OpenAI's shapes."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import hf_reference

EOS = 2
PROMPT = [5, 17, 301, 44, 9000, 12, 7, 600, 81, 3, 77]


@pytest.fixture(scope="module")
def server(tiny_app_server):
    """The session's tiny llama app (tests/entrypoints/conftest.py)."""
    return tiny_app_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def _complete(client, **kwargs):
    return client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, temperature=0,
                                     **kwargs)


def test_logit_bias_forces_a_token(client, tokenizer):
    out = _complete(client, max_tokens=4, logit_bias={"4321": 100}, logprobs=0)
    assert out.choices[0].text == tokenizer.decode([4321] * 4)
    assert out.choices[0].logprobs.tokens == [tokenizer.decode([4321])] * 4


def test_min_tokens_holds_back_forced_eos(client):
    out = _complete(client, max_tokens=10, logit_bias={str(EOS): 100}, extra_body={"min_tokens": 3})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "stop"
    plain = _complete(client, max_tokens=10, logit_bias={str(EOS): 100})
    assert plain.usage.completion_tokens == 1


def test_bad_words_and_include_stop_str(client, tokenizer):
    cat = tokenizer.encode(" cat", add_special_tokens=False)[0]
    dog = tokenizer.encode(" dog", add_special_tokens=False)[0]
    bias = {str(cat): 100, str(dog): 90}
    banned = _complete(client, max_tokens=3, logit_bias=bias, extra_body={"bad_words": ["cat"]})
    assert banned.choices[0].text == " dog dog dog"
    kept = _complete(client, max_tokens=5, logit_bias=bias, stop=["cat"],
                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " cat" and kept.choices[0].finish_reason == "stop"
    dropped = _complete(client, max_tokens=5, logit_bias=bias, stop=["cat"])
    assert dropped.choices[0].text == " "


def test_prompt_logprobs_match_hf(client, tiny_checkpoint):
    out = _complete(client, max_tokens=1, extra_body={"prompt_logprobs": 2})
    entries = out.model_extra["prompt_logprobs"]
    model = hf_reference(tiny_checkpoint("llama"))
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=torch.tensor([PROMPT])).logits[0].float(), -1)  # [L, V]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for i in range(1, len(PROMPT)):
        entry = entries[i]
        assert abs(entry[str(PROMPT[i])]["logprob"] - float(ref[i - 1, PROMPT[i]])) < 1e-3
        top = [int(t) for t, v in sorted(entry.items(), key=lambda kv: kv[1]["rank"]) if v["rank"] <= 2]
        assert top == torch.topk(ref[i - 1], 2).indices.tolist()
        assert set(entry[str(PROMPT[i])]) == {"logprob", "rank", "decoded_token"}


def test_chat_logprobs_keep_openai_shape(client):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob <= item.top_logprobs[0].logprob + 1e-6


def test_streamed_prompt_logprobs_come_once(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True, "prompt_logprobs": 0}
    with server.client.stream("POST", "/v1/completions", json=body) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    found = [json.loads(e)["prompt_logprobs"] for e in events if "prompt_logprobs" in json.loads(e)]
    assert len(found) == 1 and len(found[0]) == len(PROMPT)


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"5": 101}), ("logit_bias", {"abc": 1}), ("logit_bias", {"10000000": 1}),
    ("logit_bias", {"5": "x"}), ("min_tokens", -1), ("min_tokens", 50), ("bad_words", [""]),
    ("bad_words", "cat"), ("prompt_logprobs", 21), ("include_stop_str_in_output", "yes"),
])
def test_bad_values_are_400_naming_the_param(server, field, value):
    body = {"prompt": PROMPT, "max_tokens": 8, field: value}
    resp = server.client.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field, resp.json()
