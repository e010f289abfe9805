"""ModelRunner: builds the model and its cache groups, and turns a StepPlan into sampled tokens."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from deepinfer.config import CacheConfig, EngineConfig, check_load_format
from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.model import BoundCaches, CachedModel
from deepinfer.contracts.plan import ModelOutput, ScheduledRequest, StepPlan, describe_fault, is_fatal_fault
from deepinfer.environ import Environ
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.attention.torch_ref import TorchAttentionBackend
from deepinfer.model_executor.layers.batch_invariant import check_model_type, make_batch_invariant
from deepinfer.model_executor.layers.ops.cache_common import (
    get_inference_swa_block_size,
    get_kvstore_swa_block_size,
)
from deepinfer.model_executor.layers.ops.swa_addressing import check_ring_fits_drafts
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.loader.dummy import init_dummy_weights
from deepinfer.model_executor.models.registry import get_model_class
from deepinfer.worker.cache_engine import CacheEngine, RowCodec, make_codecs, page_rows, size_groups
from deepinfer.worker.input_batch import build_step_inputs, group_addressing
from deepinfer.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger("deepinfer.worker")

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
        init_dummy_weights(model)
    else:
        model.load_weights(source.iter_weights(torch.float32))
    return model.to(dtype=dtype).eval()


def ring_size(window: int, env: Environ) -> int:
    """S for a window W: the kv-store size when the prefill extra state is on (book §3.4.3)."""
    return get_kvstore_swa_block_size(window, env) if env.prefill_store_extra_state else \
        get_inference_swa_block_size(window, env)


def draft_environ(env: Environ, num_speculative_tokens: int) -> Environ:
    """The environment the ring helpers see: the config's draft allowance k as USE_NEXTN_DECODE."""
    return dataclasses.replace(env, use_nextn_decode=num_speculative_tokens)


