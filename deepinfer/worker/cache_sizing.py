"""How big the KV cache is: the byte arithmetic of a model's cache groups, what one request needs,
the auto size, the memory there is, refusals. The engine (`ModelRunner`), `deepinfer info`, the
capacity planner and the benchmarks all size through `plan_model_cache`; nothing else has a formula.

    groups      the model's declared groups (`cache_groups()`), sized: paged groups `block_size` rows
                per block, then one page P for all of them (`cache_engine.page_rows`); ring groups
                S = W + max(DEEPINFER_MAX_BACKTRACKING_TOKENS, k + 1) rows per state slot, k the
                speculative setting (+ the prefill extra state when on); S >= W + k + 1 is checked
    row bytes   one codec per group (`make_codecs`): K|V or one shared K = V row, plain, MXFP8 or q8
    per token   a paged group: layers x row_bytes / m (one row per m tokens)
    per request a ring group: layers x S x row_bytes; plus the model's state (`state_bytes_per_slot`)
    at L tokens fixed + blocks(L) x P, blocks(L) = sum over paged groups of ceil(floor(L / m) / R)

    kv_cache_memory "auto" (the default, without num_blocks):
        need = max_num_seqs x (blocks for max_model_len x page bytes + ring and state bytes)
             + snapshot slots x (ring and state bytes + one page per paged group)
        cap  = gpu_memory_utilization x memory free now (after the weights): CUDA's free memory,
               or the CPU's MemAvailable
        the cache gets the need when it is under the cap, else the cap (fewer requests at once)

Whatever the size, a cache that cannot hold one request at max_model_len is refused at start-up
with the numbers and the flags that fix it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.distributed.parallel_state import tp_size
from deepinfer.environ import Environ
from deepinfer.model_executor.layers.attention.layer_cache import RowCodec
from deepinfer.model_executor.layers.ops.cache_common import get_kvstore_swa_block_size, visible_rows
from deepinfer.model_executor.layers.ops.swa_addressing import check_ring_fits_drafts
from deepinfer.worker.cache_engine import make_codecs, page_rows, size_groups

logger = logging.getLogger("deepinfer.worker")

_FIX = "raise --kv-cache-memory / --num-blocks or lower --max-model-len"


@dataclass(frozen=True)
class RequestNeed:
    """What one request at max_model_len takes from the cache."""

    num_blocks: int  # paged blocks, all paged groups together (one shared pool of equal pages)
    page_bytes: int  # one page of that pool (0: the model has no paged group)
    ring_bytes: int  # its sliding-window ring slots and per-request state (0: no ring group)
    num_paged_groups: int

    @property
    def paged_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    def total_bytes(self, num_requests: int, num_snapshots: int = 0) -> int:
        """Bytes of `num_requests` requests at max_model_len and `num_snapshots` snapshot slots."""
        snapshot = self.ring_bytes + self.num_paged_groups * self.page_bytes
        return num_requests * (self.paged_bytes + self.ring_bytes) + num_snapshots * snapshot


def ring_size(window: int, env: Environ, num_drafts: int | None = None) -> int:
    """S for a window W and draft allowance k (`num_drafts`: `SpeculativeConfig.num_speculative_tokens`;
    None: the environment's knob): W + max(backtracking, k + 1), plus the prefill extra state when
    it is on (the kv-store size, book §3.4.3)."""
    return get_kvstore_swa_block_size(window, env, num_drafts)


@dataclass(frozen=True)
class GroupSizing:
    """One sized cache group's bytes: `rows_per_unit` rows (block size R, or ring size S) of
    `row_bytes` per layer per unit; a paged row holds `compress_ratio` tokens."""

    name: str
    kind: str  # "paged" or "ring"
    layer_ids: tuple[int, ...]
    row_bytes: int
    rows_per_unit: int
    compress_ratio: int = 1
    window: int | None = None
    # a draft model's group (`worker/draft_cache.py`): its rows sit at the units (block ids, state
    # slots) of the target's group of this name, so it adds bytes to each unit and no unit of its own
    mirrors: str | None = None

    @property
    def is_ring(self) -> bool:
        return self.kind == "ring"

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def unit_bytes(self) -> int:
        """One block (paged) or one state slot (ring), all the group's layers."""
        return self.num_layers * self.rows_per_unit * self.row_bytes

    @property
    def per_token(self) -> float:
        """Bytes each further token adds (0 for a ring: its size is fixed)."""
        return 0.0 if self.is_ring else self.num_layers * self.row_bytes / self.compress_ratio

    @property
    def per_request(self) -> int:
        """Fixed bytes per request: a ring's state slot (0 for a paged group)."""
        return self.unit_bytes if self.is_ring else 0

    def visible_rows(self, num_tokens: int) -> int:
        """Rows per layer a request of `num_tokens` tokens has in use: min(L, W), or floor(L / m)."""
        return visible_rows(num_tokens, self.window) if self.is_ring else num_tokens // self.compress_ratio

    def blocks_for(self, num_tokens: int) -> int:
        """Paged blocks a request of `num_tokens` tokens holds (0 for a ring)."""
        return 0 if self.is_ring else -(-self.visible_rows(num_tokens) // self.rows_per_unit)


@dataclass(frozen=True)
class CacheSizing:
    """A model's cache in bytes, as the engine allocates it: its groups, the per-request state
    beside the rings, and the draft allowance k the rings were sized for. All paged groups draw
    on one pool of equal pages (`page_bytes`)."""

    groups: tuple[GroupSizing, ...]
    state_bytes: int  # per request, beside the rings (DeepSeek-V4's compressor state)
    num_speculative_tokens: int

    @property
    def paged(self) -> tuple[GroupSizing, ...]:
        """The paged groups that hold blocks of the pool (a draft's paged groups use theirs)."""
        return tuple(g for g in self.groups if not g.is_ring and g.mirrors is None)

    @property
    def page_bytes(self) -> int:
        """One page of the shared pool (0: no paged group), with the draft model's rows at the same
        block id (`mirrors`)."""
        page = max((g.unit_bytes for g in self.paged), default=0)
        return page + sum(g.unit_bytes for g in self.groups if not g.is_ring and g.mirrors is not None) if page else 0

    @property
    def per_token(self) -> float:
        return sum(g.per_token for g in self.groups)

    @property
    def ring_bytes(self) -> int:
        return sum(g.per_request for g in self.groups)

    @property
    def per_request(self) -> int:
        """Fixed bytes of one request whatever its length: its ring slots and its state."""
        return self.ring_bytes + self.state_bytes

    def blocks_for(self, num_tokens: int) -> int:
        return sum(g.blocks_for(num_tokens) for g in self.paged)

    def request_bytes(self, num_tokens: int) -> int:
        """Bytes one request of `num_tokens` tokens takes: its fixed part and its pages."""
        return self.per_request + self.blocks_for(num_tokens) * self.page_bytes

    def request_need(self, max_model_len: int) -> RequestNeed:
        return RequestNeed(self.blocks_for(max_model_len), self.page_bytes, self.per_request, len(self.paged))

    def requests_that_fit(self, memory: int, num_tokens: int) -> int:
        """Requests of `num_tokens` tokens that `memory` bytes hold at once."""
        return max(0, memory) // self.request_bytes(num_tokens)

    def layer_per_token(self, layer: int) -> float:
        """Bytes each further token adds in one layer (its paged groups)."""
        return sum(g.row_bytes / g.compress_ratio for g in self.paged if layer in g.layer_ids)


def sized_groups(declared: list[CacheGroupSpec], codecs: list[RowCodec], block_size: int, env: Environ,
                 num_speculative_tokens: int) -> list[CacheGroupSpec]:
    """Declared groups sized: block size, one page for the paged groups, ring S for k drafts
    (refused, naming W, S and k, when S < W + k + 1)."""
    groups = size_groups(declared, block_size, lambda window: ring_size(window, env, num_speculative_tokens))
    groups = page_rows(groups, block_size, codecs)
    for g in groups:
        if g.is_ring:
            check_ring_fits_drafts(g.window, g.rows_per_unit, num_speculative_tokens)
    return groups


def sizing_record(groups: list[CacheGroupSpec], codecs: list[RowCodec], state_bytes: int,
                 num_speculative_tokens: int) -> CacheSizing:
    """The byte record of sized groups and their codecs."""
    return CacheSizing(tuple(GroupSizing(g.name, g.kind, g.layer_ids, c.row_bytes, g.rows_per_unit,
                                         g.compress_ratio, g.window) for g, c in zip(groups, codecs, strict=True)),
                       state_bytes, num_speculative_tokens)


def plan_model_cache(model, dtype: torch.dtype, kv_cache_dtype: str, block_size: int, env: Environ,
                     num_speculative_tokens: int) -> tuple[list[CacheGroupSpec], list[RowCodec], CacheSizing]:
    """(sized groups, their codecs, the byte record) of a built model (on any device, meta too)."""
    declared = model.cache_groups()
    codecs = make_codecs(declared, dtype, kv_cache_dtype)
    groups = sized_groups(declared, codecs, block_size, env, num_speculative_tokens)
    return groups, codecs, sizing_record(groups, codecs, model.state_bytes_per_slot(), num_speculative_tokens)


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def wanted_snapshots(cache_config, max_num_seqs: int) -> int:
    """Snapshot slots ring models keep for prefix hits: num_prefix_snapshots, or min(16, max_num_seqs)."""
    if not cache_config.enable_prefix_caching:
        return 0
    if cache_config.num_prefix_snapshots is not None:
        return cache_config.num_prefix_snapshots
    return min(16, max_num_seqs)


def cpu_available_memory() -> int:
    """Bytes the CPU can still give: /proc/meminfo's MemAvailable, else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` now (after the weights are loaded)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return cpu_available_memory()


def auto_cache_memory(need: RequestNeed, max_num_seqs: int, num_snapshots: int, device: torch.device,
                      fraction: float) -> int | None:
    """None when max_num_seqs requests at max_model_len (and the snapshot slots) fit under the
    cap; else the cap, in bytes, for the explicit split to fill."""
    wanted = need.total_bytes(max_num_seqs, num_snapshots)
    free = available_memory(device)
    cap = int(fraction * free)
    if wanted <= cap:
        logger.info("KV cache auto: %s for %d requests at max_model_len (%s free on %s)", mib(wanted),
                    max_num_seqs, mib(free), device.type)
        return None
    logger.warning("KV cache auto: %d requests at max_model_len would take %s; capped at %s "
                   "(gpu_memory_utilization %.2f of %s free on %s): fewer requests run at once",
                   max_num_seqs, mib(wanted), mib(cap), fraction, mib(free), device.type)
    return cap


def check_fits_one_request(need: RequestNeed, num_blocks: int, given_blocks: int | None, memory: int,
                           max_model_len: int) -> None:
    """ValueError when the paged pool cannot hold one request at max_model_len (blocks needed vs
    given, bytes, and the fix). Rings were checked when the state slots were counted."""
    if not need.page_bytes or num_blocks >= need.num_blocks:
        return
    if given_blocks:
        given = f"--num-blocks gives {num_blocks:,} blocks ({mib(num_blocks * need.page_bytes)})"
    else:
        rings = " beside the sliding-window rings and state" if need.ring_bytes else ""
        given = f"kv_cache_memory {memory:,} B ({mib(memory)}) holds {num_blocks:,} blocks{rings}"
    raise ValueError(f"the KV cache cannot hold one request at max_model_len {max_model_len:,}: it needs "
                     f"{need.num_blocks:,} blocks of {need.page_bytes:,} B ({mib(need.paged_bytes)}); {given}; "
                     f"{_FIX}")


def size_cache(need: RequestNeed, cache_config, max_num_seqs: int, max_model_len: int,
               device: torch.device) -> tuple[int, int, int]:
    """(state slots, snapshot slots, paged blocks), refused when one request at max_model_len does
    not fit. kv_cache_memory "auto" sizes for the need, capped (`auto_cache_memory`); an explicit
    size (or num_blocks) is split as `split_state_slots` and `split_blocks` say."""
    snapshots = wanted_snapshots(cache_config, max_num_seqs) if need.ring_bytes else 0
    memory = cache_config.kv_cache_memory
    if cache_config.auto_sized:  # num_blocks alone: the rings get max_num_seqs slots, uncapped
        memory = None if cache_config.num_blocks else auto_cache_memory(
            need, max_num_seqs, snapshots, device, cache_config.gpu_memory_utilization)
        if memory is None:  # the whole need fits under the cap
            slots, blocks = max_num_seqs if need.ring_bytes else 0, max_num_seqs * need.num_blocks
            blocks = (cache_config.num_blocks or blocks) if need.page_bytes else 0
            check_fits_one_request(need, blocks, cache_config.num_blocks, 0, max_model_len)
            return slots, snapshots, blocks
    slots, snapshots = split_state_slots(memory, max_num_seqs, snapshots, need)
    num_blocks = split_blocks(cache_config.num_blocks, memory, slots, snapshots, need)
    check_fits_one_request(need, num_blocks, cache_config.num_blocks, memory, max_model_len)
    return slots, snapshots, num_blocks


def longest_request(sizing, cache_config, max_num_seqs: int, limit: int, free: int) -> int:
    """The longest max_model_len <= `limit` at which one request fits the cache this configuration
    gives (the auto size's cap on `free` bytes, an explicit kv_cache_memory or num_blocks); 0 when
    none does."""

    def fits(length: int) -> bool:
        need = sizing.request_need(length)
        if cache_config.auto_sized and cache_config.num_blocks:
            return not need.page_bytes or cache_config.num_blocks >= need.num_blocks
        memory = int(cache_config.gpu_memory_utilization * free) if cache_config.auto_sized \
            else cache_config.kv_cache_memory
        snapshots = wanted_snapshots(cache_config, max_num_seqs) if need.ring_bytes else 0
        try:
            slots, snapshots = split_state_slots(memory, max_num_seqs, snapshots, need)
        except ValueError:
            return False
        return not need.page_bytes or split_blocks(cache_config.num_blocks, memory, slots, snapshots,
                                                   need) >= need.num_blocks

    low, high = 0, limit  # fits(low) or low == 0; the answer is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def split_state_slots(memory: int, max_num_seqs: int, wanted: int, need: RequestNeed) -> tuple[int, int]:
    """(state slots, snapshot slots) in `memory` bytes. One ring state slot per running request:
    max_num_seqs of them, unless they would take more than the rings' share of the cache memory
    (all of it without paged groups, else half; then as many as fit there; requests beyond wait).
    Prefix-cache snapshots (ring models) take what the running requests leave of that share, or a
    quarter of it."""
    if not need.ring_bytes:
        return 0, 0
    share = memory // 2 if need.page_bytes else memory
    fit = share // need.ring_bytes
    if fit < 1:
        raise ValueError(f"kv_cache_memory={memory:,} B ({mib(memory)}) cannot hold one request's "
                         f"sliding-window rings and state ({need.ring_bytes:,} B, {mib(need.ring_bytes)}"
                         f"{', with half the memory kept for paged blocks' if need.page_bytes else ''}); "
                         f"raise --kv-cache-memory")
    snapshots = min(wanted, max(fit - max_num_seqs, fit // 4))
    return min(max_num_seqs, fit - snapshots), snapshots


def split_blocks(num_blocks: int | None, memory: int, slots: int, snapshots: int, need: RequestNeed) -> int:
    """Paged blocks: `num_blocks` when given, else what `memory` holds beside the rings."""
    if not need.page_bytes:
        return 0
    if num_blocks:
        return num_blocks
    ring_bytes = need.ring_bytes * (slots + snapshots) + snapshots * need.num_paged_groups * need.page_bytes
    # all paged groups share one pool of same-size pages (cache_engine.page_rows)
    return max(0, (memory - ring_bytes) // need.page_bytes)


def max_concurrency(need: RequestNeed, num_blocks: int, num_state_slots: int) -> int:
    """Requests at max_model_len that fit at once."""
    limits = [num_blocks // need.num_blocks] if need.page_bytes and need.num_blocks else []
    if need.ring_bytes:
        limits.append(num_state_slots)
    return min(limits) if limits else 0


def min_over_ranks(values: tuple[int, ...], device: torch.device) -> tuple[int, ...]:
    """Each value's minimum over the tensor-parallel ranks (`values` itself with one rank). Every
    rank sizes its own cache for its own free memory; the scheduler on rank 0 hands out one set of
    block and slot ids, so all ranks take the smallest count, which fits every rank's memory."""
    if tp_size() == 1:
        return values
    counts = torch.tensor(values, dtype=torch.int64, device=device)  # [n]
    dist.all_reduce(counts, op=dist.ReduceOp.MIN)
    return tuple(counts.tolist())
