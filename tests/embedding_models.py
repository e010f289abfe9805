"""Tiny random sentence-transformers checkpoints for the embedding tests, and their reference vectors.

`make_st_checkpoint` saves a tiny random HF decoder (tests/tiny_models.py) wrapped as
sentence-transformers saves an embedding model: Transformer (a bare `LlamaModel` / `Qwen3Model`:
unprefixed tensor names, no LM head) -> Pooling -> [Normalize], with modules.json. The tokenizer's
chat template is removed first: sentence-transformers 6 renders text inputs through a chat template
when the tokenizer has one, and the engine embeds the plain tokenization (as vLLM does).
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
from tiny_models import make_tiny_checkpoint

# inputs of many lengths: short words to a few hundred tokens (longer than a 64-token chunk budget)
_WORDS = ("alpha beta gamma delta the quick brown fox jumps over lazy dog embeddings vector pool "
          "mean last token first chunk budget prefill cache block engine request").split()


def st_inputs(count: int = 64, seed: int = 0) -> list[str]:
    """`count` texts of mixed lengths: a few one-word inputs, most 5-60 words, some 120-220 words."""
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 3] + [int(n) for n in rng.integers(5, 60, count - 8)] + [120, 150, 180, 200, 220]
    return [" ".join(rng.choice(_WORDS, size=n)) for n in lengths[:count]]


def make_st_checkpoint(path: str, tokenizer_dir: str, arch: str = "llama", mode: str = "mean",
                       normalize: bool = True, seed: int = 0, config_extra: dict | None = None) -> str:
    """Save a sentence-transformers checkpoint at `path` (Pooling `mode`: mean, lasttoken, cls);
    `config_extra` fields go into its config.json (e.g. {"is_matryoshka": True})."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    lm_dir = f"{path}-lm"
    make_tiny_checkpoint(arch, lm_dir, tokenizer_dir, seed=seed)
    _drop_chat_template(lm_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = Transformer(lm_dir)
        hidden = transformer.get_embedding_dimension()
        modules = [transformer, Pooling(hidden, mode)] + ([Normalize()] if normalize else [])
        SentenceTransformer(modules=modules, device="cpu").save(path)
    if config_extra:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config, **config_extra}, f)
    return path


def _drop_chat_template(path: str) -> None:
    template = os.path.join(path, "chat_template.jinja")
    if os.path.exists(template):
        os.remove(template)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(config_path, "w") as f:
        json.dump(config, f)


def st_reference(path: str, texts: list[str], batch_size: int = 16) -> np.ndarray:
    """sentence-transformers' own vectors [N, D] for `texts`, in float32 on the CPU."""
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(path, device="cpu")
        return model.encode(texts, batch_size=batch_size, convert_to_numpy=True).astype(np.float32)


def cosines(a, b) -> np.ndarray:
    """Row-wise cosine similarity of [N, D] arrays."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
