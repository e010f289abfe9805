"""ModelRunner: builds the model and its cache, and turns a StepPlan into sampled tokens."""

from __future__ import annotations

import torch

from deepinfer.engine.plan import ModelOutput
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.attention.torch_ref import TorchAttentionBackend
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.models.llama import head_dim_of
from deepinfer.model_executor.models.registry import get_model_class
from deepinfer.worker.cache_engine import CacheEngine, PagedCacheShape
from deepinfer.worker.input_batch import build_step_inputs

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is fp32 on CPU (the fast CPU dtype without native bf16) and bf16 on a GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_model(source, dtype: torch.dtype, device: torch.device, max_positions: int):
    cfg = source.hf_config
    model_cls = get_model_class(cfg.model_type)
    with torch.device(device):
        model = model_cls(cfg, max_positions)
    model.load_weights(source.iter_weights(torch.float32))
    return model.to(dtype=dtype).eval()


def paged_cache_shape(cfg, block_size: int) -> PagedCacheShape:
    return PagedCacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), block_size)


class ModelRunner:
    def __init__(self, source, cache_config, max_model_len: int, dtype: str = "auto",
                 device: str | None = None, seed: int = 0):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = build_model(source, self.dtype, self.device, max_model_len)
        self.cache_shape = paged_cache_shape(source.hf_config, cache_config.block_size)
        self.num_blocks = cache_config.num_blocks or self.cache_shape.num_blocks_for(
            cache_config.kv_cache_memory, self.dtype)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={cache_config.kv_cache_memory} is too small for one block "
                             f"of {cache_config.block_size} tokens")
        self.cache = CacheEngine(self.cache_shape, self.num_blocks, self.dtype, self.device)
        self._bind_cache(TorchAttentionBackend())
        self.sampler = Sampler(seed)

    def _bind_cache(self, backend) -> None:
        for attn, view in zip(self.model.attention_layers(), self.cache.layer_views(), strict=True):
            attn.kv_cache, attn.backend = view, backend

    @torch.inference_mode()
    def execute(self, plan) -> ModelOutput:
        self.sampler.release(plan.finished_request_ids)
        if plan.is_empty:
            return ModelOutput()
        inputs = build_step_inputs(plan, self.cache_shape.block_size, self.device)
        with forward_context(inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        if not inputs.sample_rows:
            return ModelOutput()
        logits = self.model.compute_logits(hidden[inputs.sample_index])  # [N, V]
        results = self.sampler(logits.float(), inputs.sample_rows)
        return ModelOutput({s.request_id: r for s, r in zip(inputs.sample_rows, results, strict=True)})
