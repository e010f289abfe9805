"""The steps of a Llama-family stack (Llama, Mistral, Qwen2/3, Gemma 2/3 with their sandwich norms)
as straight calls: the same kernels, none of the Python around them.

Why: at one token a step a 1.5B model's layers take ~50 ms on 2 CPU cores of Xeon family 6 model
207, ~5 ms of them Python around the kernels: per layer ~11 `nn.Module` calls (each with its hook
checks; a submodule lookup alone costs ~1 us), six FusedOp dispatches (each works out its call
class from its tensors' dtypes), the attention layer's metadata lookup and the backend's step
order. A 135M model spends a fifth of its decode step there (docs/benchmarks.md). Decode, short
verifications and small batches pay it per token; a long prefill hardly notices.

What: `LayerPlan` is the stack's modules and kernels read once: per layer its norms' weights,
projections, RoPE tables, attention layer and cache, and the kernel each FusedOp would pick for
the model's call class (fp32 CPU, the kernel library, the cache's row format), checked with the
op's own `serves`. A step then runs `DecoderLayer.forward` -> `LlamaAttention.forward` ->
`Attention.forward` as the calls they end in, in their order, with their arguments: the same bits
(a test compares every logprob with the modules' for each served family, cache format and step
kind). Linear layers run their own `forward`, whatever their weight format; attention runs the
backend's `forward`, or, in a step of decode tokens only, the two kernel calls it ends in (store
the new rows, then read through the index rows).

Kept while current: each step checks, in one pass, that every module, parameter and cache the plan
holds is still the one its parent holds and has no forward hook (LoRA's adapters hook their layers),
and the kernel library's instruction set; `DecoderModel._apply` (.to(), .float()) drops the plan.
A stack it does not serve (another attention class, MoE layers, partial RoPE, bf16, MXFP8
cache rows, another backend, a hooked module) runs through its modules, as do steps with pictures or a global
forward hook, and every step when DEEPINFER_LAYER_LOOP=0. A refusal is kept like a plan (the parts
read up to the refused one), so a stack it does not serve costs one check per step, not a new plan.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from deepinfer.model_executor.forward_context import get_forward_context
from deepinfer.model_executor.layers.activation import GatedMLP
from deepinfer.model_executor.layers.attention import invariant
from deepinfer.model_executor.layers.attention.backend import TorchAttentionBackend
from deepinfer.model_executor.layers.norm import RMSNorm, rms_norm
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.model_executor.layers.ops.fused import FusedOp
from deepinfer.model_executor.layers.rotary import RotaryEmbedding
from deepinfer.model_executor.models.decoder import DecoderLayer

_Norm = tuple[torch.Tensor, float, float]  # (weight, eps, offset)


class _Layer(NamedTuple):
    """One layer's parts, as its modules hold them."""

    input_norm: _Norm
    qkv: nn.Module
    shapes: tuple[list[int], int, int, int]  # (q|k|v sizes, H, H_kv, D)
    qk_norms: tuple[_Norm, _Norm] | None
    rope: tuple[Any, torch.Tensor, torch.Tensor]  # (kernel, cos, sin)
    attn: nn.Module  # layers/attention/layer.Attention
    cache: Any  # its LayerCache
    o_proj: nn.Module
    post_norm: _Norm
    gate_up: nn.Module
    act: Any  # the activation's kernel
    down: nn.Module
    sandwich: tuple[_Norm, _Norm] | None  # Gemma's pre- and post-feedforward norms


class LayerPlan(NamedTuple):
    """A stack's plan; a refused one (`served` False) keeps what it read up to the part it refused,
    so that the refusal stands, without being worked out again each step, while those parts do."""

    served: bool
    hooked: bool  # refused for a forward hook on a module it would call: stands while one is there
    isa: int
    stack: dict  # the ModuleList's modules: the plan is for as many layers as it held
    layers: list[_Layer]
    store: Any  # the backend's store_rows kernel
    backend: Any  # a TorchAttentionBackend (the CPU's batch-invariant one) when served
    held: list[tuple[dict, str, Any]]  # (holder's dict, name, what the plan took from it)
    modules: list[nn.Module]  # every module whose call the plan stands in for (their hooks)


