"""Tiny random Gemma 2 and Phi-3 checkpoints (hidden 64, the test tokenizer's 49152 ids, matrices
drawn with std 0.08), as tests/tiny_models.py builds the Llama-family ones.

    gemma2          4 layers, sliding (window 16) / global alternating as HF's `layer_types`;
                    logit caps small enough to bend the tiny model's logits (attention 2.0, final
                    10.0), so a cap that is not applied shows
    phi3_longrope   LongRoPE (original length 64 < max_model_len: the long factors), partial rotary
                    0.5, 3 layers, fused qkv_proj / gate_up_proj
    phi3_swa        a sliding window of 16 on every layer, LongRoPE whose original length (512)
                    exceeds max_model_len (the short factors, with the attention factor of
                    max_position_embeddings 2048 / 512)
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from tiny_models import VOCAB

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = ("gemma2", "phi3_longrope", "phi3_swa")


def _factors(n: int, low: float, high: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [round(rng.uniform(low, high), 4) for _ in range(n)]


def tiny_config(name: str, **overrides):
    import transformers as tf

    if name == "gemma2":
        cfg = tf.Gemma2Config(**_COMMON, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                              attn_logit_softcapping=2.0, final_logit_softcapping=10.0, max_position_embeddings=1024,
                              rms_norm_eps=1e-6, tie_word_embeddings=True)
    elif name == "phi3_longrope":  # head_dim 16, rotary dims 8: 4 factors each
        cfg = tf.Phi3Config(**_COMMON, num_hidden_layers=3, max_position_embeddings=256,
                            original_max_position_embeddings=64, tie_word_embeddings=False,
                            rope_scaling={"rope_type": "longrope", "short_factor": _factors(4, 1.0, 1.3, 1),
                                          "long_factor": _factors(4, 1.0, 6.0, 2), "partial_rotary_factor": 0.5})
    elif name == "phi3_swa":
        cfg = tf.Phi3Config(**_COMMON, num_hidden_layers=2, max_position_embeddings=2048, sliding_window=16,
                            original_max_position_embeddings=512, tie_word_embeddings=False,
                            rope_scaling={"rope_type": "longrope", "short_factor": _factors(8, 1.0, 1.5, 3),
                                          "long_factor": _factors(8, 1.0, 8.0, 4)})
    else:
        raise ValueError(name)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(name: str, seed: int = 0, **overrides):
    """A random HF model of `tiny_config(name, **overrides)` (matrices std 0.08, norms as initialised)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides), dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model.eval()


def make_checkpoint(name: str, path: str, tokenizer_dir: str, seed: int = 0) -> None:
    """save_pretrained of `tiny_model(name)`, with the test tokenizer's files."""
    tiny_model(name, seed).save_pretrained(path)
    for file in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, file), os.path.join(path, file))


@pytest.fixture(scope="session")
def gemma2_phi3_checkpoint(tmp_path_factory, tokenizer_dir):
    """gemma2_phi3_checkpoint(name) -> directory of that tiny checkpoint (built once per session)."""
    built: dict[str, str] = {}

    def build(name: str) -> str:
        if name not in built:
            path = str(tmp_path_factory.mktemp(f"tiny-{name}"))
            make_checkpoint(name, path, tokenizer_dir)
            built[name] = path
        return built[name]

    return build
