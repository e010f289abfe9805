"""Pictures end to end, as a user sends them, for every vision family (LLaVA, Qwen2-VL, Qwen2.5-VL,
Gemma 3): greedy answers equal HF transformers' through `LLM.chat` and through the server (the
OpenAI chat, Responses, Anthropic and Ollama APIs), for PIL pictures of two different sizes (for
Qwen's dynamic resolution: two grids of different sizes).

Each family's checkpoint folder (picture_checkpoints.py) has a tiny random model, its tokenizer with
a chat template and its image processor's preprocessor_config.json. The reference is the HF user
path: the chat template renders the conversation with {"type": "image"} parts, the family's HF
processor makes the model's inputs, `generate` decodes greedily. Text compares exactly (a
byte-level tokenizer).

Also: A, B, A, B through the prefix cache, prefill in chunks, and text-only chats on the vision
checkpoints.
"""

from __future__ import annotations

import os
import sys

import pytest
from picture_checkpoints import MAX_TOKENS, QUESTION, Checkpoint, build_checkpoint, data_url, noise, two_pictures

FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "gemma3")
BLOCK = 8


def asked(picture) -> list[dict]:
    """A user message's content: the question about `picture` (PIL image, or None for HF's part)."""
    image = {"type": "image"} if picture is None else {"type": "image", "image": picture}
    return [image, {"type": "text", "text": QUESTION}]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return build_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def references(checkpoint) -> dict:
    """HF's greedy (ids, text) for each of the two pictures asked about alone, and for no picture."""
    pictures = two_pictures()
    answers = {k: checkpoint.hf_answer(asked(None), [p]) for k, p in enumerate(pictures)}
    answers["text"] = checkpoint.hf_answer([{"type": "text", "text": QUESTION}], [])
    return answers


@pytest.fixture(scope="module")
def llm(checkpoint):
    from deepinfer import LLM

    return LLM(checkpoint.path, dtype="float32", block_size=BLOCK, num_blocks=64, max_model_len=256, max_num_seqs=4)


def _params():
    from deepinfer import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def test_the_two_pictures_decide_the_answer(references):
    """The reference itself: two pictures give two answers, and neither is the text-only one (else
    a model that ignored its pictures would pass)."""
    assert references[0][0] != references[1][0]
    assert references["text"][0] not in (references[0][0], references[1][0])


def test_llm_chat_answers_as_hf_for_pictures_of_two_sizes(checkpoint, llm, references):
    outputs = llm.chat([[{"role": "user", "content": asked(p)}] for p in two_pictures()], _params(), use_tqdm=False)
    if checkpoint.family.startswith("qwen"):  # dynamic resolution: grids of different sizes
        assert len(outputs[0].prompt_token_ids) != len(outputs[1].prompt_token_ids)
    for k, out in enumerate(outputs):
        assert list(out.outputs[0].token_ids) == references[k][0], k
        assert out.outputs[0].text == references[k][1], k


def test_llm_chat_a_large_picture(checkpoint, llm):
    """300x200 pixels: over the tiny Qwen processors' max_pixels (scaled down to a 12x18 grid: 54 tokens), and
    scaled for the others."""
    picture = noise(300, 200, 5)
    want = checkpoint.hf_answer(asked(None), [picture])
    out = llm.chat([{"role": "user", "content": asked(picture)}], _params(), use_tqdm=False)[0]
    assert (list(out.outputs[0].token_ids), out.outputs[0].text) == want


def test_llm_chat_two_pictures_in_one_message(checkpoint, llm):
    first, second = two_pictures()
    content = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "?"}]
    want = checkpoint.hf_answer(content, [first, second])
    content[0]["image"], content[2]["image"] = first, second
    out = llm.chat([{"role": "user", "content": content}], _params(), use_tqdm=False)[0]
    assert (list(out.outputs[0].token_ids), out.outputs[0].text) == want


def _second_turn(picture, answer: str) -> list[dict]:
    """A conversation whose first turn asked about `picture` (None: HF's part) and got `answer`."""
    return [{"role": "user", "content": asked(picture)}, {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "text", "text": "and the colours?"}]}]