def run_layers(attention_type: type, model: nn.Module, positions: torch.Tensor,
               h: torch.Tensor) -> torch.Tensor | None:
    """h [T, hidden] after `model.layers`, or None when this stack is not one this path runs (the
    caller runs the modules then). The plan is kept in `model._layer_plan`."""
    if not loop_enabled() or h.dtype is not torch.float32 or not h.is_cpu:
        return None
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return None
    md = get_forward_context().attn_metadata
    if md is None:
        return None
    plan = model._layer_plan
    if plan is None or not _current(plan):
        plan = model._layer_plan = build_plan(attention_type, model.layers, h)
    if not plan.served:
        return None
    decodes = md.num_decode_tokens == h.shape[0] and not any(group.prefills for group in md.groups)
    for layer in plan.layers:
        h = _run_layer(plan, layer, md, decodes, positions, h)  # [T, hidden]
    return h


@functools.cache
def loop_enabled() -> bool:
    """DEEPINFER_LAYER_LOOP (default 1), read once per process (`loop_enabled.cache_clear()` reads it again)."""
    return os.environ.get("DEEPINFER_LAYER_LOOP", "1") != "0"


def _current(plan: LayerPlan) -> bool:
    if plan.isa != kernel_isa() or (plan.served and len(plan.stack) != len(plan.layers)):
        return False
    return all(holder.get(name) is part for holder, name, part in plan.held) and _hooked(plan) == plan.hooked


def _hooked(plan: LayerPlan) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in plan.modules)


def build_plan(attention_type: type, layers: nn.ModuleList, h: torch.Tensor) -> LayerPlan:
    """The plan of `layers` for steps like h's (fp32 CPU), refused (`served` False) where a part is
    not served."""
    plan = LayerPlan(False, False, kernel_isa(), layers._modules, [], None, None, [], [])
    backend = _cpu_backend(plan, layers)
    if not plan.isa or backend is None:
        return plan
    plan = plan._replace(backend=backend, store=backend.kernels.store_rows.kernel)
    for i, layer in enumerate(layers):
        plan.held.append((layers._modules, str(i), layer))
        step = _plan_layer(plan, layer, attention_type, h)
        if step is None:
            return plan  # refused at this layer
        if _hooked(plan):
            return plan._replace(hooked=True)
        plan.layers.append(step)
    return plan._replace(served=True)


def _cpu_backend(plan: LayerPlan, layers: nn.ModuleList) -> TorchAttentionBackend | None:
    """The first layer's attention backend when it is the CPU's batch-invariant torch backend with
    the fused store, else None (held either way: a later binding is seen)."""
    attn = getattr(getattr(layers[0], "self_attn", None), "attn", None) if len(layers) else None
    if not isinstance(attn, nn.Module) or "backend" not in attn.__dict__:
        return None
    backend = _take(plan, attn, "backend", "__dict__")
    if type(backend) is not TorchAttentionBackend or not backend.cpu_invariant:
        return None
    return backend if isinstance(backend.kernels.store_rows, FusedOp) else None


def _take(plan: LayerPlan, holder: nn.Module, name: str, kind: str = "_modules"):
    """holder's `name` (a submodule, parameter or buffer), recorded so that a later step can check
    that holder still holds it."""
    part = getattr(holder, kind)[name]
    plan.held.append((getattr(holder, kind), name, part))
    if isinstance(part, nn.Module):
        plan.modules.append(part)
    return part


def _plan_layer(plan: LayerPlan, layer: nn.Module, attention_type: type, h: torch.Tensor) -> _Layer | None:
    if type(layer) is not DecoderLayer:
        return None
    plan.modules.append(layer)
    a, mlp = _take(plan, layer, "self_attn"), _take(plan, layer, "mlp")
    if type(a) is not attention_type or type(mlp) is not GatedMLP:
        return None
    names = ["input_layernorm", "post_attention_layernorm"]
    if layer.sandwich:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    norms = [_norm(plan, layer, name, h) for name in names]
    qk_norms = (_norm(plan, a, "q_norm", h), _norm(plan, a, "k_norm", h)) if a.qk_norm else None
    rope, attn, act = _rope(plan, a, h), _take(plan, a, "attn"), _act(plan, mlp, h)
    cache = _take(plan, attn, "kv_cache", "__dict__")
    if None in norms or None in (qk_norms or ()) or rope is None or act is None or cache is None:
        return None
    if _take(plan, attn, "backend", "__dict__") is not plan.backend or not _serves_cache(plan, cache, h):
        return None
    shapes = (a.qkv_proj.shard_sizes, a.num_heads, a.num_kv_heads, a.head_dim)
    return _Layer(norms[0], _take(plan, a, "qkv_proj"), shapes, qk_norms, rope, attn, cache,
                  _take(plan, a, "o_proj"), norms[1], _take(plan, mlp, "gate_up_proj"), act,
                  _take(plan, mlp, "down_proj"), (norms[2], norms[3]) if layer.sandwich else None)


