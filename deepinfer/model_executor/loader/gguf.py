"""GGUF files: one header pass (`gguf_file`) for metadata and tensors, each dequantized once
with `gguf.quants.dequantize`, straight into the compute dtype, or (`keep_quantized`) its matrices
kept as `QuantWeight`s of the file's own blocks (`gguf_repack`). With several tensor-parallel
ranks, each rank decodes only its slices (`iter_gguf_slices`, `gguf_slice`).

Layout facts this module undoes (llama.cpp's converter applies them when it writes the file):

    shapes        listed innermost-first: GGUF [576, 49152] is torch [49152, 576]
    llama q/k     rows permuted per head for interleaved RoPE (HF rotates halves). Within a head
                  the file holds rows (0, d/2, 1, d/2+1, ...); undo it per head:
                  [H * d, in] -> [H, d/2, 2, in] -> swap 1,2 -> [H, 2, d/2, in] -> [H * d, in]
                  (only the llama architecture; qwen2, qwen3 and gemma3 keep HF's row order)
    gemma norms   stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w): subtract 1 in float32 (gemma2, gemma3)
    phi3          fused `attn_qkv` (q | k | v rows) and `ffn_up` (gate | up rows), named as HF's fused
                  `qkv_proj` / `gate_up_proj` (models/phi3.py cuts them); LongRoPE's factors are the
                  tensors `rope_factors_short` / `rope_factors_long`: turned into `rope_parameters`
    llama 3 rope  a `rope_freqs` tensor instead of config keys: turned into `rope_parameters`
    experts       one 3-D tensor per projection, `blk.N.ffn_{gate,up,down}_exps` [E, rows, cols]:
                  cut into E per-expert matrices named as HF's `mlp.experts.e.{gate,up,down}_proj`
    deepseek2     MLA's kv_b_proj (whole, or split into attn_k_b | attn_v_b), the router bias and
                  next-n blocks: gguf_deepseek2.py
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight
from deepinfer.model_executor.loader.gguf_cache import load_derived
from deepinfer.model_executor.loader.gguf_config import SUPPORTED_GGUF_ARCHITECTURES, gguf_config_dict
from deepinfer.model_executor.loader.gguf_deepseek2 import DEEPSEEK2_BLOCK_NAMES, DENSE_PARTS, iter_deepseek2_tensors
from deepinfer.model_executor.loader.gguf_file import GGUFFile, GGUFTensor, as_tensor, gguf_parts, read_gguf_file
from deepinfer.model_executor.loader.gguf_gpt_oss import is_expert_stack, iter_gpt_oss_experts
from deepinfer.model_executor.loader.gguf_repack import is_packed, packed_gguf
from deepinfer.model_executor.loader.gguf_slice import GGUFSlice
from deepinfer.model_executor.loader.model_source import ModelSource, compute_identity

__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "load_gguf_source", "gguf_to_hf_name", "dequantize_tensor",
           "packed_file_bytes"]

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
_MOE_NAMES = {  # the router, and Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# a 3-D tensor [E, rows, cols] of every expert's matrix -> the per-expert HF projection name
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GPT_OSS_NAMES = {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                  "ffn_gate_inp": "mlp.router"}  # its expert stacks: gguf_gpt_oss.py
_ARCH_BLOCK_NAMES = {
    "gpt-oss": {**_BLOCK_NAMES, **_GPT_OSS_NAMES},
    "llama": {**_BLOCK_NAMES, **_MOE_NAMES},  # with experts: Mixtral
    "qwen2": _BLOCK_NAMES,
    "qwen2vl": _BLOCK_NAMES,
    "qwen3": {**_BLOCK_NAMES, **_QK_NORM_NAMES},
    "qwen2moe": {**_BLOCK_NAMES, **_MOE_NAMES},
    "qwen3moe": {**_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES},
    "gemma3": {
        **_BLOCK_NAMES,
        **_QK_NORM_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gemma2": {
        **_BLOCK_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "deepseek2": DEEPSEEK2_BLOCK_NAMES,
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # consumed into the config, not a parameter
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # phi3's LongRoPE: config too
_MAX_WORKERS = 4  # decoding threads
logger = logging.getLogger("deepinfer.loader")


def load_gguf_source(path: str) -> ModelSource:
    """A `ModelSource` for a .gguf file; ValueError for an unsupported architecture or bad metadata.

    `tokenizer` is None when the file carries no tokenizer metadata. The config and tokenizer come
    from the cache once built (gguf_cache.py); the weights are read from the file's read-only
    mapping, each pass mapping it again (the pages are the page cache's, shared by every mapping).
    """
    file = read_gguf_file(path)
    arch = file.metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path!r} has architecture {arch!r}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    identity = compute_identity(path, gguf_parts(path))  # every part of a split set
    derived = load_derived(path, identity, _config_fields(file, arch), "tokenizer.ggml.model" in file.metadata)
    config = derived.config
    return ModelSource(
        path=path,
        format="gguf",
        hf_config=config,
        tokenizer=derived.tokenizer,
        identity=identity,
        _weights=lambda dtype, keep_quantized=False: iter_gguf_weights(
            read_gguf_file(path).tensors, arch, config, dtype, keep_quantized),
        _weight_slices=lambda dtype, keep_quantized=False: iter_gguf_slices(
            read_gguf_file(path).tensors, arch, config, dtype, keep_quantized),
    )


def _config_fields(file: GGUFFile, arch: str) -> dict:
    """The transformers config fields of the file (gguf_config.py), with the RoPE tensors it reads."""
    tensors = {tensor.name: tensor for tensor in file.tensors}
    rope_freqs = rope_factors = None
    if _ROPE_FREQS in tensors:
        rope_freqs = dequantize_tensor(tensors[_ROPE_FREQS], torch.float32).numpy()
    if all(name in tensors for name in _ROPE_FACTORS):
        rope_factors = tuple(dequantize_tensor(tensors[name], torch.float32).numpy() for name in _ROPE_FACTORS)
    shapes = {name: tensor.shape for name, tensor in tensors.items()}
    types = {name: tensor.tensor_type.name for name, tensor in tensors.items()}
    return gguf_config_dict(arch, file.metadata, shapes, rope_freqs, rope_factors, tensor_types=types)


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


def iter_gguf_weights(
    tensors: list[GGUFTensor], arch: str, config: Any, dtype: torch.dtype, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Yield `(hf_name, tensor)` for every parameter tensor in file order, in HF layout and `dtype`;
    with `keep_quantized`, matrices of a packed type come as `QuantWeight`s instead.

    Names are checked before any tensor is decoded; decoding runs on a few threads (numpy and
    torch release the GIL) with a bounded look-ahead, so memory stays at a few tensors. A matrix
    kept packed (a view of the mapping) and a vector are made at once: a thread hop costs more.
    """
    tensors = yield from _gpt_oss_experts(tensors, arch, dtype)
    tensors = yield from _deepseek2_tensors(tensors, arch, config, dtype)
    jobs = _named_tensors(tensors, arch)
    num_workers = min(_MAX_WORKERS, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        pending: deque = deque()
        for hf_name, tensor in jobs:
            args = (tensor, arch, config, dtype, keep_quantized)
            light = len(tensor.shape) == 1 or (keep_quantized and is_packed(tensor.tensor_type.name, tensor.shape))
            pending.append((hf_name, _done(to_hf_tensor, *args) if light else pool.submit(to_hf_tensor, *args)))
            if len(pending) > 2 * num_workers:
                name, future = pending.popleft()
                yield name, future.result()
        while pending:
            name, future = pending.popleft()
            yield name, future.result()


def _done(fn, *args) -> Future:
    """fn(*args) run here, as a finished Future (its exception kept for `result()`, as a pool's)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future


def iter_gguf_slices(tensors: list[GGUFTensor], arch: str, config: Any, dtype: torch.dtype,
                     keep_quantized: bool = False) -> Iterator[tuple[str, GGUFSlice]]:
    """Yield `(hf_name, GGUFSlice)` in file order: nothing is decoded until a rank asks for its slice
    (as iter_gguf_weights would decode it, cut to the slice); GPT-OSS's experts come as lazy stacks
    (loader/gguf_gpt_oss.py) that decode only the experts a rank holds."""
    tensors = yield from _gpt_oss_experts(tensors, arch, dtype)
    tensors = yield from _deepseek2_tensors(tensors, arch, config, dtype)
    jobs = _named_tensors(tensors, arch)

    def decode(tensor: GGUFTensor, num_heads: int | None) -> torch.Tensor | QuantWeight:
        return to_hf_tensor(tensor, arch, config, dtype, keep_quantized, num_heads)

    for hf_name, tensor in jobs:
        yield hf_name, GGUFSlice(tensor, decode, _head_rows(tensor, arch, config))


def _gpt_oss_experts(tensors: list[GGUFTensor], arch: str, dtype: torch.dtype):
    """For gpt-oss, yield its experts in the HF checkpoint's layout (gguf_gpt_oss.py) and return the
    other tensors; other architectures: yield nothing, return all."""
    if arch != "gpt-oss":
        return tensors
    yield from iter_gpt_oss_experts([t for t in tensors if is_expert_stack(t.name)], dtype, dequantize_tensor)
    return [t for t in tensors if not is_expert_stack(t.name)]


def _deepseek2_tensors(tensors: list[GGUFTensor], arch: str, config: Any, dtype: torch.dtype):
    """For deepseek2, yield its tensors in HF layout that need more than a rename (gguf_deepseek2.py, whole:
    a rank slices them as dense tensors) and return the others; other architectures: yield nothing, return all."""
    if arch != "deepseek2":
        return tensors
    return (yield from iter_deepseek2_tensors(tensors, config, dtype, dequantize_tensor))


def _named_tensors(tensors: list[GGUFTensor], arch: str) -> list[tuple[str, GGUFTensor]]:
    """(HF name, tensor) of every parameter tensor, names checked. A 3-D expert tensor
    `blk.N.ffn_gate_exps` [E, rows, cols] becomes E matrices `model.layers.N.mlp.experts.e.gate_proj.weight`,
    each a view of that expert's rows in the file (kept quantized, a matrix is one expert's blocks)."""
    jobs = []
    for tensor in tensors:
        if tensor.name == _ROPE_FREQS or tensor.name in _ROPE_FACTORS:
            continue
        parts = tensor.name.split(".")
        if len(parts) != 4 or parts[2] not in _EXPERT_NAMES or "ffn_gate_inp" not in _ARCH_BLOCK_NAMES[arch]:
            jobs.append((gguf_to_hf_name(arch, tensor.name), tensor))
            continue
        if len(tensor.shape) != 3:
            raise ValueError(f"GGUF tensor {tensor.name!r} has shape {tensor.shape}, expected [experts, rows, cols]")
        prefix = f"model.layers.{parts[1]}.mlp.experts"
        jobs += [(f"{prefix}.{e}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}", _expert_matrix(tensor, e))
                 for e in range(tensor.shape[0])]
    return jobs


def _expert_matrix(tensor: GGUFTensor, expert: int) -> GGUFTensor:
    """Expert `expert`'s [rows, cols] matrix of a 3-D expert tensor: a view of its bytes."""
    return dataclasses.replace(tensor, shape=tensor.shape[1:], data=tensor.data[expert])


def _head_rows(tensor: GGUFTensor, arch: str, config: Any) -> int | None:
    """Rows per head of a llama q/k weight (its rows interleave within heads), else None."""
    part = tensor.name.split(".")[-2]
    if arch != "llama" or part not in ("attn_q", "attn_k") or len(tensor.shape) != 2:
        return None
    heads = config.num_attention_heads if part == "attn_q" else config.num_key_value_heads
    return tensor.shape[0] // heads


def to_hf_tensor(tensor: GGUFTensor, arch: str, config: Any, dtype: torch.dtype,
                 keep_quantized: bool = False, num_heads: int | None = None) -> torch.Tensor | QuantWeight:
    """One tensor decoded into HF layout: Gemma norms lose their +1 (in float32), llama q/k rows
    get their HF order back (in a QuantWeight, whole rows of blocks are moved);
    `num_heads`: how many heads a q/k tensor holds, when it is a slice of whole heads."""
    part = tensor.name.split(".")[-2]
    if arch in ("gemma2", "gemma3") and part.endswith("norm"):
        return (dequantize_tensor(tensor, torch.float32) - 1.0).to(dtype)
    weight = _quantized(tensor) if keep_quantized else None
    if weight is None:
        weight = dequantize_tensor(tensor, dtype)
    if arch == "llama" and part in ("attn_q", "attn_k"):
        num_heads = num_heads or (config.num_attention_heads if part == "attn_q" else config.num_key_value_heads)
        weight = _map_rows(weight, lambda rows: unpermute_qk(rows, num_heads))
    return weight


_FLOAT_TYPES = ("F32", "F16", "BF16")


def _quantized(tensor: GGUFTensor) -> QuantWeight | None:
    """The tensor kept quantized, or None: a float tensor, or a type without a packed layout (then
    dequantized, with one log line per type)."""
    kind = tensor.tensor_type.name
    if kind in _FLOAT_TYPES or len(tensor.shape) != 2:
        return None
    weight = packed_gguf(kind, tensor.data, tensor.shape)
    if weight is None and kind not in _UNPACKED_LOGGED:
        _UNPACKED_LOGGED.add(kind)
        logger.warning("GGUF type %s has no quantized kernel: its tensors (e.g. %s) are dequantized", kind, tensor.name)
    return weight


_UNPACKED_LOGGED: set[str] = set()


def _packed_tensors(path: str) -> list[GGUFTensor]:
    """The matrices of the file that loading keeps packed (from the tensor table; nothing is read)."""
    packed = []
    for tensor in read_gguf_file(path).tensors:
        kind, part = tensor.tensor_type.name, tensor.name.split(".")[-2]
        if part in DENSE_PARTS:
            continue  # deepseek2's MLA up-projections: loaded dense
        expert_stack = part in _EXPERT_NAMES and len(tensor.shape) == 3
        if is_packed(kind, tensor.shape[1:] if expert_stack else tensor.shape):  # an expert stack: per expert
            packed.append(tensor)
    return packed


def packed_file_bytes(path: str) -> dict[str, int]:
    """ggml type -> bytes in the file of the matrices that loading keeps packed: what `deepinfer
    info` sets the packed weights' bytes against."""
    sizes: dict[str, int] = {}
    for tensor in _packed_tensors(path):
        sizes[tensor.tensor_type.name] = sizes.get(tensor.tensor_type.name, 0) + tensor.data.nbytes
    return sizes


def packed_file_elements(path: str) -> int:
    """Values of the matrices that loading keeps packed (they stay the file's mapped pages)."""
    return sum(math.prod(tensor.shape) for tensor in _packed_tensors(path))


def _map_rows(weight: torch.Tensor | QuantWeight, fn) -> torch.Tensor | QuantWeight:
    """Apply a row permutation to a dense weight, or to a QuantWeight's rows of blocks (gathered by
    numpy from the mapping into a new array: one thread, where torch's copy would wait for its
    thread pool on a busy machine)."""
    if isinstance(weight, torch.Tensor):
        return fn(weight)
    order = fn(torch.arange(weight.data.shape[0])).numpy()  # [N]: the source row of each row
    return dataclasses.replace(weight, data=torch.from_numpy(weight.data.numpy()[order]))


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of a q/k weight [H * d, in] or bias [H * d]."""
    rows, rest = weight.shape[0], weight.shape[1:]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"q/k tensor with {rows} rows cannot be split into {num_heads} heads of even size")
    w = weight.reshape(num_heads, head_dim // 2, 2, *rest)  # [H, d/2, 2, in]: file order
    return w.transpose(1, 2).reshape(rows, *rest).contiguous()  # [H * d, in]: HF order


def dequantize_tensor(tensor: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a new torch tensor of `dtype` in torch shape (float types are not widened)."""
    from gguf import GGMLQuantizationType, quants

    kind = tensor.tensor_type
    data = tensor.data
    if kind not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        values = torch.from_numpy(quants.dequantize(data, kind))  # float32, a fresh array
        return values.to(dtype).reshape(tensor.shape)
    if kind == GGMLQuantizationType.BF16:
        values = as_tensor(data.view(np.int16)).view(torch.bfloat16)  # [..., cols] bytes -> values
    else:
        values = as_tensor(data)  # a view of the file mapping: copied right below
    return values.to(dtype, copy=True).reshape(tensor.shape)
