"""DeepSeek-V2 / V3 checkpoint tensors -> this package's parameters.

Names are HF's (`model.layers.3.self_attn.kv_b_proj.weight`, `model.layers.3.mlp.experts.7.gate_proj.weight`,
...), as DeepSeek ships them and transformers writes them. On the way in:

    FP8 e4m3 weights with `weight_scale_inv` (one fp32 scale per 128 x 128 block) are dequantized
        by DeepSeek-V4's reader (models/deepseek_v4/weights.py); with several ranks each reads only
        the scale blocks of its slice
    per-expert matrices (or transformers' stacked ones) go into `experts.gate_up_proj` /
        `experts.down_proj` (layers/fused_moe.FusedExperts); a rank never reads the experts it does not hold
    gate_proj | up_proj of the dense MLPs and shared experts go into their merged `gate_up_proj`
    the MTP layers (`model.layers.{L + i}.*`, L = num_hidden_layers) go to `mtp.layers.{i}.*` when
        the draft module is built, else are skipped; their copies of the shared embedding and head
        (`embed_tokens`, `shared_head.head`) are always skipped
    GGUF matrices kept in their blocks (`QuantWeight`, or a lazy slice that reads as one) swap their
        Linear / Embedding for its quantized twin (layers/quant_linear.py) once all pieces arrived, and
        experts become `QuantFusedExperts` (model.py); the tensors read as dense parameters are
        dequantized: kv_b_proj (the absorbed decode reads its per-head blocks) and the router
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref
from deepinfer.model_executor.layers.parallel_linear import shard_spec_of
from deepinfer.model_executor.layers.quant_linear import install_quantized, merged_sizes
from deepinfer.model_executor.models.deepseek_v4.names import expert_target
from deepinfer.model_executor.models.deepseek_v4.weights import dequantize_v4_weights, owned_tensors

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_GATE_UP = re.compile(r"^(.*\.(?:mlp|shared_experts))\.(gate|up)_proj\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # transformers' fused [E, out, in]
_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")
_DENSE_ONLY = (".kv_b_proj.weight",)  # Linear weights the model reads as tensors: never swapped for a twin


def renamed(weights: Iterable[tuple[str, object]], num_layers: int, num_mtp: int) -> Iterator[tuple[str, object]]:
    """Checkpoint names -> parameter names: main layers as they are, MTP layer L + i -> `mtp.layers.{i}.`
    (num_mtp: how many the model built; tensors of others and the shared copies are dropped unread)."""
    for name, tensor in weights:
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            yield name, tensor
            continue
        index, rest = int(m.group(1)) - num_layers, m.group(2)
        if index < num_mtp and not rest.startswith(_SHARED_COPIES):
            yield f"mtp.layers.{index}.{rest}", tensor


def load_deepseek_weights(model: nn.Module, weights: Iterable[tuple[str, object]], num_layers: int,
                          num_mtp: int) -> set[str]:
    """Copy (name, tensor) pairs into `model`; returns the parameter names loaded."""
    owned = owned_tensors(renamed(weights, num_layers, num_mtp),
                          lambda owner, expert: model.get_submodule(owner).owns(expert))
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    packed: dict[str, list[tuple[int | None, QuantWeight]]] = {}  # weight name -> its (piece, blocks)
    for name, tensor in _fp8_dequantized(owned):
        expert, stacked = expert_target(name), _STACKED.match(name)
        if expert is not None:
            owner, index, proj = expert
            model.get_submodule(owner).load_expert_weight(index, proj, tensor)
            loaded.add(f"{owner}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        elif stacked is not None:
            model.get_submodule(stacked.group(1)).load_stacked(stacked.group(2), tensor)
            loaded.add(name)
        elif "rotary_emb." not in name:
            loaded.add(_load_tensor(model, params, name, tensor, packed))
    install_quantized(model, packed)
    return loaded


def _fp8_dequantized(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """`weights` with FP8 / FP4 (weight, scale) pairs dequantized by DeepSeek-V4's reader; GGUF blocks
    pass by it unchanged (they carry their own scales)."""
    blocks: deque = deque()

    def others():
        for name, tensor in weights:
            if _holds_blocks(tensor):
                blocks.append((name, tensor))
            else:
                yield name, tensor

    for item in dequantize_v4_weights(others(), torch.float32):
        while blocks:
            yield blocks.popleft()
        yield item
    yield from blocks


def _holds_blocks(tensor) -> bool:
    """Whether a checkpoint tensor is a `QuantWeight`, or a lazy slice whose rows read as one (probed
    with its first row: a lazy slice reads no more)."""
    if isinstance(tensor, torch.Tensor | QuantWeight):
        return isinstance(tensor, QuantWeight)
    return len(tensor.shape) > 0 and tensor.shape[0] > 0 and isinstance(tensor.narrow(0, 0, 1), QuantWeight)


def _load_tensor(model: nn.Module, params: dict, name: str, tensor, packed: dict) -> str:
    """Copy one tensor (a lazy slice: only this rank's slice is read) into its parameter, or (GGUF
    blocks of a Linear or Embedding weight) add it to `packed` for the module's quantized twin; its name."""
    m = _GATE_UP.match(name)
    target, piece = (f"{m.group(1)}.gate_up_proj.weight", int(m.group(2) == "up")) if m else (name, 0)
    if target not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
    owner, _, leaf = target.rpartition(".")
    module = model.get_submodule(owner)
    spec = shard_spec_of(module, leaf)  # split (or merged) parameters say which slice of which piece they hold
    dst = params[target].data
    value = spec.read(piece, tensor, name, dst.shape) if spec is not None else _whole(tensor)
    if isinstance(value, QuantWeight):
        if isinstance(module, nn.Linear | nn.Embedding) and not target.endswith(_DENSE_ONLY):
            merged = merged_sizes(module) is not None  # pieces stacked on its rows
            packed.setdefault(target, []).append((piece if merged else None, value))
            return target
        value = dequantize_ref(value)  # [rows, cols] fp32
    if spec is not None:
        spec.local(dst, piece).copy_(value)
        return target
    if value.shape != dst.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(value)
    return target


def _whole(tensor) -> torch.Tensor | QuantWeight:
    """A checkpoint tensor itself, or a lazy slice read whole."""
    return tensor if isinstance(tensor, torch.Tensor | QuantWeight) else tensor.read()
