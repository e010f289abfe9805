"""What a model is, before it becomes modules: its config, tokenizer, identity and weights.

`load_model_source(path)` accepts two layouts and answers with a `ModelSource`:

    a directory  config.json + *.safetensors (one file, or shards with an index) + tokenizer files
    a file       *.gguf: config, tokenizer and chat template live in its metadata

Weights come out under the HF transformers parameter names of `*ForCausalLM`, in HF layout, so a
model file has one loading path whatever the checkpoint format.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

EXPECTED_LAYOUT = "a directory with config.json and *.safetensors, or a .gguf file"


@dataclass
class ModelSource:
    """A model checkpoint, resolved: everything a runner needs except the modules.

    `identity` is stable for unchanged files and changes when any model file changes (path, size or
    modification time); prefix-cache keys include it, so cached rows never cross models.
    """

    path: str
    format: str  # "hf" or "gguf"
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerBase, with its chat template
    identity: str
    _weights: Any = field(default=None, repr=False, compare=False)

    def iter_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` in HF layout, each tensor converted to `dtype` once.

        Names are those of transformers' `*ForCausalLM` state dict, e.g.
        `model.layers.0.self_attn.q_proj.weight`; `lm_head.weight` appears only when the checkpoint
        stores it (otherwise `hf_config.tie_word_embeddings` is True).
        """
        if self._weights is None:
            raise ValueError(f"model source {self.path!r} has no weight reader")
        return self._weights(dtype)


def load_model_source(model: str | None = None) -> ModelSource:
    """Resolve `model` (a directory, a .gguf file, or None for the embedded default) to a source.

    Raises FileNotFoundError for a path that does not exist, ValueError for an existing path that
    is not a model in either layout.
    """
    if model is None:
        from deepinfer.model_executor.loader.default_model import default_model_path

        model = default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {model!r} does not exist; expected {EXPECTED_LAYOUT}")
    if os.path.isdir(path):
        from deepinfer.model_executor.loader.hf import load_hf_source

        return load_hf_source(path)
    if _is_gguf_file(path):
        from deepinfer.model_executor.loader.gguf import load_gguf_source

        return load_gguf_source(path)
    raise ValueError(f"model path {model!r} is a file but not a GGUF file; expected {EXPECTED_LAYOUT}")


def _is_gguf_file(path: str) -> bool:
    """True when the file starts with the GGUF magic bytes (the extension alone decides nothing)."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def compute_identity(path: str, files: list[str]) -> str:
    """sha256 over the resolved path and each file's name, size and modification time."""
    digest = hashlib.sha256(os.path.realpath(path).encode())
    for file in sorted(files):
        stat = os.stat(file)
        digest.update(f"\0{os.path.basename(file)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