class ModelRunner:
    """Owns the model, its cache groups and their one allocation each, and the sampler; turns a
    `StepPlan` into input tensors and per-group metadata, runs the model and samples."""

    def __init__(self, source, config: EngineConfig):
        cache_config = config.cache
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.env.batch_invariant:  # refuse a model the mode does not cover before loading it
            check_model_type(source.hf_config.model_type)
        self.model: CachedModel = build_model(source, self.dtype, self.device, config.max_model_len)
        self.env = draft_environ(config.env, cache_config.num_speculative_tokens)
        if self.env.batch_invariant:  # DEEPINFER_BATCH_INVARIANT: forward and logits in the invariant mode
            make_batch_invariant(self.model, source.hf_config.model_type)
        self.groups, self.codecs = self._sized_groups(cache_config)
        self.codec = self.codecs[0]
        self.num_state_slots = self._num_state_slots(cache_config, config.scheduler.max_num_seqs)
        self.num_blocks = self._num_blocks(cache_config)
        units = [self.num_state_slots if g.is_ring else self.num_blocks for g in self.groups]
        self.cache = CacheEngine(self.groups, units, self.codecs, self.device)
        self.addressing = group_addressing(self.groups)
        self.model.bind_caches(BoundCaches(self.groups, [self.cache.group_caches(gi) for gi in range(len(self.groups))],
                                           self.num_state_slots, TorchAttentionBackend(self.env.batch_invariant)))
        self.sampler = Sampler(config.seed, batch_invariant=self.env.batch_invariant)

    def _sized_groups(self, cache_config: CacheConfig) -> tuple[list[CacheGroupSpec], list[RowCodec]]:
        """The model's declared groups, sized (block size, ring S, page rows), with their codecs."""
        declared = self.model.cache_groups()
        codecs = make_codecs(declared, self.dtype, cache_config.kv_cache_dtype)
        groups = size_groups(declared, cache_config.block_size, self._ring_rows)
        groups = page_rows(groups, cache_config.block_size, codecs)
        for g in groups:
            if g.is_ring:
                check_ring_fits_drafts(g.window, g.rows_per_unit, cache_config.num_speculative_tokens)
        return groups, codecs

    def _ring_rows(self, window: int) -> int:
        return ring_size(window, self.env)

    def codec_of(self, group: CacheGroupSpec) -> RowCodec:
        return self.codecs[self.groups.index(group)]

    def unit_bytes(self, group: CacheGroupSpec) -> int:
        """Bytes of one block (paged) or one state slot (ring) of a group."""
        return len(group.layer_ids) * group.rows_per_unit * self.codec_of(group).row_bytes

    def state_bytes(self) -> int:
        """Per-request state beside the rings (DeepSeek-V4's compressor state), in bytes."""
        return self.model.state_bytes_per_slot()

    def _num_state_slots(self, cache_config, max_num_seqs: int) -> int:
        """One ring state slot per running request: max_num_seqs of them, unless they would take
        more than half the cache memory (then as many as fit there; requests beyond wait)."""
        per_request = sum(self.unit_bytes(g) for g in self.groups if g.is_ring) + self.state_bytes()
        if not per_request:
            return 0
        share = cache_config.kv_cache_memory if not any(not g.is_ring for g in self.groups) \
            else cache_config.kv_cache_memory // 2
        fit = share // per_request
        if fit < 1:
            raise ValueError(f"kv_cache_memory={cache_config.kv_cache_memory} B cannot hold one request's "
                             f"sliding-window rings ({per_request} B)")
        return min(max_num_seqs, fit)

    def _num_blocks(self, cache_config) -> int:
        ring_bytes = (sum(self.unit_bytes(g) for g in self.groups if g.is_ring)
                      + self.state_bytes()) * self.num_state_slots
        paged = [g for g in self.groups if not g.is_ring]
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

    def release(self, request_ids) -> None:
        """Drop per-request state (sampler generators) of finished or aborted requests."""
        self.sampler.release(request_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ModelOutput:
        """Run the plan's forward and sample. A forward fault raises (the engine isolates it);
        a sampling fault is retried row by row and rows that still fail come back in `errors`."""
        self.sampler.release(plan.finished_request_ids)
        if plan.is_empty:
            return ModelOutput()
        inputs = build_step_inputs(plan, self.addressing, self.device)
        with forward_context(inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        if not inputs.sample_rows:
            return ModelOutput()
        logits = self.model.compute_logits(hidden[inputs.sample_index]).float()  # [N, V]
        return self._sample(logits, inputs.sample_rows)

    def _sample(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest]) -> ModelOutput:
        """Sample every row at once; if that raises, again row by row from the same generator
        states (sampling has no cache side effects), so the good rows draw what they would have."""
        draws = any(row.sampling_params is not None and not row.sampling_params.greedy for row in rows)
        saved = self.sampler.save_generators(row.request_id for row in rows) if draws else None
        try:
            return self._sample_rows(logits, rows)
        except Exception as exc:
            if is_fatal_fault(exc):
                raise
            logger.warning("%s; sampling its %d rows one by one", describe_fault("sampling a batch", exc), len(rows))
        if saved is not None:  # greedy rows draw nothing: nothing to rewind
            self.sampler.restore_generators(saved)
        output = ModelOutput()
        for i, row in enumerate(rows):
            try:
                output.samples.update(self._sample_rows(logits[i:i + 1], [row]).samples)  # [1, V]
            except Exception as exc:
                if is_fatal_fault(exc):
                    raise
                logger.exception("request %r failed in sampling", row.request_id)
                output.errors[row.request_id] = describe_fault("sampling", exc)
        return output

    def _sample_rows(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest]) -> ModelOutput:
        """logits [n, V], one row per entry of `rows` -> their samples."""
        sampling = build_sampling_metadata(rows, self.device)
        results = self.sampler(logits, sampling)
        return ModelOutput(dict(zip(sampling.request_ids, results, strict=True)))
