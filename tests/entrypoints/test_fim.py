"""Fill-in-the-middle: `suffix` on /v1/completions and llama.cpp's /infill, on the app in this
process. A tiny llama whose tokenizer has `<|fim_prefix|>`/`<|fim_suffix|>`/`<|fim_middle|>` added
tokens, and a tiny GGUF whose FIM tokens are only in its metadata: the prompt ids the engine gets
are exactly [BOS] + pre + prefix + suf + suffix + mid (by id), and the greedy answer equals a plain
completion of those ids. A model without FIM tokens is a 400 naming suffix / input_suffix. The GGUF's
<|endoftext|>, a control token distinct from its chat EOS (<|im_end|>), ends a middle and is never shown."""

from __future__ import annotations

import shutil

import gguf
import pytest
from app_server import AppServer
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
GGUF_FIM_IDS = (10, 11, 12)  # fillers of the tiny GGUF vocabulary, named FIM tokens only by the metadata
GGUF_CONTROL = {13: "<|endoftext|>", 14: "<|im_end|>"}  # the end of a middle, the chat EOS
ENDOFTEXT, IM_END = 13, 14
PREFIX, SUFFIX = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_dir(tiny_checkpoint, tokenizer_dir, tmp_path_factory) -> str:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("fim") / "model")
    shutil.copytree(tiny_checkpoint("llama", vocab_size=49216), path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in FIM], special_tokens=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(fim_dir):
    with AppServer("--model", fim_dir, "--max-model-len", "128", "--served-model-name", "coder") as server:
        yield server


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    config = tiny_hf_config("llama")
    state = random_hf_model(config).state_dict()
    keys = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.suffix_token_id", "tokenizer.ggml.fim_mid_token_id")
    extra = {key: (i, gguf.GGUFValueType.UINT32) for key, i in zip(keys, GGUF_FIM_IDS, strict=True)}
    extra["tokenizer.ggml.prefix_token_id"] = (GGUF_FIM_IDS[1], gguf.GGUFValueType.UINT32)  # the newer key wins
    extra["tokenizer.ggml.eos_token_id"] = (IM_END, gguf.GGUFValueType.UINT32)  # replaces the writer's
    path = write_gguf(tmp_path_factory.mktemp("fim-gguf") / "tiny.gguf", "llama", config, state, extra=extra,
                      control_tokens=GGUF_CONTROL)
    with AppServer("--model", path, "--max-model-len", "128") as server:
        yield server


