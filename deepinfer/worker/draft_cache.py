"""The draft model's cache (speculative_model): its own rows, at the target's addresses.

The draft's attention layers keep their rows in allocations of their own, one per draft group,
with as many units as the target's group they follow, so the scheduler's block tables and state
slots address both:

    target group   full (paged, R rows per block)      swa... (ring, S rows per state slot)
    draft group    draft (paged, R rows per block)     draft-swa (ring, S' = W' + max(backtracking, k + 1))
    its units      the request's table of the target's  the request's state slot of the target's
                   first token group (block ids)         first ring group (snapshot slots alike)

A block id (a state slot) so means the same token positions in the target's rows and in the
draft's: allocation, frees, trims, preemption and parallel-sampling siblings need nothing more.
The drafter (`spec_decode/draft_model.py`; this cache is its `DraftRows`) writes the draft's row of
every position the target keeps, in the same step, so a full block holds both models' rows of its
tokens; rows past the kept position are rewritten before any query reads them (causality by the
addresses). Prefix caching keeps the draft's rows with the target's: a snapshot copies the draft's
ring slots and partial pages too, and a saved block's or snapshot's file holds the draft's bytes
beside the target's (`capture`, `restore`, `unit_tensors`, called by `PrefixStore`); the cache
identity includes the draft (`draft_identity`).

This stays in the worker (spec_decode may not import it): it is an allocation of the worker's
(`CacheEngine`, the sizing record, the groups' addressing).

Scratch blocks: a request's next token and its chained drafts sit at positions past what the
target computed, possibly past its block table (the scheduler allocates a block when the target
computes into it). The draft's paged allocation has `ceil(k / R)` scratch blocks per running
request after the pool's blocks; the drafter appends a request's scratch blocks to its table for
its passes. Rows there live for one step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from dataclasses import dataclass

import torch

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.model import BoundCaches
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers.attention.layer_cache import RowCodec
from deepinfer.model_executor.layers.ops.swa_addressing import check_ring_fits_drafts
from deepinfer.worker.cache_engine import CacheEngine, make_codecs
from deepinfer.worker.cache_sizing import GroupSizing, ring_size
from deepinfer.worker.input_batch import PassMetadata, group_addressing
from deepinfer.worker.numerics import with_weights
from deepinfer.worker.prefix_store import cache_identity

FIELD = "speculative_model"


@dataclass(frozen=True)
class DraftPlan:
    """The draft's groups, sized, and where their units come from: for group i, `unit_index[i]`
    indexes the target's block tables (paged) or state slots (ring); `mirrors[i]` names that group."""

    groups: list[CacheGroupSpec]
    codecs: list[RowCodec]
    unit_index: list[int]
    mirrors: list[str]

    def sizing(self) -> tuple[GroupSizing, ...]:
        """The draft's groups for the cache's byte record: bytes added to each unit of the target's."""
        return tuple(GroupSizing(g.name, g.kind, g.layer_ids, c.row_bytes, g.rows_per_unit, g.compress_ratio,
                                 g.window, mirrors=m)
                     for g, c, m in zip(self.groups, self.codecs, self.mirrors, strict=True))


def _target_unit(target_groups: list[CacheGroupSpec], ring: bool) -> tuple[int, CacheGroupSpec] | None:
    """(index among the target's paged or ring groups, the group) of the first token group of a kind."""
    of_kind = [g for g in target_groups if g.is_ring == ring]
    for i, g in enumerate(of_kind):
        if ring or g.compress_ratio == 1:
            return i, g
    return None


def plan_draft_cache(draft_model, target_groups: list[CacheGroupSpec], dtype: torch.dtype, kv_cache_dtype: str,
                     env, num_speculative_tokens: int) -> DraftPlan:
    """The draft's declared groups sized at the target's units: paged groups with the rows per block
    of the target's token group, ring groups with S' = W' + max(backtracking, k + 1) rows (checked
    against k). ValueError naming speculative_model when the target has no group of that kind."""
    declared = draft_model.cache_groups()
    codecs = make_codecs(declared, dtype, kv_cache_dtype)
    groups, index, mirrors = [], [], []
    for g in declared:
        found = _target_unit(target_groups, g.is_ring)
        if found is None or g.compress_ratio != 1:
            kind = "sliding-window (ring)" if g.is_ring else "full-attention (paged, one row per token)"
            raise ValueError(f"{FIELD}: the draft's {g.name!r} layers need the target to have a {kind} cache "
                             f"group to share addresses with; the target has {[t.name for t in target_groups]}")
        unit, target = found
        rows = ring_size(g.window, env, num_speculative_tokens) if g.is_ring else target.rows_per_unit
        if g.is_ring:
            check_ring_fits_drafts(g.window, rows, num_speculative_tokens)
        name = "draft" if not g.is_ring else "draft-" + g.name
        groups.append(dataclasses.replace(g, name=name, rows_per_unit=rows))
        index.append(unit)
        mirrors.append(target.name)
    return DraftPlan(groups, codecs, index, mirrors)


