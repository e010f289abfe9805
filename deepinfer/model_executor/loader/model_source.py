"""The `ModelSource` type every loader answers with, and what the loaders share to build one:
the identity of a model's files and the tokenizer of an HF directory.

Weights come out under the HF transformers parameter names of `*ForCausalLM`, in HF layout, so a
model file has one loading path whatever the checkpoint format.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepinfer.model_executor.loader.fingerprint import content_identity, default_cache_dir

if TYPE_CHECKING:
    import torch

EXPECTED_LAYOUT = "a directory with config.json and *.safetensors, or a .gguf file"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class ModelSource:
    """A model checkpoint, resolved: everything a runner needs except the modules.

    `identity` is the content of the model files (weights, config, tokenizer files): a hash over
    each file's name and the digest of its bytes, not the directory path nor modification times.
    A copy of the same checkpoint elsewhere has the same identity; the same path with changed bytes
    has another. Prefix-cache keys include it, so cached rows never cross models.
    """

    path: str
    format: str  # "hf" or "gguf"
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerBase, with its chat template
    identity: str
    _weights: Any = field(default=None, repr=False, compare=False)
    _weight_slices: Any = field(default=None, repr=False, compare=False)
    load_format: str = "auto"  # "dummy": no weights are read; build_model fills seeded random values
    # the checkpoint's generation_config.json, the fields that differ from transformers' defaults
    # (e.g. {"temperature": 0.6, "top_p": 0.9}); empty when it ships none (GGUF files never do)
    generation_config: dict = field(default_factory=dict)
    # a GGUF language model with llama.cpp's vision file (`--mmproj`, loader/mmproj_source.py): plain data
    # for the picture preprocessing (model_type, projector, picture sizes / mean / std, placeholder ids); None
    vision: dict | None = None

    def iter_weights(self, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """Yield `(hf_name, tensor)` in HF layout, each tensor converted to `dtype` once.

        `keep_quantized` (GGUF only): quantized matrices come as `QuantWeight`s, not dequantized.

        Names are those of transformers' `*ForCausalLM` state dict, e.g.
        `model.layers.0.self_attn.q_proj.weight`; `lm_head.weight` appears only when the checkpoint
        stores it (otherwise `hf_config.tie_word_embeddings` is True).
        """
        return self._read(self._weights, dtype, keep_quantized)

    def iter_weight_slices(self, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """Yield `(hf_name, lazy tensor)`: `.shape`, `.narrow(dim, start, length)` and `.read()` read
        only what a tensor-parallel rank asks for; `keep_quantized` as in `iter_weights`."""
        return self._read(self._weight_slices, dtype, keep_quantized)

    def _read(self, reader, dtype: torch.dtype, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
        if reader is None:
            raise ValueError(f"model source {self.path!r} has no weight reader")
        if not keep_quantized:
            return reader(dtype)
        if self.format != "gguf":
            raise ValueError(f"keep_quantized needs a GGUF source; {self.path!r} is {self.format!r}")
        return reader(dtype, keep_quantized=True)


def compute_identity(path: str, files: list[str]) -> str:
    """The content identity of `files` (the model's files under `path`): sha256 over each file's
    basename and the blake2b digest of its bytes (`fingerprint.content_identity`).

    `path` itself is not hashed: identity is by content. Digests are cached by file stat in
    `default_cache_dir()`, so only new or rewritten files are read in full.
    """
    return content_identity(files, default_cache_dir())


def load_tokenizer(path: str):
    """The HF directory's tokenizer (with its chat template), or None when it ships none."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
