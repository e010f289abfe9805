"""ModelRunner: builds the model and its cache groups, and turns a StepPlan into sampled tokens."""

from __future__ import annotations

import torch

from deepinfer.config import check_load_format
from deepinfer.engine.plan import ModelOutput
from deepinfer.environ import get_environ
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.attention.torch_ref import TorchAttentionBackend
from deepinfer.model_executor.layers.ops.cache_common import (
    get_inference_swa_block_size,
    get_kvstore_swa_block_size,
)
from deepinfer.model_executor.layers.ops.swa_addressing import check_ring_fits_drafts
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.models.registry import get_model_class
from deepinfer.worker.cache_engine import CacheEngine, CacheGroupSpec, RowCodec, page_rows
from deepinfer.worker.input_batch import build_step_inputs, group_addressing

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
    """The source's model on `device` in `dtype`: checkpoint weights, or seeded random values when
    the source's load_format is "dummy" (no weight file is read)."""
    cfg = source.hf_config
    model_cls = get_model_class(cfg.model_type)
    with torch.device(device):
        model = model_cls(cfg, max_positions)
    if check_load_format(getattr(source, "load_format", "auto")) == "dummy":
        from deepinfer.model_executor.loader.dummy import init_dummy_weights

        init_dummy_weights(model)
    else:
        model.load_weights(source.iter_weights(torch.float32))
    return model.to(dtype=dtype).eval()


def ring_size(window: int) -> int:
    """S for a window W: the kv-store size when the prefill extra state is on (book §3.4.3)."""
    env = get_environ()
    return get_kvstore_swa_block_size(window, env) if env.prefill_store_extra_state else \
        get_inference_swa_block_size(window, env)


def cache_groups(attention_layers, block_size: int) -> list[CacheGroupSpec]:
    """Full-attention layers -> one paged group; sliding layers -> one ring group per window."""
    full = tuple(i for i, a in enumerate(attention_layers) if a.sliding_window is None)
    windows = sorted({a.sliding_window for a in attention_layers if a.sliding_window is not None})
    groups = [CacheGroupSpec("full", "paged", full, block_size)] if full else []
    for w in windows:
        layers = tuple(i for i, a in enumerate(attention_layers) if a.sliding_window == w)
        name = "swa" if len(windows) == 1 else f"swa{w}"
        groups.append(CacheGroupSpec(name, "ring", layers, ring_size(w), window=w))
    return groups


class ModelRunner:
    def __init__(self, source, cache_config, max_model_len: int, max_num_seqs: int, dtype: str = "auto",
                 device: str | None = None, seed: int = 0):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = build_model(source, self.dtype, self.device, max_model_len)
        layers = self.model.attention_layers()
        self.codec = RowCodec(layers[0].num_kv_heads, layers[0].head_dim, self.dtype, cache_config.kv_cache_dtype)
        if hasattr(self.model, "cache_groups"):  # models with several row kinds (DeepSeek-V4)
            make_codec = lambda d: RowCodec(1, d, self.dtype, cache_config.kv_cache_dtype, shared_kv=True)
            self.groups = self.model.cache_groups(cache_config.block_size, ring_size(layers[0].sliding_window),
                                                  make_codec)
            self.codec = self.groups[0].codec
        else:
            self.groups = cache_groups(layers, cache_config.block_size)
        self.groups = page_rows(self.groups, cache_config.block_size, self.codec)
        for g in self.groups:
            if g.kind == "ring":
                check_ring_fits_drafts(g.window, g.rows_per_unit, cache_config.num_speculative_tokens)
        self.num_state_slots = self._num_state_slots(cache_config, max_num_seqs)
        self.num_blocks = self._num_blocks(cache_config)
        units = [self.num_blocks if g.kind == "paged" else self.num_state_slots for g in self.groups]
        self.cache = CacheEngine(self.groups, units, self.codec, self.device)
        self.addressing = group_addressing(self.groups)
        self._bind_cache(TorchAttentionBackend())
        self.sampler = Sampler(seed)

    def unit_bytes(self, group: CacheGroupSpec) -> int:
        """Bytes of one block (paged) or one state slot (ring) of a group."""
        return len(group.layer_ids) * group.rows_per_unit * (group.codec or self.codec).row_bytes

    def state_bytes(self) -> int:
        """Per-request state beside the rings (DeepSeek-V4's compressor state), in bytes."""
        return self.model.state_bytes_per_slot() if hasattr(self.model, "state_bytes_per_slot") else 0

    def _num_state_slots(self, cache_config, max_num_seqs: int) -> int:
        """One ring state slot per running request: max_num_seqs of them, unless they would take
        more than half the cache memory (then as many as fit there; requests beyond wait)."""
        per_request = sum(self.unit_bytes(g) for g in self.groups if g.kind == "ring") + self.state_bytes()
        if not per_request:
            return 0
        share = cache_config.kv_cache_memory if not any(g.kind == "paged" for g in self.groups) \
            else cache_config.kv_cache_memory // 2
        fit = share // per_request
        if fit < 1:
            raise ValueError(f"kv_cache_memory={cache_config.kv_cache_memory} B cannot hold one request's "
                             f"sliding-window rings ({per_request} B)")
        return min(max_num_seqs, fit)

    def _num_blocks(self, cache_config) -> int:
        ring_bytes = (sum(self.unit_bytes(g) for g in self.groups if g.kind == "ring")
                      + self.state_bytes()) * self.num_state_slots
        paged = [g for g in self.groups if g.kind == "paged"]
        if not paged:
            return 0
        if cache_config.num_blocks:
            return cache_config.num_blocks
        # all paged groups share one pool of same-size pages (cache_engine.page_rows)
        num = (cache_config.kv_cache_memory - ring_bytes) // max(self.unit_bytes(g) for g in paged)
        if num < 1:
            raise ValueError(f"kv_cache_memory={cache_config.kv_cache_memory} B holds no paged block after "
                             f"{ring_bytes} B of sliding-window rings; raise it or lower max_num_seqs")
        return num

    def _bind_cache(self, backend) -> None:
        if hasattr(self.model, "bind_caches"):
            self.model.bind_caches(self.cache, self.num_state_slots)
            return
        layers = self.model.attention_layers()
        for layer_id, (group_index, cache) in self.cache.layer_caches().items():
            layers[layer_id].kv_cache, layers[layer_id].group_index = cache, group_index
            layers[layer_id].backend = backend

    def release(self, request_ids) -> None:
        """Drop per-request state (sampler generators) of finished or aborted requests."""
        self.sampler.release(request_ids)

    @torch.inference_mode()
    def execute(self, plan) -> ModelOutput:
        self.sampler.release(plan.finished_request_ids)
        if plan.is_empty:
            return ModelOutput()
        inputs = build_step_inputs(plan, self.addressing, self.device)
        with forward_context(inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        if not inputs.sample_rows:
            return ModelOutput()
        logits = self.model.compute_logits(hidden[inputs.sample_index])  # [N, V]
        results = self.sampler(logits.float(), inputs.sample_rows)
        return ModelOutput({s.request_id: r for s, r in zip(inputs.sample_rows, results, strict=True)})
