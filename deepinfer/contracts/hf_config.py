"""The optional fields of a checkpoint's transformers config, declared once with their defaults.

A transformers `PretrainedConfig` holds only what its model class and config.json name:
`eos_token_id`, `max_position_embeddings`, `quantization_config`, the sentence-transformers
(Matryoshka), FIM, end-of-generation and pooling (from GGUF metadata) and RoPE fields may each be
absent. The engine, the loaders and the entry points read them through `HFConfigFields.of(hf_config)`,
never probing the config where they use a field. Fields every config has (`model_type`, `architectures`) and those every
model class of ours requires (`vocab_size`, ...) are read from the config directly.

A model family declares the optional fields it reads the same way, in a subclass next to its
code (`LlamaConfigFields` in models/llama.py, ...): each field once, with the default its
transformers config class has (a member family's subclass may change a parent's default, as
GPT-OSS does for `attention_bias`), read through the inherited `of` where the family builds its
modules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self


@dataclass(frozen=True)
class HFConfigFields:
    """What a config sets of the optional fields; a field it does not set has the default here."""

    max_position_embeddings: int = 4096  # the model's context (4096 when the config names none)
    eos_token_id: int | list[int] | None = None  # one id or several
    hidden_size: int = 0  # 0: unknown (a bare PretrainedConfig)
    vocab_size: int | None = None  # None: unknown (a bare PretrainedConfig; every model's config has one)
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None  # None: as many KV heads as heads
    # RoPE: transformers >= 5 keeps theta inside rope_parameters; older configs (and GGUF's) a field
    rope_parameters: dict | None = None
    rope_theta: float = 10000.0
    quantization_config: Any = None  # a dict as config.json holds it, or transformers' config object
    # sentence-transformers' Matryoshka embeddings: the sizes a vector may be shortened to
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    pooling_type: str | None = None  # a GGUF embedding model's pooling (loader/gguf_config.py): "mean", "cls", "last"
    # fill-in-the-middle token ids (GGUF metadata, loader/gguf_config.py); pad, repo and file
    # separator end a generation, as end of turn (eot) and end of message (eom) do
    fim_pre_token_id: int | None = None
    fim_suf_token_id: int | None = None
    fim_mid_token_id: int | None = None
    fim_pad_token_id: int | None = None
    fim_rep_token_id: int | None = None
    fim_sep_token_id: int | None = None
    eot_token_id: int | None = None
    eom_token_id: int | None = None
    eog_from_token_texts: bool = False  # GGUF: tokens spelled as an end of generation end one (llama.cpp)

    @classmethod
    def of(cls, hf_config: Any) -> Self:
        """The fields `hf_config` sets (a transformers config, or any object with such attributes); a
        field it does not set takes this class's default, one it sets to None stays None."""
        return cls(**{f.name: getattr(hf_config, f.name, f.default) for f in fields(cls)})


# Token texts that end a generation in a GGUF vocabulary (llama.cpp's llama-vocab.cpp, which finds
# them by their text because converters seldom name them all in the metadata)
EOG_TOKEN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                   "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "▁<EOT>",
                   "<end_of_utterance>", "<｜end▁of▁sentence｜>", "</s>")
# the FIM pad, repo and file-separator tokens by their text, where the metadata names none of that kind
FIM_EOG_TOKEN_TEXTS = {
    "fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_token_id": ("<|file_sep|>", "<|file_separator|>"),
}
# o200k_harmony (GPT-OSS): with <|return|> and <|call|> ending a generation, <|end|> only ends a message
_HARMONY_ENDS, _HARMONY_MESSAGE_END = ("<|return|>", "<|call|>"), "<|end|>"


def end_of_generation_ids(hf_config: Any, tokenizer: Any, generation_config: dict | None = None) -> frozenset[int]:
    """Every token id that ends a generation: the one set the engine's stop check, min_tokens
    masking and structured output use (`ignore_eos` lifts it).

        config          eos_token_id (one id or several), eot_token_id, eom_token_id, and the FIM
                        pad / repo / file-separator ids (GGUF metadata, loader/gguf_config.py)
        generation      generation_config.json's eos_token_id (one id or several)
        tokenizer       its eos_token_id
        GGUF vocabulary (`eog_from_token_texts`) every token spelled as in EOG_TOKEN_TEXTS, and the
                        FIM pad / repo / separator tokens by their text where the metadata names none;
                        when <|return|> and <|call|> are among them, <|end|> is not (GPT-OSS)

    Ids outside the model's vocabulary (`vocab_size`, when the config has one) are left out."""
    fields = HFConfigFields.of(hf_config)
    named = [fields.eos_token_id, fields.eot_token_id, fields.eom_token_id, fields.fim_pad_token_id,
             fields.fim_rep_token_id, fields.fim_sep_token_id, (generation_config or {}).get("eos_token_id"),
             None if tokenizer is None else tokenizer.eos_token_id]
    ids = set(_int_ids(named))
    if fields.eog_from_token_texts and tokenizer is not None:
        ids |= _ids_by_text(tokenizer, fields)
    return frozenset(i for i in ids if i >= 0 and (fields.vocab_size is None or i < fields.vocab_size))


def _int_ids(values: list) -> list[int]:
    """The ints among `values`, each an int, a list of them or None."""
    found = []
    for value in values:
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [int(v) for v in items if isinstance(v, int) and not isinstance(v, bool)]
    return found


def _ids_by_text(tokenizer: Any, fields: HFConfigFields) -> set[int]:
    """The GGUF vocabulary's end-of-generation tokens found by their text (llama.cpp's rule)."""
    declared = {"fim_pad_token_id": fields.fim_pad_token_id, "fim_rep_token_id": fields.fim_rep_token_id,
                "fim_sep_token_id": fields.fim_sep_token_id}
    texts = list(EOG_TOKEN_TEXTS)
    for field, spellings in FIM_EOG_TOKEN_TEXTS.items():
        if declared[field] is None:
            texts += spellings
    found = {text: vocabulary_id(tokenizer, text) for text in texts}
    if all(found[text] is not None for text in _HARMONY_ENDS):
        found[_HARMONY_MESSAGE_END] = None
    return {token_id for token_id in found.values() if token_id is not None}


def vocabulary_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when it is one entry of the tokenizer's vocabulary (None otherwise: an
    unknown token maps to unk, or to None)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id < 0:
        return None
    return token_id if tokenizer.convert_ids_to_tokens(token_id) == token else None
