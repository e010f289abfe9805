"""How big the KV cache is: what one request needs, the auto size, the memory there is, refusals.

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

from deepinfer.distributed.parallel_state import tp_size

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
