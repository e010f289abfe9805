"""The worker's side of prefix caching: boundary snapshots and the saved cache directory.

    capture  after a step that ends at boundary b:   the request's ring slots     ─┐
                                                     its per-request state          ├─> snapshot slot s
                                                     pages b falls inside (paged)  ─┘
    restore  before a hit's first step (at b):       snapshot slot s ─> the request's fresh slots, blocks
    persist  before the next forward:                a cached block's page, or a snapshot ─> a file
    load     before the forward:                     a file ─> a fresh block, or a snapshot slot

Snapshot slot s of a ring group is its unit `num_state_slots + s` (ring rows keep their
addresses: token p stays at row p mod S, so a copied slot needs no re-indexing); per-request
state (DeepSeek-V4's compressors) uses the same unit numbers; the partial pages of paged groups
live in one allocation of their own, [snapshot slots, paged groups, page bytes].

Memory per snapshot: the ring state slot of every ring group (S rows of each of its layers),
the per-request state, and one page per paged group.

With a draft model (speculative_model, `worker/draft_cache.py`) every copy also moves the draft's
rows of the same unit: its ring slots and partial pages in snapshots, its block beside the
target's in a saved block's file (`draft.*` tensors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import torch

from deepinfer.contracts.kv_files import KV_FILE_VERSION, SNAPSHOT, root_dir
from deepinfer.contracts.numerics import NumericsRecord
from deepinfer.contracts.plan import CacheLoad, CachePersist, ScheduledRequest, StepPlan
from deepinfer.distributed.parallel_state import all_reduce, tp_rank, tp_size

logger = logging.getLogger("deepinfer.worker")


_NOT_KV = ("transformers_version", "architectures", "torch_dtype", "dtype", "use_cache", "output_attentions",
           "output_hidden_states", "return_dict")


def cache_identity(source, numerics: NumericsRecord, groups) -> str:
    """sha256 over everything that changes cached K/V: the weights' content (`source.identity`),
    the model config (RoPE and its scaling, windows, layer types: the whole config, less
    bookkeeping fields), the row identity `numerics` as a whole (quantization and every weight's
    format, compute dtype, kernels' ISA, attention backend, device, batch-invariant mode, ...: see
    `contracts/numerics.py`; its derived fields, such as the reasons, are left out) and the cache
    layout; with several tensor-parallel ranks, the rank and their number. Two engines share saved
    units only when all of them agree."""
    config = source.hf_config.to_dict() if hasattr(source.hf_config, "to_dict") else vars(source.hf_config)
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in _NOT_KV}
    document = {"version": KV_FILE_VERSION, "weights": source.identity, "config": config,
                "numerics": numerics.identity(), "groups": [dataclasses.asdict(g) for g in groups]}
    if tp_size() > 1:  # each rank's files hold its slice of the rows: a root of their own
        document["rank"] = f"{tp_rank()} of {tp_size()}"
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


class PrefixStore:
    """Copies between requests' cache units, snapshot slots and the cache directory."""

    def __init__(self, cache, model, num_state_slots: int, num_snapshot_slots: int, disk=None, draft=None):
        self.cache, self.model, self.disk = cache, model, disk
        self.draft = draft  # the draft model's DraftCache: its rows travel with each unit (None: no draft)
        self.groups = cache.groups
        self.ring = [gi for gi, g in enumerate(self.groups) if g.is_ring]
        self.paged = [gi for gi, g in enumerate(self.groups) if not g.is_ring]
        self.first_snapshot_unit = num_state_slots
        page = cache.allocations[self.paged[0]].shape[1] if self.paged else 0
        device = cache.allocations[0].device
        self.pages = torch.zeros(num_snapshot_slots, len(self.paged), page, dtype=torch.uint8, device=device)
        # [snapshots, paged groups, page bytes]

    @property
    def snapshot_bytes(self) -> int:
        """Bytes one snapshot takes: ring slots, per-request state and partial pages."""
        rings = sum(self.cache.unit_bytes(gi) for gi in self.ring)
        return rings + self.model.state_bytes_per_slot() + len(self.paged) * self.pages.shape[-1]

    # ---- within memory ----------------------------------------------------------------------
    def _partial_block(self, pi: int, boundary: int) -> int | None:
        """Index in paged group pi's table of the block `boundary` falls inside (None: on an edge)."""
        g = self.groups[self.paged[pi]]
        rows = boundary // g.compress_ratio
        return rows // g.rows_per_unit if rows % g.rows_per_unit else None

    def _page(self, pi: int, block_id: int) -> torch.Tensor:
        return self.cache.allocations[self.paged[pi]][block_id]  # [page bytes]

    def capture(self, s: ScheduledRequest) -> None:
        """Copy the request's rings, state and partial pages at its step's end into s.capture_to."""
        unit, boundary = self.first_snapshot_unit + s.capture_to, s.start_pos + s.num_tokens
        for ri, gi in enumerate(self.ring):
            self.cache.allocations[gi][unit].copy_(self.cache.allocations[gi][s.state_ids[ri]])
        self.model.write_state(unit, self.model.read_state(s.state_ids[0]))
        for pi in range(len(self.paged)):
            j = self._partial_block(pi, boundary)
            if j is not None:
                self.pages[s.capture_to, pi].copy_(self._page(pi, s.block_ids[pi][j]))
        if self.draft is not None:
            self.draft.capture(s, boundary)

    def restore(self, s: ScheduledRequest) -> None:
        """The request's fresh rings, state and partial pages at s.start_pos from s.restore_from."""
        unit = self.first_snapshot_unit + s.restore_from
        for ri, gi in enumerate(self.ring):
            self.cache.allocations[gi][s.state_ids[ri]].copy_(self.cache.allocations[gi][unit])
        self.model.write_state(s.state_ids[0], self.model.read_state(unit))
        for pi in range(len(self.paged)):
            j = self._partial_block(pi, s.start_pos)
            if j is not None:
                self._page(pi, s.block_ids[pi][j]).copy_(self.pages[s.restore_from, pi])
        if self.draft is not None:
            self.draft.restore(s)

    # ---- the plan's operations ----------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> tuple[StepPlan, dict[str, list[str]]]:
        """Save the plan's persist units, read every request's loads, then restore the snapshots of
        those whose loads all worked. Requests whose files fail (on any rank) are left out of the
        returned plan and reported."""
        for op in plan.persist:
            self.persist(op)
        failed: dict[str, list[str]] = {}
        for s in plan.scheduled:
            bad = [op.path for op in s.loads if not self.load(op)]
            if bad:
                failed[s.request_id] = bad
        failed = self._agreed(plan, failed)
        for s in plan.scheduled:
            if s.request_id not in failed and s.restore_from is not None:
                self.restore(s)
        if failed:
            plan = StepPlan([s for s in plan.scheduled if s.request_id not in failed], plan.finished_request_ids,
                            plan.preempted_request_ids)
        return plan, failed

    def _agreed(self, plan: StepPlan, failed: dict[str, list[str]]) -> dict[str, list[str]]:
        """With several ranks, each reads its own slice files: a request whose files failed on any
        rank fails on every rank (one all_reduce of a flag per request, in plan order), so all
        ranks leave out the same requests. Rank 0 reports its own paths for them."""
        if tp_size() == 1 or not any(s.loads for s in plan.scheduled):
            return failed
        device = self.cache.allocations[0].device
        flags = torch.tensor([s.request_id in failed for s in plan.scheduled], dtype=torch.int32, device=device)
        all_reduce(flags)  # [R]: how many ranks failed each request
        return {s.request_id: failed.get(s.request_id) or [op.path for op in s.loads]
                for s, flag in zip(plan.scheduled, flags.tolist(), strict=True) if flag}

    def finish(self, plan: StepPlan) -> None:
        """After the step: take the snapshots it asked for."""
        for s in plan.scheduled:
            if s.capture_to is not None:
                self.capture(s)

    # ---- the cache directory ------------------------------------------------------------------
    def _unit_tensors(self, op: CachePersist | CacheLoad) -> dict[str, torch.Tensor]:
        """The live tensors a unit's file holds (views into the caches; the draft's beside them)."""
        if op.group >= 0:
            tensors = {"page": self._page(op.group, op.unit)}
        else:
            unit = self.first_snapshot_unit + op.unit
            tensors = {f"ring.{self.groups[gi].name}": self.cache.allocations[gi][unit] for gi in self.ring}
            tensors.update({f"page.{self.groups[gi].name}": self.pages[op.unit, pi]
                            for pi, gi in enumerate(self.paged)})
        if self.draft is not None:
            tensors.update(self.draft.unit_tensors(op.group, op.unit))
        return tensors

    def _kind(self, op: CachePersist | CacheLoad) -> str:
        return SNAPSHOT if op.group < 0 else self.groups[self.paged[op.group]].name

    def _file(self, op: CachePersist | CacheLoad) -> str:
        """This rank's file of the unit: the plan names rank 0's; another rank's sits under its
        own root folder with the same name."""
        return os.path.join(root_dir(self.disk.directory, self.disk.root), os.path.basename(op.path))

    def persist(self, op: CachePersist) -> None:
        """Copy the unit's bytes now; the disk store writes them in the background."""
        if self.disk is None:
            return
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in self._unit_tensors(op).items()}
        if op.group < 0:
            state = self.model.read_state(self.first_snapshot_unit + op.unit)
            tensors.update({f"state.{name}": t.to("cpu", copy=True) for name, t in state.items()})
        self.disk.save(self._file(op), self._kind(op), op.key, tensors, mtime_ns=op.mtime_ns)

    def load(self, op: CacheLoad) -> bool:
        """Read one saved unit into its place; False (with a warning) if it cannot be used. The
        file must hold exactly the unit's tensor bytes (checked before it is read)."""
        if self.disk is None:
            return False
        targets = self._unit_tensors(op)
        want_state = self.model.read_state(0) if op.group < 0 else {}
        payload = sum(t.numel() * t.element_size() for t in (*targets.values(), *want_state.values()))
        loaded = self.disk.load(self._file(op), self._kind(op), op.key, op.mtime_ns, payload_bytes=payload)
        if loaded is None:
            return False
        state = {n.removeprefix("state."): t for n, t in loaded.items() if n.startswith("state.")}
        plain = {n: t for n, t in loaded.items() if not n.startswith("state.")}
        bad = _mismatch(plain, targets) or (op.group < 0 and _mismatch(state, want_state))
        if bad:
            logger.warning("saved KV cache file %s does not fit this cache (%s); recomputing", self._file(op), bad)
            return False
        for name, t in plain.items():
            targets[name].copy_(t)
        if op.group < 0:
            self.model.write_state(self.first_snapshot_unit + op.unit, state)
        return True

    def close(self) -> None:
        """Flush and stop the directory's writer; later steps neither save nor load."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None


def _mismatch(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str | None:
    """Why `loaded` cannot replace `expected` (names, shapes, dtypes), or None."""
    if set(loaded) != set(expected):
        return f"tensors {sorted(loaded)} where {sorted(expected)} are expected"
    for name, t in loaded.items():
        want = expected[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            return f"{name} is {tuple(t.shape)} {t.dtype}, expected {tuple(want.shape)} {want.dtype}"
    return None
