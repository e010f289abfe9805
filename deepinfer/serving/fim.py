"""Fill-in-the-middle (code completion) prompts from a model's FIM tokens.

Where the tokens come from, in order:

    GGUF metadata   tokenizer.ggml.fim_pre_token_id / fim_suf_token_id / fim_mid_token_id (and the
                    older prefix_token_id / suffix_token_id / middle_token_id), which the loader
                    copies into the config as fim_pre_token_id, ... (gguf_config.py)
    the vocabulary  <|fim_prefix|> <|fim_suffix|> <|fim_middle|>   (Qwen2.5-Coder)
                    <fim_prefix> <fim_suffix> <fim_middle>          (StarCoder/StarCoder2)
                    ▁<PRE> ▁<SUF> ▁<MID>                            (CodeLlama)
                    <｜fim▁begin｜> <｜fim▁hole｜> <｜fim▁end｜>        (DeepSeek-Coder)

The prompt is in PSM order, each FIM token inserted by its id (never by text):
[the tokenizer's leading special tokens, e.g. BOS] + extra context + fim_pre + prefix + fim_suf +
suffix + fim_mid + middle (text the user already typed at the cursor, llama.cpp's `prompt`).
Extra context (llama.cpp's `input_extra` chunks) goes before fim_pre: per chunk, the file
separator token (`<|file_sep|>`, `<file_sep>` or the GGUF fim_sep_token_id) + "filename\\n" +
text, or, for a model without one, "\\n\\n--- snippet ---\\n\\n" + text, as llama.cpp does.
The answer ends at the model's end-of-generation tokens (`end_of_generation_ids`: Qwen2.5-Coder's
<|endoftext|>, the FIM pad and file-separator tokens), whose text is not shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.contracts.hf_config import HFConfigFields, vocabulary_id
from deepinfer.serving.errors import bad_request

_VOCAB_SETS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)
_SEPARATORS = ("<|file_sep|>", "<file_sep>")
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle token ids, and the tokens its tokenizer puts before a text."""

    prefix: int
    suffix: int
    middle: int
    separator: int | None  # between extra-context files (None: a text separator is used)
    leading: tuple[int, ...] = ()  # e.g. (BOS,) when the tokenizer adds one


def find_fim_tokens(tokenizer, hf_config) -> FimTokens | None:
    """The model's FIM tokens (config ids from GGUF metadata first, then the vocabulary); None
    when it has none."""
    fields = HFConfigFields.of(hf_config)
    ids = [fields.fim_pre_token_id, fields.fim_suf_token_id, fields.fim_mid_token_id]
    separator = fields.fim_sep_token_id
    if tokenizer is not None and not all(isinstance(i, int) and i >= 0 for i in ids):
        ids = next((found for names in _VOCAB_SETS
                    if None not in (found := [vocabulary_id(tokenizer, n) for n in names])), [None])
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        return None
    if tokenizer is not None and separator is None:
        separator = next((i for i in (vocabulary_id(tokenizer, n) for n in _SEPARATORS) if i is not None), None)
    return FimTokens(*ids, separator=separator, leading=_leading_ids(tokenizer))


def _leading_ids(tokenizer) -> tuple[int, ...]:
    """The special tokens the tokenizer puts before a text (BOS for Llama-style tokenizers)."""
    if tokenizer is None:
        return ()
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[:start])
    return ()


def fim_prompt(tokenizer, tokens: FimTokens, prefix: str | list[int], suffix: str | list[int],
               extra: list[tuple[str, str]] = (), middle: str = "") -> list[int]:
    """The PSM prompt ids; `prefix`/`suffix` as text or ids, `extra` as (filename, text) chunks."""
    ids = list(tokens.leading)
    for filename, text in extra:
        if tokens.separator is not None:
            ids += [tokens.separator] + _ids(tokenizer, f"{filename}\n")
        else:
            ids += _ids(tokenizer, SNIPPET_SEPARATOR)
        ids += _ids(tokenizer, text)
    ids += [tokens.prefix] + _ids(tokenizer, prefix) + [tokens.suffix] + _ids(tokenizer, suffix) + [tokens.middle]
    return ids + _ids(tokenizer, middle)


def _ids(tokenizer, text: str | list[int]) -> list[int]:
    if not isinstance(text, str):
        return list(text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def require_fim_tokens(tokenizer, hf_config, param: str) -> FimTokens:
    """The model's FIM tokens; a 400 naming `param` when it has none."""
    tokens = find_fim_tokens(tokenizer, hf_config)
    if tokens is None:
        raise bad_request("needs fill-in-the-middle tokens, and this model has none (no "
                          "fim_pre/fim_suf/fim_mid token ids in its GGUF metadata, no <|fim_prefix|>, "
                          "<fim_prefix> or <PRE> tokens in its vocabulary)", param)
    return tokens


def completion_fim_prompt(tokenizer, state, prompt: str | list[int], suffix: str) -> list[int]:
    """/v1/completions with `suffix`: the prompt is the text before the cursor (text or ids), the
    suffix the text after it; both are bounded before they are tokenized."""
    tokens = require_fim_tokens(tokenizer, state.engine.source.hf_config, "suffix")
    if tokenizer is None:
        raise bad_request("this model ships no tokenizer, so a suffix cannot be tokenized", "suffix")
    if isinstance(prompt, str):
        state.bounds.check_text(prompt, "prompt")
    state.bounds.check_text(suffix, "suffix")
    return fim_prompt(tokenizer, tokens, prompt, suffix)
