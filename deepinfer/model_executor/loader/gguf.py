"""GGUF files: one `gguf.GGUFReader` pass for metadata and tensors, dequantized once per tensor.

Layout facts this module undoes (llama.cpp's converter applies them when it writes the file):

    shapes        listed innermost-first: GGUF [576, 49152] is torch [49152, 576]
    llama q/k     rows permuted per head for interleaved RoPE; HF rotates halves, so undo it:
                  [n_head * d, in] -> [n_head, 2, d/2, in] -> swap -> [n_head, d/2, 2, in] -> [n_head * d, in]
                  (only the llama architecture; qwen2, qwen3 and gemma3 keep HF's row order)
    gemma3 norms  stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w): subtract 1 in float32
    llama 3 rope  a `rope_freqs` tensor instead of config keys: turned into `rope_parameters`
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from deepinfer.model_executor.loader.gguf_config import SUPPORTED_GGUF_ARCHITECTURES, gguf_config_dict
from deepinfer.model_executor.loader.source import ModelSource, compute_identity

__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "load_gguf_source", "gguf_to_hf_name", "dequantize_tensor"]

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ARCH_BLOCK_NAMES = {
    "llama": _BLOCK_NAMES,
    "qwen2": _BLOCK_NAMES,
    "qwen3": {**_BLOCK_NAMES, **_QK_NORM_NAMES},
    "gemma3": {
        **_BLOCK_NAMES,
        **_QK_NORM_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # consumed into the config, not a parameter
_LARGE_ARRAY = 4096  # metadata arrays longer than this (the vocabulary) are not read for the config


def load_gguf_source(path: str) -> ModelSource:
    """A `ModelSource` for a .gguf file; ValueError for an unsupported architecture or bad metadata."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    reader = GGUFReader(path)
    metadata = read_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path!r} has architecture {arch!r}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    shapes = {name: _torch_shape(tensor) for name, tensor in tensors.items()}
    rope_freqs = None
    if _ROPE_FREQS in tensors:
        rope_freqs = dequantize_tensor(tensors[_ROPE_FREQS], torch.float32).numpy()
    config_dict = gguf_config_dict(arch, metadata, shapes, rope_freqs)
    config = AutoConfig.for_model(**config_dict)
    return ModelSource(
        path=path,
        format="gguf",
        hf_config=config,
        tokenizer=load_gguf_tokenizer(path, config),
        identity=compute_identity(path, [path]),
        _weights=lambda dtype: iter_gguf_weights(reader, arch, config, dtype),
    )


def read_metadata(reader: Any) -> dict[str, Any]:
    """Scalar and short-array metadata as Python values (the vocabulary arrays are skipped)."""
    from gguf import GGUFValueType

    metadata = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY and len(field.data) > _LARGE_ARRAY:
            continue
        metadata[key] = field.contents()
    return metadata


def load_gguf_tokenizer(path: str, config: Any) -> Any:
    """The tokenizer and chat template stored in the file, built by transformers' GGUF support.

    `AutoTokenizer.from_pretrained(..., gguf_file=...)` would re-derive the config by parsing the
    whole vocabulary again; the tokenizer class it would pick is chosen here from our config.
    """
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        tokenizer_class = TOKENIZER_MAPPING.get(type(config), None) or TokenizersBackend
    except KeyError:
        tokenizer_class = TokenizersBackend
    return tokenizer_class.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def gguf_to_hf_name(arch: str, name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ValueError if unknown."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    match = _BLOCK_PATTERN.fullmatch(name)
    block_names = _ARCH_BLOCK_NAMES[arch]
    if match is None or match.group(2) not in block_names:
        raise ValueError(f"GGUF tensor {name!r} has no HF equivalent for architecture {arch!r}")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{block_names[part]}.{suffix}"


def iter_gguf_weights(reader: Any, arch: str, config: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every parameter tensor in file order, in HF layout and `dtype`."""
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        hf_name = gguf_to_hf_name(arch, tensor.name)
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            yield hf_name, (dequantize_tensor(tensor, torch.float32) - 1.0).to(dtype)
            continue
        weight = dequantize_tensor(tensor, dtype)
        if arch == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
            is_q = tensor.name.split(".")[-2] == "attn_q"
            weight = unpermute_qk(weight, config.num_attention_heads if is_q else config.num_key_value_heads)
        yield hf_name, weight


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of a q/k weight [num_heads * d, in] or bias [num_heads * d]."""
    rows, rest = weight.shape[0], weight.shape[1:]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"q/k tensor with {rows} rows cannot be split into {num_heads} heads of even size")
    w = weight.reshape(num_heads, 2, head_dim // 2, *rest)  # [H, 2, d/2, in]: file order
    return w.transpose(1, 2).reshape(rows, *rest).contiguous()  # [H * d, in]: HF order


def dequantize_tensor(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a new torch tensor of `dtype` in torch shape (float types are not widened)."""
    from gguf import GGMLQuantizationType, quants

    kind = tensor.tensor_type
    data = tensor.data
    with warnings.catch_warnings():  # the memory map is read-only; every path below copies
        warnings.simplefilter("ignore", UserWarning)
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = torch.from_numpy(data)
        elif kind == GGMLQuantizationType.BF16:
            values = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        else:
            values = torch.from_numpy(quants.dequantize(data, kind))  # float32, fresh
    return values.to(dtype, copy=values.data_ptr() == _data_ptr(data)).reshape(_torch_shape(tensor))


def _data_ptr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
