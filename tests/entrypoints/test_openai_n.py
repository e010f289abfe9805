"""`n` and `best_of` through the app of `deepinfer serve` (in this process), with the official
openai client: n choices indexed 0..n-1 (whole and streamed, each chunk naming its choice), usage
summing every choice's tokens, greedy choices equal to offline greedy generation, best_of refused
with stream, and no KV block left behind by a client that leaves mid-stream (over a real
connection)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from app_server import AppServer
from live_server import openai_client

from deepinfer import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over"
EXTRA = {"ignore_eos": True}  # every choice runs to max_tokens, so usage is known


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with AppServer("--model", tiny_checkpoint("llama"), "--served-model-name", "tiny") as app:
        yield app


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"))


def test_completions_n_whole_and_streamed(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=5, seed=11, logprobs=0,
                                      extra_body=EXTRA)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == 5 and c.finish_reason == "length" for c in whole.choices)
    assert len({c.text for c in whole.choices}) == 3  # sampled: each choice its own
    assert whole.usage.completion_tokens == 15
    texts, finish, usage = defaultdict(str), {}, None
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=5, seed=11, stream=True,
                                           stream_options={"include_usage": True}, extra_body=EXTRA):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finish  # nothing after a choice's finish_reason
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert dict(texts) == {c.index: c.text for c in whole.choices}  # the same seed: the same three samples
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 15


def test_chat_n_greedy_choices_equal_offline_greedy(client, offline):
    messages = [{"role": "user", "content": "Say something."}]
    expected = offline.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    whole = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=6, temperature=0,
                                           extra_body=EXTRA)
    assert [(c.index, c.message.role, c.message.content) for c in whole.choices] == \
        [(0, "assistant", expected), (1, "assistant", expected)]
    assert whole.usage.completion_tokens == 12
    content, roles = defaultdict(str), defaultdict(list)
    for chunk in client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=6,
                                                temperature=0, stream=True, extra_body=EXTRA):
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles[choice.index].append(choice.delta.role)
    assert dict(content) == {0: expected, 1: expected}
    assert dict(roles) == {0: ["assistant"], 1: ["assistant"]}


def test_best_of_returns_n_choices_and_is_refused_with_stream(client):
    from openai import BadRequestError

    out = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=4, best_of=4, seed=5, logprobs=0,
                                    extra_body=EXTRA)
    assert [c.index for c in out.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert sums[0] >= sums[1] - 1e-4  # best first
    assert out.usage.completion_tokens == 8  # the returned choices' tokens
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, best_of=2, stream=True)
    assert info.value.body["param"] == "best_of"
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, n=3, best_of=2)
    assert info.value.body["param"] == "best_of"


def test_no_block_is_left_behind(server):
    server.listen()  # a client that leaves mid-stream needs a real connection
    client = openai_client(server)
    client.completions.create(model="tiny", prompt=PROMPT * 4, n=4, max_tokens=3)
    stream = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=50, stream=True,
                                       extra_body=EXTRA)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream: every sample is aborted
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics.get("deepinfer_kv_cache_usage_perc") == 0.0:
            break
        time.sleep(0.2)
    assert metrics.get("deepinfer_kv_cache_usage_perc") == 0.0, metrics
