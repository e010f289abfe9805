"""Kernel sets: the one seam through which every layer reaches its kernels (attention, MoE, indexer, LoRA).

A `KernelSet` is a table of hooks, one per kernel-level operation. Three sets exist:

    hook               torch (reference, off the CPU)   cpu (C++ CPU kernels)     triton
    store_rows         LayerCache.store                 fused_cpu store_rows *    ops/triton/store.py
    decode_attention   SDPA over the indexed rows       fused_cpu decode_attn *   ops/triton/decode_attention.py
    prefill_attention  SDPA over [loaded | chunk]       torch                     torch
    sparse_mla         sparse_mla.decode_mla_mqa_sparse torch                     ops/triton/sparse_mla.py
    indexer_scores     sparse_mla.indexer_scores        torch                     ops/triton/indexer.py
    grouped_moe        layers/moe.grouped_experts       torch                     ops/triton/moe.py
    mxfp4_experts      None: per expert (mxfp4_moe.py)  None                      ops/triton/mxfp4.py
    lora_op            Triton on CUDA, else torch **    C++ fp32 *, else torch    Triton on CUDA, else as cpu
    lora_delta         runs the op `lora_op` names for the call (ops/lora.py)

    *  where the C++ kernel serves the call class (fp32 CPU inputs, plain rows, the library built;
       ops/fused.py picks once per class), else the torch hook: bit for bit what ran before.
    ** what the torch attention backend on CUDA has always run for LoRA (ops/triton/lora.py).

Both attention hooks take a layer's options last (attention/layer.py): `softcap` (None or the cap
of s = cap * tanh(s / cap)) and `sinks` (None or [H] logits in every query's softmax denominator,
adding no value). Every set honours both. `mxfp4_experts` is the one optional hook: None means the
layer runs its own per-expert loop (the C++ MXFP4 matmul on the CPU).

The set is chosen once per engine from the resolved attention backend and the device
(`kernels_for`, recorded in the numerics record as `kernel_set`); the runner hands it to LoRA at
install and to the model inside the backend (`BoundCaches.backend.kernels`), and each layer keeps
it: the Llama family's attention backend (attention/backend.py), DeepSeek-V3/V4's MLA and indexer,
the routed experts (fused_moe.py) and GPT-OSS's MXFP4 experts (mxfp4_moe.py). The Triton hooks
import their kernels on first call, so an engine on another set never imports triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from deepinfer.model_executor.layers.moe import grouped_experts
from deepinfer.model_executor.layers.ops import fused
from deepinfer.model_executor.layers.ops import torch_attention as torch_ref
from deepinfer.model_executor.layers.ops.lora import lora_cpu_op, lora_delta_by, lora_gpu_op, lora_op_name
from deepinfer.model_executor.layers.ops.torch_sparse_mla import decode_mla_mqa_sparse, indexer_scores


@dataclass(frozen=True)
class KernelSet:
    """One implementation of each hook (contracts in the comments; every hook but `mxfp4_experts` is set)."""

    name: str
    store_rows: Callable  # (cache, slots [M], k [M, H_kv, D], v [M, H_kv, D] | None) -> None
    # (cache, q [N, H, D], index [N, L], scale, lens [N] | None, softcap | None, sinks [H] | None) -> [N, H, D]
    decode_attention: Callable
    # (q [n, H, D], k, v [n, H_kv, D], loaded [n_old, 2, H_kv, D], q_pos [n], loaded_pos [n_old], scale,
    #  window, softcap | None, sinks [H] | None, horizons [n] | None) -> [n, H, D]
    prefill_attention: Callable
    # (q [N, H, D], cache, index [N, L], scale, sink [H], extra cache | None, extra index [N, L2] | None)
    #  -> [N, H, D]: K = V latent rows, one softmax over both row sets and the sink
    sparse_mla: Callable
    indexer_scores: Callable  # (q [n, h, d], keys [R, d] | [n, R, d], weights [n, h], scale) -> [n, R] fp32
    # (x [T, H], ids [T, k], weights [T, k], gate_up [E, 2I, H], down [E, H, I], swiglu_limit) -> [T, H]
    grouped_moe: Callable
    # (x [T, H], ids [T, k] local, weights [T, k], (blocks, scales, bias) of gate_up, of down, alpha, limit)
    #  -> [T, H] weighted, in x's dtype; None: the experts loop over themselves
    mxfp4_experts: Callable | None
    lora_op: Callable  # (device, dtype) -> "cpu_kernel" | "triton" | "torch": part of an adapted row's identity
    lora_delta: Callable  # (x [T, in], slot [T], A [S, r, in], B [S, out, r], scale [S]) -> [T, out]


HOOKS = tuple(f.name for f in fields(KernelSet) if f.name != "name")
OPTIONAL_HOOKS = ("mxfp4_experts",)  # None: the layer's own loop

TORCH_KERNELS = KernelSet("torch", torch_ref.store_rows, torch_ref.decode_attention, torch_ref.prefill_attention,
                          decode_mla_mqa_sparse, indexer_scores, grouped_experts, None,
                          lora_gpu_op, lora_delta_by(lora_gpu_op))

CPU_KERNELS = replace(TORCH_KERNELS, name="cpu", store_rows=fused.store_rows_op(torch_ref.store_rows),
                      decode_attention=fused.decode_attention_op(torch_ref.decode_attention),
                      lora_op=lora_cpu_op, lora_delta=lora_delta_by(lora_cpu_op))


def _triton_store_rows(cache, slots, k, v) -> None:
    from deepinfer.model_executor.layers.ops.triton import store

    store.store_layer_rows(cache, slots, k, v)


def _triton_decode_attention(cache, q, index, scale, lens=None, softcap=None, sinks=None) -> torch.Tensor:
    from deepinfer.model_executor.layers.ops.triton import decode_attention

    return decode_attention.decode_layer_attention(cache, q, index, scale, lens, softcap, sinks)  # [N, H, D]


def _triton_sparse_mla(q, cache, index, scale, sink, extra_cache=None, extra_index=None) -> torch.Tensor:
    from deepinfer.model_executor.layers.ops.triton import sparse_mla

    return sparse_mla.decode_mla_mqa_sparse(q, cache, index, scale, sink, extra_cache, extra_index)  # [N, H, D]


def _triton_indexer_scores(q, index_keys, weights, softmax_scale) -> torch.Tensor:
    from deepinfer.model_executor.layers.ops.triton import indexer

    return indexer.indexer_scores(q, index_keys, weights, softmax_scale)  # [n, R]


def _triton_grouped_moe(x, topk_ids, topk_weights, gate_up, down, swiglu_limit) -> torch.Tensor:
    """The ids were range-checked by the caller (FusedExperts.forward): no second host sync."""
    from deepinfer.model_executor.layers.ops.triton import moe

    return moe.fused_experts(x, topk_ids, topk_weights, gate_up, down, swiglu_limit, check_ids=False)  # [T, H]


def _triton_mxfp4_experts(x, topk_ids, topk_weights, gate_up, down, alpha, limit) -> torch.Tensor:
    """Two grouped GEMM launches over the packed MXFP4 experts (ops/triton/mxfp4.py)."""
    from deepinfer.model_executor.layers.ops.triton.mxfp4 import mxfp4_experts

    return mxfp4_experts(x, topk_ids, topk_weights, gate_up, down, alpha, limit)  # [T, H]


# LoRA: Triton on CUDA; a run interpreted on the CPU takes the C++ kernel where it serves (ops/lora.py)
TRITON_KERNELS = KernelSet("triton", _triton_store_rows, _triton_decode_attention, torch_ref.prefill_attention,
                           _triton_sparse_mla, _triton_indexer_scores, _triton_grouped_moe, _triton_mxfp4_experts,
                           lora_op_name, lora_delta_by(lora_op_name))

KERNEL_SETS = {s.name: s for s in (TORCH_KERNELS, CPU_KERNELS, TRITON_KERNELS)}


def kernels_for(backend: str, device: torch.device) -> KernelSet:
    """The set a resolved attention backend ("torch" or "triton") runs on `device`: triton ->
    TRITON_KERNELS; torch -> CPU_KERNELS on the CPU (the C++ kernels where they serve), else
    TORCH_KERNELS."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    if backend == "triton":
        return TRITON_KERNELS
    return CPU_KERNELS if torch.device(device).type == "cpu" else TORCH_KERNELS