def _recorded_prompts(server, monkeypatch) -> list[list[int]]:
    """The prompt ids of every request the engine loop gets from now on."""
    loop, seen = server.app.state.server.engine_loop, []
    add = loop.add

    async def recording(request_id, prompt_ids, *args, **kwargs):
        seen.append(list(prompt_ids))
        return await add(request_id, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(loop, "add", recording)
    return seen


def _post(server, path: str, body: dict, status: int = 200) -> dict:
    resp = server.client.post(path, json=body)
    assert resp.status_code == status, resp.text
    return resp.json()


def _expected(tokenizer, fim_ids, prefix: str, suffix: str) -> list[int]:
    pre, suf, mid = fim_ids
    bos = [tokenizer.bos_token_id] if tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id else []
    plain = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return bos + [pre] + plain(prefix) + [suf] + plain(suffix) + [mid]


def test_suffix_and_infill_build_the_psm_prompt_by_id(server, fim_dir, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fim_dir)
    fim_ids = tokenizer.convert_tokens_to_ids(list(FIM))
    assert fim_ids == [49152, 49153, 49154]
    expected = _expected(tokenizer, fim_ids, PREFIX, SUFFIX)
    seen = _recorded_prompts(server, monkeypatch)
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    fim = _post(server, "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, **greedy})
    plain = _post(server, "/v1/completions", {"prompt": expected, **greedy})
    infill = _post(server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 12,
                                       "temperature": 0, "ignore_eos": True})
    assert seen == [expected, expected, expected]
    assert fim["usage"]["prompt_tokens"] == len(expected)
    assert fim["choices"][0]["text"] == plain["choices"][0]["text"] == infill["content"]
    assert (infill["tokens_evaluated"], infill["tokens_predicted"]) == (len(expected), 12)
    assert (infill["stop"], infill["stop_type"], infill["model"]) == (True, "limit", "coder")
    prefix_ids = tokenizer(PREFIX, add_special_tokens=False)["input_ids"]  # a prefix given as ids is kept as is
    as_ids = _post(server, "/v1/completions", {"prompt": prefix_ids, "suffix": SUFFIX, **greedy})
    assert seen[-1] == expected and as_ids["choices"][0]["text"] == fim["choices"][0]["text"]


def test_infill_extra_context_and_typed_middle(server, fim_dir, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fim_dir)
    plain = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    sep = tokenizer.convert_tokens_to_ids("<file_sep>")  # the default tokenizer's file separator
    seen = _recorded_prompts(server, monkeypatch)
    _post(server, "/infill", {"input_prefix": "x = ", "input_suffix": "\n", "prompt": "1",
                              "input_extra": [{"filename": "util.py", "text": "y = 2\n"}], "n_predict": 2})
    pre, suf, mid = tokenizer.convert_tokens_to_ids(list(FIM))
    head = _expected(tokenizer, (pre, suf, mid), "", "")[:-3]  # the leading special tokens
    assert seen == [head + [sep] + plain("util.py\n") + plain("y = 2\n") + [pre] + plain("x = ") + [suf]
                    + plain("\n") + [mid] + plain("1")]


def test_gguf_metadata_fim_ids(gguf_server, monkeypatch):
    tokenizer = gguf_server.app.state.server.tokenizer
    expected = _expected(tokenizer, GGUF_FIM_IDS, "ab", "ba")
    seen = _recorded_prompts(gguf_server, monkeypatch)
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    fim = _post(gguf_server, "/v1/completions", {"prompt": "ab", "suffix": "ba", **greedy})
    plain = _post(gguf_server, "/v1/completions", {"prompt": expected, **greedy})
    infill = _post(gguf_server, "/infill", {"input_prefix": "ab", "input_suffix": "ba", "n_predict": 6,
                                            "temperature": 0, "ignore_eos": True})
    assert seen == [expected] * 3
    assert fim["choices"][0]["text"] == plain["choices"][0]["text"] == infill["content"]


def test_a_middle_ends_at_endoftext_which_is_not_shown(gguf_server):
    engine = gguf_server.app.state.server.engine
    assert engine.source.hf_config.eos_token_id == IM_END and {ENDOFTEXT, IM_END} <= engine.eos_token_ids
    body = {"prompt": "ab", "suffix": "ba", "max_tokens": 12, "temperature": 0, "logit_bias": {str(ENDOFTEXT): 100}}
    middle = _post(gguf_server, "/v1/completions", {**body, "min_tokens": 2})  # two tokens, then <|endoftext|>
    choice = middle["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], middle["usage"]["completion_tokens"]) == ("stop", None, 3)
    assert "<|endoftext|>" not in choice["text"]
    pushed = {**body, "ignore_eos": True, "max_tokens": 2}  # ignore_eos goes on past it
    shown = _post(gguf_server, "/v1/completions", {**pushed, "skip_special_tokens": False})["choices"][0]
    assert (shown["text"], shown["finish_reason"]) == ("<|endoftext|>" * 2, "length")
    hidden = _post(gguf_server, "/v1/completions", {**pushed, "spaces_between_special_tokens": False})["choices"][0]
    assert (hidden["text"], hidden["finish_reason"]) == ("", "length")
    chat = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(ENDOFTEXT): 100}, "skip_special_tokens": False}
    assert _post(gguf_server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"] == "<|endoftext|>" * 2
    for field, value in (("skip_special_tokens", "no"), ("skip_special_tokens", 0),
                         ("spaces_between_special_tokens", 1.5), ("spaces_between_special_tokens", [True])):
        for path, extra in (("/v1/completions", {"prompt": "ab"}),
                            ("/v1/chat/completions", {"messages": chat["messages"]})):
            error = _post(gguf_server, path, {**extra, field: value}, status=400)["error"]
            assert error["param"] == field, (path, field, value, error)


@pytest.mark.slow
def test_a_model_without_fim_tokens_and_bad_infill_bodies(tiny_checkpoint, server):
    with AppServer("--model", tiny_checkpoint("llama"), "--max-model-len", "96") as plain:
        error = _post(plain, "/v1/completions", {"prompt": "a", "suffix": "b"}, status=400)["error"]
        assert error["param"] == "suffix" and "fill-in-the-middle" in error["message"], error
        error = _post(plain, "/infill", {"input_prefix": "a", "input_suffix": "b"}, status=400)["error"]
        assert error["param"] == "input_suffix" and "fill-in-the-middle" in error["message"], error
        assert _post(plain, "/v1/completions", {"prompt": "a", "suffix": "", "max_tokens": 1})["choices"]
    bad = [({"input_prefix": 1}, "input_prefix"), ({"input_suffix": ["a"]}, "input_suffix"),
           ({"input_extra": [{"filename": "a"}]}, "input_extra"), ({"n_predict": -2}, "n_predict"),
           ({"n_predict": 500}, "n_predict"), ({"temperature": "0"}, "temperature"), ({"stream": True}, "stream"),
           ({"top_p": 0}, "top_p"), ({"bogus": 1}, "bogus"), ({"model": "other"}, "model"),
           ({"input_prefix": "word " * 2000}, "input_prefix")]
    for body, param in bad:
        resp = server.client.post("/infill", json=body)
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, (body, resp.text)
