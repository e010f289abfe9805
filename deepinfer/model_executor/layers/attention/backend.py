"""The attention backend contract: what a step's metadata holds and what a backend must do.

Packed token axis T: decode queries first (one row each; a verification step of k+1 tokens is
k+1 decode queries), then prefill segments (a chunk of one request each).

Order inside one layer, for every backend (DESIGN.md invariants 1, 2, 4):

    1. load   the cached rows each prefill segment attends to   (before anything is written)
    2. store  the new rows at their slots
    3. decode queries read through their index rows (their own new rows included)
    4. prefill queries attend over [loaded rows | the chunk's rows]

No backend applies a causal mask of its own to a cache read: an index row lists exactly the
slots a query may see, and -1 marks padding. Metadata comes per cache group, since a paged
group and a ring group address the same token differently.

Pictures seen whole (Gemma 3): `AttentionMetadata.horizons` [T], when set, is the last position
each query sees (its own for a text token, the run's last for a token of a picture's placeholder
run), so a run attends to itself bidirectionally in the prefill. Keys past a query's own position
are never cache reads: they are rows of the same chunk, so the run must lie in one chunk. Prefill
then takes the plain torch path on every backend (the batch-invariant blocks assume causality).

A layer's options reach every step that attends (attention/layer.py): `softcap` (None, or the
cap of s = cap * tanh(s / cap) on the scaled logits) and `sinks` (None, or [H] logits that join
each query's softmax denominator and add no value).

`AttentionBackend.forward` writes this order once; each step is a hook that runs through the
backend's kernel set (layers/kernel_set.py). The torch backend (below) adds the batch-invariant
variant; the Triton backend (triton_backend.py) is the same skeleton on the Triton set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.model_executor.layers.attention import invariant
from deepinfer.model_executor.layers.attention.invariant import StepLayouts, invariant_decode, invariant_prefill
from deepinfer.model_executor.layers.attention.layer_cache import LayerCache
from deepinfer.model_executor.layers.attention.transfer import transfer
from deepinfer.model_executor.layers.kernel_set import CPU_KERNELS, KernelSet


def _moved(metadata, device):
    """`metadata` (any of the dataclasses below) with its tensors on `device`, through one copy."""
    return metadata.with_tensors(iter(transfer(metadata.tensors(), device)))


@dataclass
class PrefillSegment:
    token_start: int  # first row of this segment on the packed token axis
    token_end: int  # one past its last row
    load_slots: torch.Tensor  # [n_old] flat slots of the cached rows the chunk attends to
    load_positions: torch.Tensor  # [n_old] their positions

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    def tensors(self) -> list[torch.Tensor]:
        return [self.load_slots, self.load_positions]

    def with_tensors(self, tensors) -> PrefillSegment:
        """The same segment with its tensors taken, in `tensors()` order, from the iterator `tensors`."""
        return PrefillSegment(self.token_start, self.token_end, next(tensors), next(tensors))

    def to(self, device) -> PrefillSegment:
        return _moved(self, device)


@dataclass
class GroupMetadata:
    """One token-row cache group's addresses for this step (full attention or a ring)."""

    window: int | None  # W for a ring group; None: full attention
    store_slots: torch.Tensor  # [M] flat slot of each stored row
    store_rows: torch.Tensor | None  # [M] which packed rows are stored (None: all T, in order)
    decode_index: torch.Tensor | None  # [N_decode, L] slots each decode query reads, -1 pad
    prefills: list[PrefillSegment] = field(default_factory=list)
    # [N_decode] leading columns of each index row that may name a slot (all later ones are -1), so a
    # kernel can stop there; None: all L (ring rows). Only a bound: the index row stays the mask.
    decode_lens: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.store_slots, self.store_rows, self.decode_index, self.decode_lens] + [
            t for seg in self.prefills for t in seg.tensors()]

    def with_tensors(self, tensors) -> GroupMetadata:
        """The same group with its tensors taken, in `tensors()` order, from the iterator `tensors`."""
        store_slots, store_rows, decode_index, decode_lens = (next(tensors) for _ in range(4))
        return GroupMetadata(self.window, store_slots, store_rows, decode_index,
                             [seg.with_tensors(tensors) for seg in self.prefills], decode_lens)

    def to(self, device) -> GroupMetadata:
        return _moved(self, device)


