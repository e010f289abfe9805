"""max_model_len, resolved once per engine before any model is built.

    given       --max-model-len / --ctx-size: kept (refused beyond the model's context unless
                allowed, `EngineConfig.given_max_model_len`); a cache that cannot hold one request
                that long is refused by the sizing, never lowered
    not given   the model's context when the KV cache holds one request that long, else the
                longest request it holds (`cache_sizing.longest_request`), said in one line

The result is frozen into the config every model is built from (`EngineConfig.with_max_model_len`):
the target, its MTP module and the draft model build their RoPE tables (Phi-3 LongRoPE picks its
factor set here) and length-sized groups from it, and nothing writes it afterwards.

The fit needs, before any weight loads, the cache's groups and the memory the cache will get. The
target (with its MTP module) and the draft model are built on the meta device, at the model's
context, for the groups they declare and the bytes of their weights. The memory is what the cache
configuration gives: num_blocks, an explicit kv_cache_memory, or the auto size's cap,
gpu_memory_utilization of the memory free now less the weights the build will hold (GGUF matrices
kept packed are the file's mapped pages, which the OS counts as free: they are not subtracted). With
several ranks each rank fits its own and all take the smallest (`min_over_ranks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig
from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.distributed.parallel_state import tp_size
from deepinfer.model_executor.loader.gguf import packed_file_elements
from deepinfer.model_executor.model_loader import build_meta_model
from deepinfer.spec_decode.draft_source import DraftSource
from deepinfer.worker.cache_runtime import plan_caches
from deepinfer.worker.cache_sizing import available_memory, longest_request, min_over_ranks

logger = logging.getLogger("deepinfer.worker")


@dataclass(frozen=True)
class Built:
    """What the engine will build, as the resolver sees it: the model source, the compute dtype and
    quantization the numerics chose, and the draft checkpoint (speculative_model) or None."""

    source: object
    dtype: torch.dtype
    quantization: str
    draft: DraftSource | None = None


def resolve_max_model_len(built: Built, config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with max_model_len resolved (see the module docstring); the same on every rank."""
    context = HFConfigFields.of(built.source.hf_config).max_position_embeddings
    given = config.given_max_model_len(context)
    if given is not None:
        return config.with_max_model_len(given)
    (longest,) = min_over_ranks((fitted_length(built, config, device, context),), device)
    if longest >= context or longest == 0:  # 0: nothing fits; the sizing refuses it with the numbers
        return config.with_max_model_len(context)
    logger.info("max_model_len %d: the longest request the KV cache can hold (the model's context is %d; "
                "raise --kv-cache-memory or --gpu-memory-utilization for more)", longest, context)
    return config.with_max_model_len(longest)


def fitted_length(built: Built, config: EngineConfig, device: torch.device, context: int) -> int:
    """The longest request (<= the model's context) one engine of `config` can hold, from the models
    built on the meta device at the model's context."""
    target = build_meta_model(built.source, built.dtype, context, config.speculative.method,
                              config.expert_parallel_size)
    draft = None if built.draft is None else build_meta_model(built.draft.source, built.dtype, context)
    plan = plan_caches(target, draft, config, built.dtype)
    free = 0
    if config.cache.auto_sized and not config.cache.num_blocks:  # the auto size's cap reads the free memory
        weights = weight_bytes(target, built.source, built.quantization, built.dtype)
        if draft is not None:
            weights += weight_bytes(draft, built.draft.source, built.draft.quantization, built.dtype)
        free = max(0, available_memory(device) - weights)
    return longest_request(plan.sizing, config.cache, config.scheduler.max_num_seqs, context, free)


def weight_bytes(meta_model: torch.nn.Module, source, quantization: str, dtype: torch.dtype) -> int:
    """Bytes of memory the weights of `meta_model` (built on the meta device in the compute dtype)
    will take once loaded: every parameter and buffer, less the matrices a GGUF file keeps packed
    (quantization "gguf": views of the file's mapping, page cache the OS counts as free; one rank's
    share of them with several ranks). int8 / int4 are counted dense: they quantize dense weights."""
    dense = sum(t.numel() * t.element_size() for t in (*meta_model.parameters(), *meta_model.buffers()))
    if quantization != "gguf":
        return dense
    return max(0, dense - packed_file_elements(source.path) * dtype.itemsize // tp_size())