def _norm(plan: LayerPlan, holder: nn.Module, name: str, h: torch.Tensor) -> _Norm | None:
    norm = _take(plan, holder, name)
    if type(norm) is not RMSNorm:
        return None
    weight = _take(plan, norm, "weight", "_parameters")
    return (weight, norm.eps, norm.offset) if rms_norm.serves(rms_norm.kind(h, weight, norm.eps)) else None


def _rope(plan: LayerPlan, attention: nn.Module, h: torch.Tensor):
    rotary = _take(plan, attention, "rotary")
    if type(rotary) is not RotaryEmbedding or rotary.rotary_dim != attention.head_dim:
        return None
    cos, sin = _take(plan, rotary, "cos", "_buffers"), _take(plan, rotary, "sin", "_buffers")
    op = rotary._rope
    return (op.kernel, cos, sin) if op.serves(op.kind(h, h, None, cos, sin)) else None


def _act(plan: LayerPlan, mlp: nn.Module, h: torch.Tensor):
    act = _take(plan, mlp, "act", "__dict__")
    return act.kernel if isinstance(act, FusedOp) and act.serves(act.kind(h)) else None


def _serves_cache(plan: LayerPlan, cache, h: torch.Tensor) -> bool:
    """Whether the store and the decode attention kernels serve this cache's rows."""
    store = plan.backend.kernels.store_rows
    decode = invariant.decode_attention
    return store.serves(store.kind(cache, None, h, h)) and decode.serves(decode.kind(cache, h, None, None, 1.0))


def _run_layer(plan: LayerPlan, layer: _Layer, md, decodes: bool, positions: torch.Tensor,
               h: torch.Tensor) -> torch.Tensor:
    """DecoderLayer.forward: h [T, hidden] -> [T, hidden]."""
    attn = _attention(plan, layer, md, decodes, positions, _rms(plan, layer.input_norm, h))  # [T, hidden]
    if layer.sandwich is None:
        h = h + attn  # [T, hidden]
        x = layer.gate_up.forward(_rms(plan, layer.post_norm, h))  # [T, 2I]
        return h + layer.down.forward(layer.act(plan.isa, x))  # [T, hidden]
    pre_ff, post_ff = layer.sandwich
    h = h + _rms(plan, layer.post_norm, attn)  # [T, hidden]
    x = layer.gate_up.forward(_rms(plan, pre_ff, h))  # [T, 2I]
    return h + _rms(plan, post_ff, layer.down.forward(layer.act(plan.isa, x)))  # [T, hidden]


def _rms(plan: LayerPlan, norm: _Norm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm.kernel(plan.isa, x, *norm)  # [..., E]


def _attention(plan: LayerPlan, layer: _Layer, md, decodes: bool, positions: torch.Tensor,
               x: torch.Tensor) -> torch.Tensor:
    """LlamaAttention.forward: x [T, hidden] -> [T, hidden]; `decodes`: the step's tokens are all
    decode tokens (no prefill segment)."""
    (sizes, H, H_kv, D), T = layer.shapes, x.shape[0]
    q, k, v = layer.qkv.forward(x).split(sizes, dim=-1)  # [T, H*D], [T, H_kv*D] x2
    q, k, v = q.view(T, H, D), k.view(T, H_kv, D), v.view(T, H_kv, D)
    if layer.qk_norms is not None:
        q, k = _rms(plan, layer.qk_norms[0], q), _rms(plan, layer.qk_norms[1], k)
    rope, cos, sin = layer.rope
    q, k = rope(plan.isa, q, k, positions, cos, sin)  # [T, H, D], [T, H_kv, D]
    attn, cache = layer.attn, layer.cache
    group = md.groups[attn.group_index]
    if not decodes:
        out = plan.backend.forward(cache, q, k, v, md, group, attn.scale, attn.softcap, attn.sinks)  # [T, H, D]
        return layer.o_proj.forward(out.reshape(T, H * D))  # [T, hidden]
    rows = group.store_rows  # the backend's step order for decode tokens only: store, then read
    plan.store(plan.isa, cache, group.store_slots, k if rows is None else k[rows], v if rows is None else v[rows])
    first = plan.backend.layouts.first(md, group)  # [T]
    out = invariant.decode_attention.kernel(plan.isa, cache, q, group.decode_index, first, attn.scale, attn.softcap,
                                            attn.sinks)  # [T, H, D]
    return layer.o_proj.forward(out.reshape(T, H * D))  # [T, hidden]