@dataclass
class CompressedGroupMetadata:
    """A paged group whose rows are not tokens: one row per `ratio` tokens (DeepSeek-V4's
    compressed rows and index keys). Per request span i, in packed order:

        span_rows[i]   [R_i]       slots of the request's rows 0 .. R_i - 1, R_i = rows after this step
        store_slots[i] [r_i]       slots of the rows this step completes (span_rows[i][R_i - r_i:])
        span_index[i]  [n_i, R_i]  slot of row c for each query that may read it, else -1

    The first `num_decode_spans` spans are decode requests of one token each, also given
    together: decode_rows [N, L] = their span_rows, padded with -1 (each one sees all its rows)."""

    ratio: int
    span_rows: list[torch.Tensor]
    store_slots: list[torch.Tensor]
    span_index: list[torch.Tensor]
    decode_rows: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        return [*self.span_rows, *self.store_slots, *self.span_index, self.decode_rows]

    def with_tensors(self, tensors) -> CompressedGroupMetadata:
        """The same group with its tensors taken, in `tensors()` order, from the iterator `tensors`."""
        n = len(self.span_rows)
        span_rows, store_slots, span_index = ([next(tensors) for _ in range(n)] for _ in range(3))
        return CompressedGroupMetadata(self.ratio, span_rows, store_slots, span_index, next(tensors))

    def to(self, device) -> CompressedGroupMetadata:
        return _moved(self, device)


@dataclass
class RequestSpan:
    """One request's rows on the packed token axis, for layers that keep per-request state
    (DeepSeek-V4's compressors live in the request's ring state slot)."""

    token_start: int
    token_end: int
    start_pos: int  # position of the span's first token
    state_ids: tuple[int, ...]  # one per ring group
    verify: bool = False  # a verification step: only a prefix of its tokens may be kept


@dataclass
class AttentionMetadata:
    """One step's metadata: positions, and per cache group (in the runner's group order) the
    addresses it stores to and reads from."""

    positions: torch.Tensor  # [T] position of each new row
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decode queries
    groups: list[GroupMetadata | CompressedGroupMetadata]
    spans: list[RequestSpan] = field(default_factory=list)  # packed order
    num_decode_spans: int = 0  # the first spans, one decode token each, batched (0: none or not all)
    # [T] the last position each query sees (>= its own; None: every query causal): ops/addressing.py
    # `run_horizons`, set for a step with pictures seen whole; read by the prefill only
    horizons: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor of the step's metadata, in a fixed order (`with_tensors` reads them back)."""
        return [self.positions, self.horizons] + [t for g in self.groups for t in g.tensors()]

    def with_tensors(self, tensors) -> AttentionMetadata:
        """The same metadata with its tensors taken, in `tensors()` order, from the iterator `tensors`."""
        positions, horizons = next(tensors), next(tensors)
        return AttentionMetadata(positions, self.num_decode_tokens, [g.with_tensors(tensors) for g in self.groups],
                                 self.spans, self.num_decode_spans, horizons)

    def to(self, device) -> AttentionMetadata:
        """The metadata on `device`: all its tensors through one copy (views of one buffer)."""
        return _moved(self, device)


def move_step(metadata: AttentionMetadata, extra: list[torch.Tensor], device,
              force: bool = False) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """A step's metadata and its `extra` tensors (input ids, sample index) on `device` through one
    copy (`transfer.transfer`; `force`: pack even when they are there already)."""
    moved = transfer([*extra, *metadata.tensors()], device, force)
    return metadata.with_tensors(iter(moved[len(extra):])), moved[:len(extra)]


