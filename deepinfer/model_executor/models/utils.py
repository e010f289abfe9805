"""Weight loading into merged projections (q|k|v, gate|up); quantized weights swap their module."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight
from deepinfer.model_executor.layers.parallel_linear import shard_spec_of
from deepinfer.model_executor.layers.quant_linear import install_quantized

# HF name fragment -> (our merged parameter fragment, shard index)
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 skip_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Copy HF-named tensors into `model`; returns the names of parameters that were loaded.

    A merged parameter must expose `shard_sizes` (rows per shard) on its module. A `QuantWeight`
    (a weight kept quantized) replaces its module by the quantized twin once all shards arrived.
    A module split over tensor-parallel ranks (`shard_specs`, layers/parallel_linear.py) gets only
    its slice: a tensor may be a lazy slice (loader/hf.py SafetensorsSlice, loader/gguf_slice.py
    GGUFSlice), of which only the rank's rows or columns are read; a parameter held whole reads it in
    full. A GGUF slice kept quantized answers with a QuantWeight of the rank's rows or columns.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    quantized: dict[str, list[tuple[int | None, QuantWeight]]] = {}
    for name, tensor in weights:
        if name.startswith(skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        target, shard = _target(name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        value = _rank_value(model, target, params[target], shard, tensor, name)
        if isinstance(value, QuantWeight):
            quantized.setdefault(target, []).append((shard, value))
        loaded.add(target)
    install_quantized(model, quantized)
    return loaded


def _rank_value(model: nn.Module, target: str, param: torch.Tensor, shard: int | None, tensor, name: str):
    """Copy one checkpoint tensor (or merged piece `shard` of it) into `param` (the rank's slice of
    a split parameter, else all of it); a quantized weight is returned instead, for its module's twin."""
    owner = _owner(model, target)
    spec = shard_spec_of(owner, target.rsplit(".", 1)[-1])
    value = spec.read(shard or 0, tensor, name, param.shape) if spec is not None else _full(tensor)
    if isinstance(value, QuantWeight):
        return value
    if spec is not None:
        spec.local(param.data, shard or 0).copy_(value)
    elif shard is None:
        _copy(param.data, value, name)
    else:
        sizes = owner.shard_sizes
        start = sum(sizes[:shard])
        _copy(param.data[start:start + sizes[shard]], value, name)
    return None


def _full(tensor) -> torch.Tensor | QuantWeight:
    """A checkpoint tensor itself, or a lazy slice read whole."""
    return tensor if isinstance(tensor, torch.Tensor | QuantWeight) else tensor.read()


def _target(name: str) -> tuple[str, int | None]:
    for hf, ours, shard in STACKED_PARAMS:
        if hf in name:
            return name.replace(hf, ours), shard
    return name, None


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    owner = param_name.rpartition(".")[0]
    return model.get_submodule(owner) if owner else model


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
