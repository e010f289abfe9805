"""Checkpoints of a bare base model, as sentence-transformers and most embedding models ship them.

Such a checkpoint holds transformers' `*Model` (e.g. `LlamaModel`, `Qwen3Model`), not its
`*ForCausalLM`: its tensors are named `embed_tokens.weight`, `layers.N. ...`, `norm.weight`, with
no `model.` prefix, and usually no `lm_head.weight`. The model classes read `*ForCausalLM` names
(`ModelSource.iter_weights`), so the names are prefixed as they are read, and a checkpoint without
a head ties it to the embedding (`tie_word_embeddings`): its hidden states are what an embedding
uses; generated tokens from such a checkpoint mean nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

BASE_MARKER = "embed_tokens.weight"  # a base model's first tensor, unprefixed
PREFIX = "model."


def tensor_names(files: list[str]) -> set[str]:
    """Every tensor name of the safetensors `files` (headers only: no tensor is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def causal_lm_names(files: list[str], config) -> Callable[[Iterator], Iterator]:
    """A renaming of the checkpoint's `(name, tensor)` stream to `*ForCausalLM` names: the identity
    for a causal-LM checkpoint; for a bare base model, `model.` + name (and `config` is set to tie
    the missing head to the embedding)."""
    names = tensor_names(files)
    if BASE_MARKER not in names or any(name.startswith(PREFIX) for name in names):
        return lambda weights: weights
    if "lm_head.weight" not in names:
        config.tie_word_embeddings = True
    return lambda weights: ((name if name.startswith("lm_head.") else PREFIX + name, tensor)
                            for name, tensor in weights)
