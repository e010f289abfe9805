"""One tiny random fp32 checkpoint per model family beyond the Llama family, from the builders of
each family's own tests (tests/moe_tiny.py, tests/gemma2_phi3_models.py, models/deepseek_v3/v3_tiny.py,
models/test_gpt_oss.py), for tests that run every family through the engine's shared paths.

Small vocabularies where the builder takes one (1024 ids; DeepSeek's own 512), so greedy
continuations of a tiny random model fall into loops that prompt lookup can draft; GPT-OSS keeps its
builder's 49152 ids and MXFP4 experts. The default tokenizer's files come along where the builder
copies them; prompts are token ids either way.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models", "deepseek_v3"))

SMALL_VOCAB = 1024
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gemma2", "phi3", "deepseek_v3", "deepseek_v2", "gpt_oss")
PHI3_CONFIG = "phi3_swa"  # a window of 16 on every layer: the ring-only cache layout, snapshots for prefix hits


def _copy_tokenizer(tokenizer_dir: str, path: str) -> None:
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))


def make_family_checkpoint(family: str, path: str, tokenizer_dir: str, seed: int = 0) -> int:
    """Write `family`'s tiny checkpoint to `path`; returns its vocabulary size."""
    if family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        from moe_tiny import make_tiny_moe

        make_tiny_moe(family, path, tokenizer_dir, seed, vocab_size=SMALL_VOCAB)
        return SMALL_VOCAB
    if family in ("gemma2", "phi3"):
        from gemma2_phi3_models import tiny_model

        tiny_model(family if family == "gemma2" else PHI3_CONFIG, seed, vocab_size=SMALL_VOCAB).save_pretrained(path)
        _copy_tokenizer(tokenizer_dir, path)
        return SMALL_VOCAB
    if family in ("deepseek_v3", "deepseek_v2"):
        from v3_tiny import VOCAB, make_tiny

        make_tiny(path, family, seed)
        return VOCAB
    if family == "gpt_oss":
        from test_gpt_oss import VOCAB, write_mxfp4_checkpoint

        write_mxfp4_checkpoint(path, tokenizer_dir, seed)
        return VOCAB
    raise ValueError(f"family={family!r} is not one of {FAMILIES}")