def test_llm_chat_second_turn_after_a_picture(checkpoint, llm, references):
    """The picture stays in the history: the second turn reads it again (and its first turn's
    blocks come from the prefix cache)."""
    picture, first = two_pictures()[0], references[0][1]
    want = checkpoint.hf_chat(_second_turn(None, first), [picture])
    got = llm.chat(_second_turn(picture, first), _params(), use_tqdm=False)[0]
    assert (list(got.outputs[0].token_ids), got.outputs[0].text) == want
    assert got.num_cached_tokens > 0


def test_llm_chat_a_known_picture_in_a_new_place(checkpoint, llm, references):
    """A picture encoded before (the encoder-output cache has it) after new text: its rows move to
    new positions (Qwen: new M-RoPE positions), the answer is HF's for the new prompt."""
    picture = two_pictures()[1]
    llm.chat([{"role": "user", "content": asked(picture)}], _params(), use_tqdm=False)
    content = [{"type": "text", "text": "look at this one:"}, {"type": "image"}, {"type": "text", "text": QUESTION}]
    want = checkpoint.hf_answer(content, [picture])
    content[1] = {"type": "image", "image": picture}
    out = llm.chat([{"role": "user", "content": content}], _params(), use_tqdm=False)[0]
    assert (list(out.outputs[0].token_ids), out.outputs[0].text) == want


def test_prefix_cache_a_b_a_b(checkpoint, llm):
    """Picture A, B, A, B (new to this engine) with the same text: each its own HF answer; the
    repeats reuse their own picture's cached blocks, and B never reuses A's picture rows."""
    pictures = [noise(80, 60, 3), noise(50, 110, 4)]
    want = [checkpoint.hf_answer(asked(None), [p])[0] for p in pictures]
    assert want[0] != want[1]
    cached = []
    for k in (0, 1, 0, 1):
        out = llm.chat([{"role": "user", "content": asked(pictures[k])}], _params(), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want[k], k
        cached.append(out.num_cached_tokens)
    placeholder = checkpoint.tokenizer.convert_tokens_to_ids(_placeholder(checkpoint.family))
    first_picture = out.prompt_token_ids.index(placeholder)
    last_picture = len(out.prompt_token_ids) - out.prompt_token_ids[::-1].index(placeholder)
    assert cached[0] <= first_picture and cached[1] <= first_picture  # only the text before the picture
    assert cached[2] >= last_picture // BLOCK * BLOCK > first_picture  # A's own picture rows again
    assert cached[3] >= last_picture // BLOCK * BLOCK


def test_llm_chat_chunked_prefill(checkpoint, references):
    """A token budget of 20 a step: prompts of 50 to 70 tokens are prefilled in chunks (Gemma 3
    keeps its 16-token bidirectional runs whole; the others cut theirs)."""
    from deepinfer import LLM

    llm = LLM(checkpoint.path, dtype="float32", block_size=BLOCK, num_blocks=64, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=20, enable_prefix_caching=False)
    outputs = llm.chat([[{"role": "user", "content": asked(p)}] for p in two_pictures()], _params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [references[0][0], references[1][0]]


def _placeholder(family: str) -> str:
    return {"llava": "<image>", "gemma3": "<image_soft_token>"}.get(family, "<|image_pad|>")


def test_text_only_chat_on_a_vision_checkpoint(llm, references):
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": QUESTION}]}], _params(), use_tqdm=False)[0]
    assert (list(out.outputs[0].token_ids), out.outputs[0].text) == references["text"]
    out = llm.chat([{"role": "user", "content": QUESTION}], _params(), use_tqdm=False)[0]
    assert (list(out.outputs[0].token_ids), out.outputs[0].text) == references["text"]


@pytest.fixture(scope="module")
def server(checkpoint):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
    from app_server import AppServer

    with AppServer("--model", checkpoint.path, "--served-model-name", "tiny", "--dtype", "float32",
                   "--max-model-len", "256") as app:
        yield app


def _ask_openai(server, picture) -> str:
    answer = server.openai().chat.completions.create(
        model="tiny", max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                               {"type": "text", "text": QUESTION}]}])
    return answer.choices[0].message.content


