"""What a model is, before it becomes modules: its config, tokenizer, identity and weights.

`load_model_source(model)` accepts two layouts and answers with a `ModelSource`:

    a directory  config.json + *.safetensors (one file, or shards with an index) + tokenizer files
    a file       *.gguf: config, tokenizer and chat template live in its metadata

`model` names one of them, tried in this order (the first that applies wins):

    a local path          a directory or a .gguf file that exists
    a short name          a model shipped as a pip package: smollm2-135m, gemma3-270m (`default_model`)
    a Hugging Face name   org/name (an HF checkpoint) or org/name/file.gguf, from the Hub cache or
                          downloaded; `revision` pins a branch, tag or commit (`hub`)

With `load_format="dummy"` a directory needs only config.json (tokenizer files optional, weight
files ignored): the source has no weight reader, and `build_model` fills the modules with seeded
random values (`loader/dummy.py`). Its identity differs from the same files' real identity.

The `ModelSource` type and what the loaders share live in `model_source`; this module only
dispatches (`hf` for directories, `gguf` for files) and makes dummy-weight sources.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from deepinfer.config import check_load_format
from deepinfer.model_executor.loader.default_model import PACKAGED_MODELS, default_model_path, packaged_model_path
from deepinfer.model_executor.loader.gguf import load_gguf_source
from deepinfer.model_executor.loader.hf import load_hf_source
from deepinfer.model_executor.loader.hub import parse_hub_name, resolve_hub_model
from deepinfer.model_executor.loader.model_source import (
    EXPECTED_LAYOUT,
    ModelSource,
    compute_identity,
    load_tokenizer,
)


def load_model_source(model: str | ModelSource | None = None, load_format: str = "auto", *,
                      revision: str | None = None) -> ModelSource:
    """Resolve `model` (a path, a short name, a Hugging Face name, or None for the embedded
    default; see the module docstring) to a source.

    `load_format`: "auto" reads the checkpoint's weights; "dummy" needs only the config (see the
    module docstring). A `ModelSource` resolved beforehand is returned as it is ("auto") or
    turned into a dummy source ("dummy"). `revision` (Hugging Face names only) pins a branch,
    tag or commit hash; None means "main".

    Raises FileNotFoundError for a model found nowhere (the message names where it looked and how
    to get it), ValueError for an existing path that is not a model in either layout, for a
    revision given with a local path, or for an unknown load_format.
    """
    check_load_format(load_format)
    if isinstance(model, ModelSource):
        return as_dummy_source(model) if load_format == "dummy" else model
    path = resolve_model_path(model, revision)
    if os.path.isdir(path):
        if load_format == "dummy":
            return load_config_only_source(path)
        return load_hf_source(path)
    if _is_gguf_file(path):
        source = load_gguf_source(path)
        return as_dummy_source(source) if load_format == "dummy" else source
    raise ValueError(f"model path {model!r} is a file but not a GGUF file; expected {EXPECTED_LAYOUT}")


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """The local path `model` names: an existing path, else a short name, else a Hugging Face name."""
    if model is None:
        model = default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    local = os.path.exists(path)
    if local or model.lower() in PACKAGED_MODELS:
        if revision is not None:
            kind = "a local path" if local else "a model shipped as a pip package"
            raise ValueError(f"revision {revision!r} applies to Hugging Face names, but model {model!r} is {kind}")
        return path if local else packaged_model_path(model)
    if parse_hub_name(model) is not None:
        return resolve_hub_model(model, revision)
    raise FileNotFoundError(f"model {model!r} is not a local path, a short name ({', '.join(PACKAGED_MODELS)}) "
                            f"nor a Hugging Face name (org/name or org/name/file.gguf); expected {EXPECTED_LAYOUT}")


def is_model_name(model: str) -> bool:
    """Whether `model`, when no such path exists, names a model (a short name or a Hugging Face
    name) rather than a missing path."""
    return model.lower() in PACKAGED_MODELS or parse_hub_name(model) is not None


def load_config_only_source(path: str) -> ModelSource:
    """A dummy-weight source for an HF directory: config.json (+ tokenizer files if any), no weights.

    A quantization_config is ignored: dummy weights are never quantized.
    """
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"directory {path!r} has no config.json, which load_format='dummy' needs")
    files = [os.path.join(path, name) for name in os.listdir(path) if not name.endswith(_WEIGHT_SUFFIXES)]
    return ModelSource(path=path, format="hf", hf_config=AutoConfig.from_pretrained(path),
                       tokenizer=load_tokenizer(path),
                       identity=_dummy_identity(compute_identity(path, [f for f in files if os.path.isfile(f)])),
                       load_format="dummy")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")  # dummy weights depend on the config alone


def as_dummy_source(source: ModelSource) -> ModelSource:
    """The same config and tokenizer with dummy weights (and an identity of its own)."""
    if source.load_format == "dummy":
        return source
    return dataclasses.replace(source, _weights=None, _weight_slices=None, load_format="dummy",
                               identity=_dummy_identity(source.identity))


def _dummy_identity(identity: str) -> str:
    """Prefix-cache keys must not mix rows of dummy weights with rows of the real ones."""
    return hashlib.sha256(f"{identity}\0load_format=dummy".encode()).hexdigest()


def _is_gguf_file(path: str) -> bool:
    """True when the file starts with the GGUF magic bytes (the extension alone decides nothing)."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
