"""HF checkpoint directories: config.json + *.safetensors (single file or shards) + tokenizer files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.model_executor.loader.base_model import causal_lm_names
from deepinfer.model_executor.loader.model_source import EXPECTED_LAYOUT, ModelSource, compute_identity, load_tokenizer

SAFETENSORS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"


def load_hf_source(path: str) -> ModelSource:
    """A `ModelSource` for an HF directory; ValueError when `path` holds no such checkpoint.

    `tokenizer` is None when the directory ships no tokenizer files (tiny test checkpoints).
    """
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        gguf_files = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        hint = f" (it holds {', '.join(gguf_files)}: pass that file's path)" if gguf_files else ""
        raise ValueError(
            f"directory {path!r} has no config.json, so it is not a model{hint}; expected {EXPECTED_LAYOUT}"
        )
    shard_files = safetensors_files(path)
    config = lift_text_config(AutoConfig.from_pretrained(path))
    quantization = HFConfigFields.of(config).quantization_config
    if quantization and not _dequantized_on_load(config, quantization):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(
            f"{path!r}: quantized HF checkpoints (quantization_config: {method}) are not supported"
        )
    files = [os.path.join(path, name) for name in os.listdir(path)]
    renamed = causal_lm_names(shard_files, config)  # a bare base model's names (loader/base_model.py)
    return ModelSource(
        path=path,
        format="hf",
        hf_config=config,
        tokenizer=load_tokenizer(path),
        identity=compute_identity(path, [file for file in files if os.path.isfile(file)]),
        _weights=lambda dtype: renamed(iter_safetensors(shard_files, dtype)),
        _weight_slices=lambda dtype: renamed(iter_safetensors_slices(shard_files, dtype)),
        generation_config=load_generation_config(path),
    )


def lift_text_config(config):
    """A composite config (a vision-language model: `text_config` beside `vision_config`) with its
    language model's fields also at the top, where the engine reads them (`vocab_size`,
    `max_position_embeddings`, `eos_token_id`, ...); a field the top sets itself stays. Any other
    config is returned as it is."""
    text = getattr(config, "text_config", None)
    if text is None or text is config or not hasattr(text, "to_dict"):
        return config
    for key, value in text.to_dict().items():
        if key not in _NOT_LIFTED and not hasattr(config, key):
            setattr(config, key, getattr(text, key, value))
    return config


_NOT_LIFTED = frozenset({"model_type", "architectures", "transformers_version", "_name_or_path", "dtype",
                         "torch_dtype", "auto_map"})


def load_generation_config(path: str) -> dict:
    """The directory's generation_config.json as transformers reads it, only the fields that differ
    from its defaults (so an unset field stays unset); {} when the directory has none."""
    if not os.path.isfile(os.path.join(path, GENERATION_CONFIG)):
        return {}
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(path).to_diff_dict()


def _dequantized_on_load(config, quantization) -> bool:
    """DeepSeek's FP8 checkpoints (128 x 128 block scales: V3/R1's fp32 `weight_scale_inv`, V4's
    UE8M0, with V4's FP4 routed experts riding along): the model dequantizes them as it loads
    (models/deepseek_v4/weights.py, which V3's loader reuses). GPT-OSS's
    MXFP4 experts: the model keeps their blocks and scales as they are (layers/mxfp4_moe.py)."""
    from transformers.utils.quantization_config import QuantizationConfigMixin

    if not isinstance(quantization, dict):
        quantization = quantization.to_dict() if isinstance(quantization, QuantizationConfigMixin) else {}
    model_type, method = config.model_type, quantization.get("quant_method")
    if model_type == "gpt_oss" and method == "mxfp4":
        return True
    return (model_type in ("deepseek_v2", "deepseek_v3", "deepseek_v4") and method == "fp8"
            and list(quantization.get("weight_block_size") or [128, 128]) == [128, 128])


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's weight files: those named by the shard index, else every *.safetensors."""
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise ValueError(f"{index_path!r} names shard files that are missing: {missing}")
    else:
        names = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not names:
        raise ValueError(
            f"directory {path!r} has config.json but no *.safetensors weights; expected {EXPECTED_LAYOUT}"
        )
    return [os.path.join(path, name) for name in names]


def iter_safetensors(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(name, tensor)` file by file, tensor by tensor; floating tensors are cast to `dtype`,
    except 8-bit and packed 4-bit ones (quantized weights and their scales), which the model
    dequantizes with their scales."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and tensor.element_size() > 1:
                    tensor = tensor.to(dtype)
                yield name, tensor


class SafetensorsSlice:
    """One checkpoint tensor not read yet: its shape, and reads of a slice of it (`narrow`) or of
    all of it (`read`), cast as iter_safetensors casts. Valid while its file is open, i.e. until
    iter_safetensors_slices moves to the next tensor."""

    def __init__(self, view, dtype: torch.dtype):
        self._view, self._dtype = view, dtype
        self.shape = torch.Size(view.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._cast(self._view[tuple(index)])

    def read(self) -> torch.Tensor:
        return self._cast(self._view[:])

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.element_size() > 1:
            tensor = tensor.to(self._dtype)
        return tensor


def iter_safetensors_slices(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, SafetensorsSlice]]:
    """Stream `(name, SafetensorsSlice)` file by file: a tensor-parallel rank reads only its slices."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, SafetensorsSlice(f.get_slice(name), dtype)