def _ask_responses(server, picture) -> str:
    answer = server.openai().responses.create(
        model="tiny", max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture)},
                                            {"type": "input_text", "text": QUESTION}]}])
    return answer.output_text


def _ask_anthropic(server, picture) -> str:
    source = {"type": "base64", "media_type": "image/png", "data": data_url(picture).split(",", 1)[1]}
    reply = server.client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"}, json={
        "model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source},
                                                  {"type": "text", "text": QUESTION}]}]})
    assert reply.status_code == 200, reply.text
    return "".join(block["text"] for block in reply.json()["content"] if block["type"] == "text")


def _ask_ollama(server, picture) -> str:
    # Ollama's pictures come before the message's text: the order every question here has
    reply = server.client.post("/api/chat", json={
        "model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": MAX_TOKENS},
        "messages": [{"role": "user", "content": QUESTION, "images": [data_url(picture).split(",", 1)[1]]}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["message"]["content"]


def _ask_ollama_generate(server, picture) -> str:
    reply = server.client.post("/api/generate", json={
        "model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": MAX_TOKENS},
        "prompt": QUESTION, "images": [data_url(picture).split(",", 1)[1]]})
    assert reply.status_code == 200, reply.text
    return reply.json()["response"]


APIS = {"openai": _ask_openai, "responses": _ask_responses, "anthropic": _ask_anthropic, "ollama": _ask_ollama,
        "ollama_generate": _ask_ollama_generate}


@pytest.mark.parametrize("api", APIS)
def test_server_answers_as_hf_for_pictures_of_two_sizes(server, references, api):
    for k, picture in enumerate(two_pictures()):
        assert APIS[api](server, picture) == references[k][1], k


def test_server_two_pictures_and_a_second_turn(server, checkpoint, references):
    first, second = two_pictures()
    parts = [{"type": "image_url", "image_url": {"url": data_url(first)}}, {"type": "text", "text": "and"},
             {"type": "image_url", "image_url": {"url": data_url(second)}}, {"type": "text", "text": "?"}]
    want = checkpoint.hf_answer([{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                 {"type": "text", "text": "?"}], [first, second])[1]
    client = server.openai()
    answer = client.chat.completions.create(model="tiny", max_tokens=MAX_TOKENS, temperature=0,
                                            messages=[{"role": "user", "content": parts}])
    assert answer.choices[0].message.content == want
    history = _second_turn(None, references[0][1])
    history[0]["content"] = [{"type": "image_url", "image_url": {"url": data_url(first)}},
                             {"type": "text", "text": QUESTION}]
    answer = client.chat.completions.create(model="tiny", max_tokens=MAX_TOKENS, temperature=0, messages=history)
    assert answer.choices[0].message.content == checkpoint.hf_chat(_second_turn(None, references[0][1]), [first])[1]


def test_server_concurrent_requests_with_pictures(server, references):
    """Four requests at once (pictures 0, 1, 0, 1): batched in the engine, each its own answer."""
    from concurrent.futures import ThreadPoolExecutor

    pictures = two_pictures()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: _ask_openai(server, pictures[k]), (0, 1, 0, 1)))
    assert got == [references[k][1] for k in (0, 1, 0, 1)]


def test_server_streams_the_same_answer(server, references):
    chunks = server.openai().chat.completions.create(
        model="tiny", max_tokens=MAX_TOKENS, temperature=0, stream=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(two_pictures()[1])}},
                                               {"type": "text", "text": QUESTION}]}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == references[1][1]


def test_server_text_only_chat(server, references):
    answer = server.openai().chat.completions.create(model="tiny", max_tokens=MAX_TOKENS, temperature=0,
                                                     messages=[{"role": "user", "content": QUESTION}])
    assert answer.choices[0].message.content == references["text"][1]
