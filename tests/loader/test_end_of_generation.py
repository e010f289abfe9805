"""The end-of-generation set (`end_of_generation_ids`): GGUF metadata's eos / eot / eom and FIM pad /
repo / separator ids, the GGUF vocabulary's tokens by their text (llama.cpp's rule, GPT-OSS's <|end|>
exception), HF generation_config lists; and the engine, structured output and min_tokens all using it."""

from __future__ import annotations

import gguf
import pytest
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer.contracts.hf_config import end_of_generation_ids
from deepinfer.model_executor.loader.gguf_config import gguf_config_dict


class Vocab:
    """The slice of a transformers tokenizer the set reads: eos_token_id and token <-> id."""

    def __init__(self, tokens: list[str], eos_token_id: int | None = None):
        self.tokens, self.eos_token_id = tokens, eos_token_id
        self.ids = {t: i for i, t in enumerate(tokens)}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.ids.get(token, self.ids.get("<unk>"))

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.tokens[token_id]


def _config(**fields):
    """A GGUF file's config fields (gguf_config_dict) for a tiny llama plus `fields` metadata keys."""
    meta = {"llama.context_length": 64, "llama.block_count": 1, "llama.feed_forward_length": 8,
            "llama.embedding_length": 8, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 40}
    meta.update({f"tokenizer.ggml.{key}": value for key, value in fields.items()})
    return type("Config", (), gguf_config_dict("llama", meta, {"token_embd.weight": (40, 8)}, None))()


def test_gguf_metadata_ids_end_a_generation():
    config = _config(eos_token_id=2, eot_token_id=7, eom_token_id=8, fim_pad_token_id=9, fim_rep_token_id=10,
                     fim_sep_token_id=11, fim_pre_token_id=12, prefix_token_id=13, padding_token_id=14)
    assert (config.eot_token_id, config.eom_token_id, config.fim_pad_token_id, config.fim_sep_token_id) == (7, 8, 9, 11)
    assert config.fim_pre_token_id == 12 and config.eog_from_token_texts  # the newer FIM key wins
    assert end_of_generation_ids(config, None) == {2, 7, 8, 9, 10, 11}  # not pre, not pad
    assert end_of_generation_ids(_config(eos_token_id=2), None) == {2}


def test_gguf_vocabulary_tokens_by_their_text():
    names = ["<unk>", "<s>", "</s>", "a", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>",
             "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>", "<|im_start|>", "<EOT>", "b"]
    vocab = Vocab(names, eos_token_id=5)
    found = end_of_generation_ids(_config(eos_token_id=5), vocab)
    assert sorted(names[i] for i in found) == sorted(["</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>",
                                                      "<|eom_id|>", "<end_of_turn>", "<|fim_pad|>", "<|file_sep|>",
                                                      "<|repo_name|>", "<EOT>"])
    # a declared FIM separator replaces the one found by its text; ids past the vocabulary are left out
    declared = end_of_generation_ids(_config(eos_token_id=5, fim_sep_token_id=3, eot_token_id=99), vocab)
    assert 3 in declared and names.index("<|file_sep|>") not in declared and 99 not in declared
    # an HF checkpoint's vocabulary is not searched by text: its config and generation_config decide
    hf = type("Config", (), {"eos_token_id": 5, "vocab_size": 16})()
    assert end_of_generation_ids(hf, vocab) == {5}
    assert end_of_generation_ids(hf, vocab, {"eos_token_id": [5, 4, 6]}) == {4, 5, 6}
    assert end_of_generation_ids(type("Config", (), {"eos_token_id": [1, 2]})(), None, {"eos_token_id": 3}) == {1, 2, 3}


def test_harmony_end_is_a_message_end_when_return_and_call_are_there():
    names = ["<unk>", "<|return|>", "<|call|>", "<|end|>", "<|start|>"]
    assert end_of_generation_ids(_config(eos_token_id=1), Vocab(names)) == {1, 2}  # <|end|> left out
    phi = ["<unk>", "<|endoftext|>", "<|end|>", "<|assistant|>"]
    assert end_of_generation_ids(_config(eos_token_id=1), Vocab(phi)) == {1, 2}  # Phi-3's <|end|> ends a turn


@pytest.fixture(scope="module")
def eog_gguf(tmp_path_factory) -> str:
    """A tiny GGUF whose chat EOS is <|im_end|> (7) with <|endoftext|> (6) a distinct control token
    named only by its text, and a FIM pad token (8) named by the metadata."""
    config = tiny_hf_config("llama")
    control = {6: "<|endoftext|>", 7: "<|im_end|>", 8: "<|fim_pad|>", 9: "<|im_start|>"}
    extra = {"tokenizer.ggml.eos_token_id": (7, gguf.GGUFValueType.UINT32),
             "tokenizer.ggml.fim_pad_token_id": (8, gguf.GGUFValueType.UINT32)}
    path = tmp_path_factory.mktemp("eog") / "tiny.gguf"
    return write_gguf(path, "llama", config, random_hf_model(config).state_dict(), extra=extra,
                      control_tokens=control)


def test_the_engine_stops_on_every_one_and_masks_them_under_min_tokens(eog_gguf):
    from deepinfer import LLM, SamplingParams

    with LLM(eog_gguf, max_model_len=64, num_blocks=16) as llm:
        engine = llm.engine
        assert engine.source.hf_config.eos_token_id == 7  # the extra key replaces the writer's
        assert {2, 6, 7, 8} <= engine.eos_token_ids and 9 not in engine.eos_token_ids
        assert engine.runner.steps.structured.eos_token_ids == engine.eos_token_ids
        for token_id in (6, 8):
            push = {token_id: 100.0}
            out = llm.generate([[1, 3, 4]], SamplingParams(max_tokens=8, temperature=0, logit_bias=push),
                               use_tqdm=False)[0].outputs[0]
            assert (out.token_ids, out.finish_reason, out.text) == ([token_id], "stop", "")
            later = llm.generate([[1, 3, 4]], SamplingParams(max_tokens=8, temperature=0, logit_bias=push,
                                                             min_tokens=3), use_tqdm=False)[0].outputs[0]
            assert later.token_ids[3:] == [token_id] and token_id not in later.token_ids[:3]
            assert later.finish_reason == "stop" and "<|" not in later.text
            shown = llm.generate([[1, 3, 4]], SamplingParams(max_tokens=3, temperature=0, logit_bias=push,
                                                             ignore_eos=True, skip_special_tokens=False),
                                 use_tqdm=False)[0].outputs[0]
            assert shown.token_ids == [token_id] * 3 and shown.finish_reason == "length"
            assert shown.text == llm.get_tokenizer().convert_ids_to_tokens(token_id) * 3