def scratch_blocks_per_request(plan: DraftPlan, num_speculative_tokens: int) -> int:
    """Blocks past a request's table that its next token and chained drafts may reach: ceil(k / R)."""
    paged = [g for g in plan.groups if not g.is_ring]
    return -(-num_speculative_tokens // paged[0].rows_per_unit) if paged else 0


class DraftCache:
    """The draft's allocations (a `CacheEngine` of the draft's groups), bound to the draft model,
    and the copies prefix caching makes of them."""

    def __init__(self, plan: DraftPlan, model, num_blocks: int, scratch_per_request: int, max_num_seqs: int,
                 num_state_slots: int, num_snapshot_slots: int, device: torch.device, backend) -> None:
        self.plan, self.model, self.num_blocks, self.device = plan, model, num_blocks, device
        self.per_request = scratch_per_request  # scratch blocks each drafting request takes
        self.num_scratch = max_num_seqs * scratch_per_request
        num_scratch = self.num_scratch
        self.groups = plan.groups
        num_ring_units = num_state_slots + num_snapshot_slots
        units = [num_ring_units if g.is_ring else num_blocks + num_scratch for g in self.groups]
        self.cache = CacheEngine(self.groups, units, plan.codecs, device)
        self.addressing = group_addressing(self.groups)
        self.first_snapshot_unit = num_state_slots
        self.paged = [gi for gi, g in enumerate(self.groups) if not g.is_ring]
        self.ring = [gi for gi, g in enumerate(self.groups) if g.is_ring]
        page = self.cache.allocations[self.paged[0]].shape[1] if self.paged else 0
        self.pages = torch.zeros(num_snapshot_slots, len(self.paged), page, dtype=torch.uint8, device=device)
        # [snapshots, draft paged groups, page bytes]: the draft's partial pages of each snapshot
        model.bind_caches(BoundCaches(self.groups, [self.cache.group_caches(gi) for gi in range(len(self.groups))],
                                      num_ring_units, backend))
        self.metadata = PassMetadata(self.addressing, device)  # a drafting pass's metadata (`DraftRows`)

    @property
    def num_bytes(self) -> int:
        return self.cache.num_bytes + self.pages.numel()

    def units_of(self, s: ScheduledRequest, scratch: list[int]) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """(block tables, state slots) of the draft's groups for request s: the target's units its
        groups follow, each table followed by the request's scratch blocks."""
        tables = tuple(s.block_ids[self.plan.unit_index[gi]] + scratch for gi in self.paged)
        slots = tuple(s.state_ids[self.plan.unit_index[gi]] for gi in self.ring)
        return tables, slots

    def stable_end(self, q: int) -> int:
        """Draft rows of a request's positions below this stay at its addresses until its next
        step, once its kept positions end at q: the paged groups' blocks holding positions before
        q (the scheduler frees blocks past them when it trims rejected drafts; scratch blocks serve
        one step only). Ring rows stay: their slot is the request's."""
        rows = [self.groups[gi].rows_per_unit for gi in self.paged]
        return min((-(-q // r) * r for r in rows), default=sys.maxsize)

    def scratch(self, i: int) -> list[int]:
        """The scratch block ids of the i-th request of a step's drafting (at most max_num_seqs)."""
        per_request = self.per_request
        first = self.num_blocks + i * per_request
        if first + per_request > self.num_blocks + self.num_scratch:
            raise RuntimeError(f"drafting request {i} has no scratch blocks: {self.num_scratch} scratch blocks "
                               f"hold {self.num_scratch // max(per_request, 1)} requests")
        return list(range(first, first + per_request))

    # ---- prefix caching: the draft's bytes of a unit travel with the target's -----------------
    def _partial(self, gi: int, boundary: int) -> int | None:
        rows = self.groups[gi].rows_per_unit
        return boundary // rows if boundary % rows else None

    def _unit(self, gi: int, s: ScheduledRequest, j: int = 0) -> torch.Tensor:
        """Request s's unit of group gi: its state slot (ring), or block j of its table (paged)."""
        unit = self.plan.unit_index[gi]
        return self.cache.allocations[gi][s.state_ids[unit] if gi in self.ring else s.block_ids[unit][j]]

    def capture(self, s: ScheduledRequest, boundary: int) -> None:
        """Copy the draft's ring slots and partial pages of request s at `boundary` into its snapshot."""
        unit = self.first_snapshot_unit + s.capture_to
        for gi in self.ring:
            self.cache.allocations[gi][unit].copy_(self._unit(gi, s))
        for pi, gi in enumerate(self.paged):
            j = self._partial(gi, boundary)
            if j is not None:
                self.pages[s.capture_to, pi].copy_(self._unit(gi, s, j))

    def restore(self, s: ScheduledRequest) -> None:
        """The draft's ring slots and partial pages of request s at s.start_pos from its snapshot."""
        unit = self.first_snapshot_unit + s.restore_from
        for gi in self.ring:
            self._unit(gi, s).copy_(self.cache.allocations[gi][unit])
        for pi, gi in enumerate(self.paged):
            j = self._partial(gi, s.start_pos)
            if j is not None:
                self._unit(gi, s, j).copy_(self.pages[s.restore_from, pi])

    def unit_tensors(self, group: int, unit: int) -> dict[str, torch.Tensor]:
        """The draft's live tensors of a saved unit: block `unit` of the target's paged group
        `group` (its index among paged groups), or snapshot slot `unit` (`group` -1)."""
        if group >= 0:
            return {f"draft.{self.groups[gi].name}": self.cache.allocations[gi][unit]
                    for gi in self.paged if self.plan.unit_index[gi] == group}
        tensors = {f"draft.ring.{self.groups[gi].name}": self.cache.allocations[gi][self.first_snapshot_unit + unit]
                   for gi in self.ring}
        tensors.update({f"draft.page.{self.groups[gi].name}": self.pages[unit, pi] for pi, gi in enumerate(self.paged)})
        return tensors


def draft_identity(draft, numerics, groups) -> str:
    """The cache identity of the draft's rows (`draft`: the loaded `DraftModel`): its weights,
    config, quantization, weight formats and its sized groups (`prefix_store.cache_identity`)."""
    record = with_weights(dataclasses.replace(numerics, quantization=draft.quantization), draft.model, 0)
    return cache_identity(draft.source, record, groups)


def combined_identity(target: str, draft: str) -> str:
    """One identity for a cache whose units hold the target's rows and the draft's."""
    return hashlib.sha256(f"{target}|draft|{draft}".encode()).hexdigest()