class AttentionBackend:
    """One call per layer per step. `forward` is the step order, written once; the work of each
    step is a hook (`load`, `store`, `decode`, `prefill`) that runs through the backend's kernel set
    (layers/kernel_set.py: torch, C++ CPU or Triton). A variant overrides hooks, never `forward`."""

    name = "kernels"
    batch_invariant = False  # DEEPINFER_BATCH_INVARIANT (the CPU default): only the torch backend has the mode

    def __init__(self, kernels: KernelSet):
        self.kernels = kernels

    def forward(self, cache: LayerCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata, group: GroupMetadata, scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """cache: the layer's LayerCache; q [T, H, D]; k, v [T, H_kv, D] -> [T, H, D]."""
        md, g, opts = metadata, group, (softcap, sinks)
        loaded = [self.load(cache, seg) for seg in g.prefills]  # 1. load before store
        rows = g.store_rows
        self.store(cache, g.store_slots, k if rows is None else k[rows], v if rows is None else v[rows])  # 2.
        nd = md.num_decode_tokens
        if nd and nd == q.shape[0]:  # a decode-only step: no copy into a packed output
            return self.decode(cache, q, md, g, scale, *opts)  # [T, H, D]
        if not nd and len(g.prefills) == 1 and g.prefills[0].token_end - g.prefills[0].token_start == q.shape[0]:
            return self.prefill(cache, q, k, v, loaded[0], md, g, 0, scale, *opts)  # one chunk: [T, H, D], no copy
        out = torch.empty_like(q)  # [T, H, D]
        if nd:  # 3. decode reads
            out[:nd] = self.decode(cache, q[:nd], md, g, scale, *opts)
        for i, (seg, old) in enumerate(zip(g.prefills, loaded, strict=True)):  # 4. prefill over [old | chunk]
            s, e = seg.token_start, seg.token_end
            out[s:e] = self.prefill(cache, q[s:e], k[s:e], v[s:e], old, md, g, i, scale, *opts)
        return out

    def load(self, cache: LayerCache, seg: PrefillSegment) -> torch.Tensor:
        """The cached rows a prefill segment attends to -> [n_old, 2, H_kv, D]."""
        return cache.load(seg.load_slots)

    def store(self, cache: LayerCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [M, H_kv, D] -> the rows of flat slots [M]."""
        self.kernels.store_rows(cache, slots, k, v)

    def decode(self, cache: LayerCache, q: torch.Tensor, metadata: AttentionMetadata, group: GroupMetadata,
               scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode queries q [N, H, D] through their index rows -> [N, H, D]."""
        return self.kernels.decode_attention(cache, q, group.decode_index, scale, group.decode_lens, softcap, sinks)

    def prefill(self, cache: LayerCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, loaded: torch.Tensor,
                metadata: AttentionMetadata, group: GroupMetadata, i: int, scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Segment i: q [n, H, D], k, v [n, H_kv, D] over [loaded [n_old, 2, H_kv, D] | chunk] -> [n, H, D]."""
        seg = group.prefills[i]
        q_pos = metadata.positions[seg.token_start:seg.token_end]  # [n]
        top = None if metadata.horizons is None else metadata.horizons[seg.token_start:seg.token_end]  # [n]
        return self.kernels.prefill_attention(q, k, v, loaded, q_pos, seg.load_positions, scale, group.window,
                                              softcap, sinks, top)


class TorchAttentionBackend(AttentionBackend):
    """The torch backend: the C++ CPU kernels where they serve (CPU), torch elsewhere. With
    `batch_invariant=True` (DEEPINFER_BATCH_INVARIANT, on by default on the CPU) every query, decode
    or prefill, reduces over exactly its visible keys in fixed blocks (attention/invariant.py), so
    its bits depend on neither the batch nor the chunking: on the CPU kernel set through the C++
    kernels of ops/invariant_cpu.cpp where they serve the call class (fp32 CPU queries, plain cache
    rows), otherwise, and on the torch kernel set, through the torch implementation."""

    name = "torch"

    def __init__(self, batch_invariant: bool = False, kernels: KernelSet = CPU_KERNELS):
        super().__init__(kernels)
        self.batch_invariant = batch_invariant
        self.layouts = StepLayouts() if batch_invariant else None
        # the C++ invariant attention (ops/invariant_cpu.cpp) where it serves the call: the CPU set
        self.cpu_invariant = batch_invariant and kernels.name == CPU_KERNELS.name

    def decode(self, cache, q, metadata, group, scale, softcap=None, sinks=None):
        if not self.batch_invariant:
            return super().decode(cache, q, metadata, group, scale, softcap, sinks)
        if self.cpu_invariant:
            first = self.layouts.first(metadata, group)  # [N]: column 0 of each index row
            return invariant.decode_attention(cache, q, group.decode_index, first, scale, softcap, sinks)  # [N, H, D]
        return invariant_decode(cache, q, self.layouts.decode(metadata, group), scale, softcap, sinks)  # [N, H, D]

    def prefill(self, cache, q, k, v, loaded, metadata, group, i, scale, softcap=None, sinks=None):
        if not self.batch_invariant or metadata.horizons is not None:  # pictures seen whole: the plain path
            return super().prefill(cache, q, k, v, loaded, metadata, group, i, scale, softcap, sinks)
        if self.cpu_invariant:
            seg = group.prefills[i]
            q_pos = metadata.positions[seg.token_start:seg.token_end]  # [n]
            start = int(seg.load_positions[0]) if seg.load_positions.numel() else int(q_pos[0])
            return invariant.prefill_attention(cache, q, k, v, loaded, q_pos, start, group.window, scale,
                                               softcap, sinks)  # [n, H, D]
        layout = self.layouts.prefill(metadata, group, i)
        return invariant_prefill(cache, q, k, v, loaded, layout, scale, softcap, sinks)  # [n, H, D]
