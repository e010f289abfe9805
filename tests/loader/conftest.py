"""Fixtures for loader tests (helpers live in tests/llamacpp_writer.py)."""

from __future__ import annotations

import pytest
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf


@pytest.fixture
def tiny_gguf(tmp_path):
    """Factory: (arch, qtype=None, **config overrides) -> (gguf path, HF config, HF state dict)."""

    def make(arch: str, qtype=None, **overrides):
        config = tiny_hf_config(arch, **overrides)
        model = random_hf_model(config)
        state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, config, state, qtype=qtype)
        return path, config, state

    return make
