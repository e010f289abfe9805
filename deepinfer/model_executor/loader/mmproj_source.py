"""A GGUF language model plus llama.cpp's vision file (`--mmproj FILE`) as one picture model source.

    text GGUF (gemma3 / qwen2vl / llama)  +  mmproj (gguf_mmproj.py)
        -> hf_config   the family's composite transformers config (Gemma3Config, Qwen2_5_VLConfig,
                       Qwen2VLConfig, LlavaConfig): text_config from the GGUF's config, vision_config
                       and the top fields from the clip keys, the placeholder ids from the GGUF's
                       vocabulary; the text fields lifted to the top (hf.lift_text_config)
        -> weights     the text weights under the composite names (`model.language_model.*`,
                       `lm_head.*`), then the vision weights (always dequantized)
        -> identity    both files' content
        -> vision      plain data for the picture preprocessing (serving/vision.py builds the image
                       processor from it: there is no preprocessor_config.json beside a GGUF)

`build_model` then picks the picture class by the composite config's model_type, as for an HF
checkpoint of the family; nothing else knows the model came from two files.
"""

from __future__ import annotations

import dataclasses
import hashlib
from itertools import chain
from typing import Any

from deepinfer.model_executor.loader.gguf_mmproj import Mmproj, MmprojError, iter_mmproj_weights, read_mmproj
from deepinfer.model_executor.loader.hf import lift_text_config
from deepinfer.model_executor.loader.model_source import ModelSource, compute_identity

# the text GGUF's model_type (gguf_config.py) each projector goes with
_TEXT_TYPES = {"gemma3": ("gemma3_text",), "qwen2_5_vl": ("qwen2",), "qwen2_vl": ("qwen2",),
               "llava": ("llama", "mistral", "qwen2")}
# placeholder tokens the family's scheme names: composite config field -> token text
_TOKENS = {
    "gemma3": {"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>",
               "eoi_token_index": "<end_of_image>"},
    "qwen2_5_vl": {"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
                   "vision_end_token_id": "<|vision_end|>", "video_token_id": "<|video_pad|>"},
    "llava": {"image_token_index": "<image>"},
}
_TOKENS["qwen2_vl"] = _TOKENS["qwen2_5_vl"]
_OPTIONAL_TOKENS = frozenset({"video_token_id"})
_TEXT_DROPPED = ("architectures", "_name_or_path", "transformers_version", "auto_map")


def attach_mmproj(source: ModelSource, mmproj_path: str) -> ModelSource:
    """`source` (a GGUF language model) with the vision file at `mmproj_path`: the picture model's source.
    MmprojError (a ValueError) naming the file and what does not fit."""
    if source.format != "gguf":
        raise MmprojError(f"mmproj file {mmproj_path!r}: --mmproj goes with a .gguf language model; "
                          f"{source.path!r} is a {source.format} checkpoint (its own vision tower is used)")
    mm = read_mmproj(mmproj_path)
    text_type = source.hf_config.model_type
    if text_type not in _TEXT_TYPES[mm.model_type]:
        raise MmprojError(f"mmproj file {mmproj_path!r}: projector {mm.projector!r} goes with a "
                          f"{'/'.join(_TEXT_TYPES[mm.model_type])} language model; {source.path!r} is {text_type!r}")
    hidden = int(source.hf_config.hidden_size)
    if mm.text_hidden != hidden:
        raise MmprojError(f"mmproj file {mmproj_path!r}: its projector writes rows of {mm.text_hidden} values, "
                          f"but the language model's hidden size is {hidden}")
    tokens = _token_ids(mm, source.tokenizer)
    config = composite_config(mm, source.hf_config, tokens)
    text_weights = source._weights  # noqa: SLF001 (the reader this source wraps)
    weights = None
    if text_weights is not None:
        def weights(dtype, keep_quantized=False):
            return chain(_text_names(text_weights(dtype, keep_quantized)), iter_mmproj_weights(mm, dtype))
    identity = hashlib.sha256(f"{source.identity}\0mmproj={compute_identity(mmproj_path, [mmproj_path])}"
                              .encode()).hexdigest()
    vision = {"model_type": mm.model_type, "projector": mm.projector, "picture": dict(mm.picture),
              "tokens": dict(tokens), "path": mmproj_path}
    return dataclasses.replace(source, hf_config=config, identity=identity, _weights=weights,
                               _weight_slices=None, vision=vision)


def _token_ids(mm: Mmproj, tokenizer) -> dict[str, int]:
    """The family's placeholder token ids in the language model's vocabulary (one line naming a missing one)."""
    if tokenizer is None:
        raise MmprojError(f"mmproj file {mm.path!r}: the language model's GGUF has no tokenizer, so its "
                          f"picture tokens cannot be found")
    ids = {}
    vocab = tokenizer.get_vocab()
    for field, text in _TOKENS[mm.model_type].items():
        if text in vocab:
            ids[field] = int(vocab[text])
        elif field not in _OPTIONAL_TOKENS:
            raise MmprojError(f"mmproj file {mm.path!r}: the language model's vocabulary has no {text!r} token, "
                              f"which the {mm.projector!r} projector's prompts need")
    return ids


def composite_config(mm: Mmproj, text_config: Any, tokens: dict[str, int]):
    """The family's transformers composite config: text_config from the GGUF's, the rest from the mmproj."""
    import transformers as tf

    text = {k: v for k, v in text_config.to_dict().items() if k not in _TEXT_DROPPED}
    tie = bool(text.get("tie_word_embeddings", True))
    if mm.model_type == "gemma3":
        config = tf.Gemma3Config(text_config=text, vision_config=mm.vision_config, **mm.top, **tokens,
                                 tie_word_embeddings=tie)
    elif mm.model_type in ("qwen2_vl", "qwen2_5_vl"):
        cls = tf.Qwen2_5_VLConfig if mm.model_type == "qwen2_5_vl" else tf.Qwen2VLConfig
        text["model_type"] = f"{mm.model_type}_text"
        if "mrope_section" not in text:
            raise MmprojError(f"mmproj file {mm.path!r}: projector {mm.projector!r} needs M-RoPE, and the language "
                              f"model's GGUF has no qwen2vl.rope.dimension_sections")
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": text.pop("mrope_section")}
        config = cls(text_config=text, vision_config=mm.vision_config, **mm.top, **tokens, tie_word_embeddings=tie)
    else:
        config = tf.LlavaConfig(text_config=text, vision_config=dict(mm.vision_config, model_type="clip_vision_model"),
                                **mm.top, **tokens, tie_word_embeddings=tie)
    return lift_text_config(config)


_TEXT_RENAMES = (("model.", "model.language_model."),)


def _text_names(weights):
    """The text GGUF's weights (`model.*`, `lm_head.*`) under the composite checkpoint's names."""
    for name, tensor in weights:
        for old, new in _TEXT_RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor
