"""The cache runtime: one rank's cache groups, sized and allocated once, bound to the model, and
everything that copies rows between them.

    __init__   sizing (`cache_sizing`: groups sized for k drafts, their codecs, the byte record, the
               unit counts, alike on all ranks) -> CacheEngine (one allocation per group) -> the
               model binds its layer caches and the attention backend
    open       the cache identity checked by the start-up canary (`cache_canary`) -> the cache
               directory's store (`kv_disk`) -> the prefix store (snapshots, saves, loads) and the
               undo of a failed step (`step_undo`)

`open` takes the identity, which hashes the numerics record once the model is final (after the
binding): the runner completes the record between the two.

With a draft model (speculative_model) its groups are sized at the target's units and counted in
the byte record (`GroupSizing.mirrors`: bytes added to each block and state slot), then allocated
beside the target's and bound to the draft (`worker/draft_cache.py`: `draft`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.config import CacheConfig, EngineConfig
from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.model import BoundCaches, CachedModel
from deepinfer.model_executor.layers.attention.layer_cache import RowCodec
from deepinfer.worker.cache_canary import checked_identity
from deepinfer.worker.cache_engine import CacheEngine
from deepinfer.worker.cache_sizing import CacheSizing, min_over_ranks, plan_model_cache, size_cache
from deepinfer.worker.draft_cache import DraftCache, DraftPlan, plan_draft_cache, scratch_blocks_per_request
from deepinfer.worker.input_batch import group_addressing
from deepinfer.worker.kv_disk import KvDiskStore
from deepinfer.worker.prefix_store import PrefixStore
from deepinfer.worker.step_undo import StepUndo


class CacheRuntime:
    """The cache groups of `model` on `device`, their allocation, addressing and copies."""

    def __init__(self, model: CachedModel, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                 backend, draft_model: CachedModel | None = None) -> None:
        cache_config = config.cache
        self.model, self.device = model, device
        k = config.speculative.num_speculative_tokens
        plan = plan_caches(model, draft_model, config, dtype)
        self.groups, self.codecs, self.sizing = plan.groups, plan.codecs, plan.sizing
        draft_plan = plan.draft
        self.codec = self.codecs[0]
        self.cache_need = self.sizing.request_need(config.max_model_len)
        self.num_state_slots, self.num_snapshot_slots, self.num_blocks = min_over_ranks(size_cache(
            self.cache_need, cache_config, config.scheduler.max_num_seqs, config.max_model_len, device),
            device)  # alike on all ranks
        num_ring_units = self.num_state_slots + self.num_snapshot_slots
        units = [num_ring_units if g.is_ring else self.num_blocks for g in self.groups]
        self.cache = CacheEngine(self.groups, units, self.codecs, device)
        self.addressing = group_addressing(self.groups)
        model.bind_caches(BoundCaches(self.groups, [self.cache.group_caches(gi) for gi in range(len(self.groups))],
                                      num_ring_units, backend))
        self.draft: DraftCache | None = None if draft_plan is None else DraftCache(
            draft_plan, draft_model, self.num_blocks, scratch_blocks_per_request(draft_plan, k),
            config.scheduler.max_num_seqs, self.num_state_slots, self.num_snapshot_slots, device, backend)
        self.cache_identity: str | None = None  # set by `open`, as are `prefix` and `undo`
        self.prefix: PrefixStore | None = None
        self.undo: StepUndo | None = None

    def open(self, identity: str, cache_config: CacheConfig) -> None:
        """Take the cache identity (checked by the canary where a cache directory is set), then the
        prefix store over it and the undo of failed steps."""
        self.cache_identity = checked_identity(self, identity, cache_config)
        self.prefix = PrefixStore(self.cache, self.model, self.num_state_slots, self.num_snapshot_slots,
                                  self._disk_store(cache_config), draft=self.draft)
        self.undo = StepUndo(self.cache, self.model)  # what a failed step changed that its re-run reads

    def codec_of(self, group: CacheGroupSpec) -> RowCodec:
        return self.codecs[self.groups.index(group)]

    def unit_bytes(self, group: CacheGroupSpec) -> int:
        """Bytes of one block (paged) or one state slot (ring) of a group."""
        return self.sizing.groups[self.groups.index(group)].unit_bytes

    def state_bytes(self) -> int:
        """Per-request state beside the rings (DeepSeek-V4's compressor state), in bytes."""
        return self.sizing.state_bytes

    def _disk_store(self, cache_config: CacheConfig) -> KvDiskStore | None:
        """The cache directory's store, refused at start-up if it cannot hold one unit."""
        if not cache_config.kv_cache_dir or not cache_config.enable_prefix_caching:
            return None
        sizing = self.sizing
        snapshot = sizing.per_request + len(sizing.paged) * sizing.page_bytes if self.num_snapshot_slots else 0
        return KvDiskStore(cache_config.kv_cache_dir, cache_config.kv_cache_dir_size, self.cache_identity,
                           min_file_bytes=max(sizing.page_bytes, snapshot))

    def stats(self) -> dict[str, int]:
        """The cache directory's counters (empty without one)."""
        disk = self.prefix.disk
        if disk is None:
            return {}
        return {"kv_cache_dir_bytes_read": disk.bytes_read, "kv_cache_dir_bytes_written": disk.bytes_written,
                "kv_cache_dir_files_read": disk.files_read, "kv_cache_dir_files_written": disk.files_written,
                "kv_cache_dir_load_failures": disk.load_failures}

    def close(self) -> None:
        """Finish writing the cache directory (idempotent)."""
        self.prefix.close()


@dataclass(frozen=True)
class CachePlan:
    """The cache's one sizing (`cache_sizing`): the target's groups sized for k drafts, their codecs
    and the byte record, with the draft model's groups (speculative_model) counted in every unit."""

    groups: list[CacheGroupSpec]
    codecs: list[RowCodec]
    sizing: CacheSizing
    draft: DraftPlan | None


def plan_caches(model: CachedModel, draft_model: CachedModel | None, config: EngineConfig,
                dtype: torch.dtype) -> CachePlan:
    """The sizing of `model`'s caches and `draft_model`'s at the same units (built models, or the
    meta-built ones the max_model_len fit reads: `worker/context_length.py`)."""
    cache_config, k = config.cache, config.speculative.num_speculative_tokens
    groups, codecs, sizing = plan_model_cache(model, dtype, cache_config.kv_cache_dtype, cache_config.block_size,
                                              config.env, k)
    if draft_model is None:
        return CachePlan(groups, codecs, sizing, None)
    draft = plan_draft_cache(draft_model, groups, dtype, cache_config.kv_cache_dtype, config.env, k)
    return CachePlan(groups, codecs, dataclasses.replace(sizing, groups=sizing.groups + draft.sizing()), draft)
