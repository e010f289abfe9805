"""What a model offers the runner, and what a runner offers the engine (typing Protocols).

    engine  --StepPlan-->  StepRunner.execute  --ModelOutput-->  engine
                               |  builds inputs and metadata, then calls
                               v
                           CachedModel: cache_groups() -> bind_caches(...) -> forward / compute_logits

Both the Llama family and DeepSeek-V4 implement `CachedModel`; the runner has one path for all.
What differs between model classes is declared, never probed: each class sets `capabilities`
(`ModelCapabilities`), and code that needs more than the protocol reads that record (CUDA graphs,
tensor and expert parallelism, MTP drafting through `DraftingModel`). Tensors are typed `Any`
here: this floor does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.plan import ModelOutput, StepPlan


@dataclass
class BoundCaches:
    """The allocated caches a model binds its layers to.

    groups: the sized specs, in metadata order (`AttentionMetadata.groups[i]` is group i's);
    layer_caches[i]: layer id -> that layer's cache view in group i; num_state_slots: ring state
    slots (per-request state beside the rings uses the same ids); backend: the attention backend
    for layers that delegate to one."""

    groups: list[CacheGroupSpec]
    layer_caches: list[dict[int, Any]]
    num_state_slots: int
    backend: Any

    def group_index(self, name: str) -> int:
        names = [g.name for g in self.groups]
        if name not in names:
            raise KeyError(f"no cache group {name!r}; groups are {names}")
        return names.index(name)


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model class supports beyond `CachedModel`, declared as a class attribute
    (`capabilities`) and read by the code that depends on it; everything defaults to no.

    graph_safe_decode: its forward reads only ids, positions and token-group metadata and keeps
        no per-request state, so decode steps may replay as CUDA graphs (`worker/cuda_graphs.py`);
    tensor_parallel: its layers split over tensor_parallel_size ranks (weights read slice by slice);
    expert_parallel: its routed experts split over expert_parallel_size rank groups;
    mtp_drafting: it has next-n layers, and `add_mtp()` builds the draft module `mtp` before the
        weights load (a `DraftingModel`; speculative_method="mtp");
    drafting_streams: with the draft module on, `forward` keeps its pre-head residual streams in
        `last_streams` [T, N, hidden], the draft module's input;
    native_batch_invariant: on the fp32 CPU path with the C++ kernels every op of its forward is
        row-independent as it is, so DEEPINFER_BATCH_INVARIANT needs no BatchInvariantMode around it
        and is on by default there (`layers/batch_invariant.native_path`);
    quantize_at_load: its linear layers (and routed experts) may be quantized after loading
        (`quantization` "int8" / "int4", `model_loader.build_model`);
    pictures: it has a vision encoder (a `PictureModel`): `encode_pictures(pictures)` gives each
        picture's rows [length, hidden], and `forward(input_ids, positions, picture_rows=None)`
        puts `picture_rows`' embeds in place of those packed rows of the (scaled) token embeddings;
    whole_picture_runs: a picture's placeholder run attends to itself whole in the prefill (Gemma 3),
        so no prefill chunk may end inside a run it begins (the scheduler keeps runs whole);
    rope_positions: its RoPE reads positions of its own (M-RoPE: [3, T], from a request's pictures):
        the runner asks `model.rope_positions(pictures, start, count)` for each scheduled request and
        passes the packed [3, T] as `forward(..., rope_positions=)` (`worker/rope_positions.py`);
        `positions` [T] still address the cache.
    """

    graph_safe_decode: bool = False
    tensor_parallel: bool = False
    expert_parallel: bool = False
    mtp_drafting: bool = False
    drafting_streams: bool = False
    native_batch_invariant: bool = False
    quantize_at_load: bool = False
    pictures: bool = False
    whole_picture_runs: bool = False
    rope_positions: bool = False


@runtime_checkable
class CachedModel(Protocol):
    """A decoder whose layers keep their K/V in the engine's cache groups."""

    capabilities: ClassVar[ModelCapabilities]  # what the class supports beyond this protocol

    def cache_groups(self) -> list[CacheGroupSpec]:
        """The groups its layers use (unsized: rows_per_unit 0), each with its RowSpec."""

    def state_bytes_per_slot(self) -> int:
        """Bytes of per-request state kept beside the rings (0 for most models)."""

    def bind_caches(self, caches: BoundCaches) -> None:
        """Give every layer its cache views and the metadata index of its groups."""

    def forward(self, input_ids: Any, positions: Any) -> Any:
        """input_ids, positions [T] -> hidden states [T, hidden] (caches read and written)."""

    def compute_logits(self, hidden: Any) -> Any:
        """hidden [N, hidden] -> logits [N, V] for the rows that sample."""

    def read_state(self, slot: int) -> dict[str, Any]:
        """Copies of the per-request state beside the caches in state slot `slot` (named tensors;
        {} for most models), for prefix-cache snapshots."""

    def write_state(self, slot: int, tensors: dict[str, Any]) -> None:
        """Set slot `slot`'s per-request state from `read_state`'s tensors."""

    def keep_verified(self, kept: dict[int, int]) -> None:
        """After a step with verification spans: span (by its first packed row) -> how many of
        its tokens were kept (the last sampled token and the accepted drafts). Per-request state
        beside the caches (DeepSeek-V4's compressors) must end as if only those were computed;
        cache rows of the rest need no undo (they are overwritten before anything reads them)."""

    def begin_step(self) -> None:
        """Before each step (the runner calls it): start recording what the step changes in the
        per-request state beside the caches, forgetting the last step's record. No-op for
        models without such state."""

    def undo_step(self) -> None:
        """After a step that raised: put the per-request state beside the caches back to where
        `begin_step` found it (DeepSeek-V4: every compressor's token count, open window and half
        A), so the step's requests can run again; then stop recording. Cache rows are not the
        model's to restore (the runner puts back ring rows the step loaded and overwrote)."""


class DraftingModel(CachedModel, Protocol):
    """A `CachedModel` whose capabilities say `mtp_drafting` (and `drafting_streams`): the
    members the MTP drafter (`spec_decode/mtp.py`) uses."""

    mtp: Any  # the next-n draft module; None until `add_mtp()`
    last_streams: Any  # [T, N, hidden] pre-head streams of the last forward (with `mtp` on)

    def add_mtp(self) -> None:
        """Build the draft module (before the weights load); ValueError when the config has no
        next-n layers."""


class PictureModel(CachedModel, Protocol):
    """A `CachedModel` whose capabilities say `pictures`: the members the worker's picture
    gathering (`worker/picture_rows.py`) and forward use."""

    def encode_pictures(self, pictures: list) -> list[Any]:
        """The encoder output of each `PictureInput` (one batch where shapes allow): a tensor
        [p.length, hidden] per picture, row i the embedding of placeholder token offset + i."""

    def forward(self, input_ids: Any, positions: Any, picture_rows: Any = None) -> Any:
        """As `CachedModel.forward`; `picture_rows` (rows: LongTensor [P] packed-row indices,
        embeds: [P, hidden]) replace those rows of the token embeddings (after any embedding
        scale: picture rows are not scaled). None: a step without picture rows."""


@runtime_checkable
class StepRunner(Protocol):
    """What the engine needs of the worker: the cache layout to manage, the step itself, its
    counters and its end."""

    groups: list[CacheGroupSpec]
    num_blocks: int
    num_state_slots: int
    num_snapshot_slots: int  # prefix-cache snapshots of ring rows and per-request state
    cache_identity: str  # everything that changes K/V (weights, config, dtype, row format, layout)
    pictures: bool  # its model takes pictures (`ModelCapabilities.pictures`)
    whole_picture_runs: bool  # a prefill chunk holds a picture's run whole (`ModelCapabilities`)

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Run one step's model call and sampling. A step that raises a fault that is not fatal
        (`contracts.plan.is_fatal_fault`) leaves what a re-run of any of its requests reads
        (per-request state beside the caches, ring rows it loaded and overwrote) as it was
        before the step, so the engine may run them again one at a time."""

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request state (generators) of finished or aborted requests."""

    def stats(self) -> dict[str, int]:
        """The runner's own counters since start, by metric name (the KV cache directory's
        `kv_cache_dir_*` bytes, files and load failures; {} without one)."""

    def close(self) -> None:
        """Finish writing the cache directory and stop what the runner started (follower ranks,
        their process group). Idempotent; the runner must not step afterwards."""


class NoRequestState:
    """The CachedModel members of a model that keeps no per-request state beside its caches (the
    Llama family, DeepSeek-V2/V3): nothing to size, record, undo, read or write."""

    def state_bytes_per_slot(self) -> int:
        return 0

    def keep_verified(self, kept: dict[int, int]) -> None:
        """Nothing to undo: rows of rejected drafts are overwritten before any query reads them."""

    def begin_step(self) -> None:
        """Nothing to record: no per-request state beside the caches."""

    def undo_step(self) -> None:
        """Nothing to put back (ring rows a chunk overwrites are the runner's to restore)."""

    def read_state(self, slot: int) -> dict:
        return {}

    def write_state(self, slot: int, tensors: dict) -> None:
        """Nothing to write: no per-request state."""
