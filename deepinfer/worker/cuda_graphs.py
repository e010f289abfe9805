"""CUDA graphs of decode-only steps: the model forward and its logits, captured at start-up for a
few batch sizes (buckets) and replayed over static input and metadata buffers.

    a step of N plain decodes  ->  bucket B = the smallest captured size >= N
    static buffers, rows 0 .. Bmax-1 (fixed addresses, like the cache):

        row         0 .. N-1          N .. B-1 (padding)
        input_ids   the step's ids    0
        positions   their positions   0
        store slot  their slots       -1   the Triton store kernel writes nothing
        index row   their read rows   -1   the Triton decode kernel gives zeros
                    (then -1 up to the group's width L_g)
        lens        their row ends    0    (paged groups) the kernel walks no further

    replay graph B  ->  logits [B, V] (the graph's own output)  ->  rows [:N] to the sampler

L_g is W for a ring group (`get_kv_index` rows) and max_model_len for a paged group. Buckets:
1, 2, 4, 8, then multiples of 8 up to the first that holds min(max_num_seqs, 256) requests.

A step qualifies when every scheduled request decodes one token and samples it (no prefill
chunk, no verification of drafts, no prompt_logprobs) and N <= Bmax; any other step runs eager.
Graphs are captured only on CUDA, with the Triton attention backend (its kernels take the padding
rows above), for a model whose `capabilities` declare `graph_safe_decode` (its forward reads only
ids, positions and token-group metadata: the Llama family, Gemma 3) and whose cache groups are all
token groups. DeepSeek-V4 (compressed groups, per-request compressor state, request spans) runs
eager, and so does a tensor-parallel run. `enforce_eager` turns them off.

Emulation (`capture=False`): "capture" keeps the eager forward over the static buffers and
"replay" runs it, so the bucket, padding and buffer logic runs on the CPU (Triton interpreted).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.distributed.parallel_state import tp_size
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.attention.backend import AttentionMetadata, GroupMetadata

logger = logging.getLogger("deepinfer.worker")

MAX_CAPTURE_SIZE = 256  # the largest decode batch captured; larger steps run eager
_SMALL_SIZES = (1, 2, 4, 8)
_LONG = dict(dtype=torch.long)


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 8, up to the first that holds
    min(max_num_seqs, limit) requests (3 -> [1, 2, 4]; 20 -> [1, 2, 4, 8, 16, 24])."""
    top = min(max_num_seqs, limit)
    sizes = [*_SMALL_SIZES, *range(16, limit + 1, 8)]
    return sizes[:next(i for i, b in enumerate(sizes) if b >= top) + 1]


def graphs_off_reason(enforce_eager: bool, device: torch.device, backend: str, groups: list[CacheGroupSpec],
                      model, emulate: bool = False) -> str | None:
    """Why decode steps cannot run as CUDA graphs (None: they can)."""
    if enforce_eager:
        return "enforce_eager"
    if device.type != "cuda" and not emulate:
        return f"device {device.type}"
    if tp_size() > 1:
        return "tensor_parallel_size > 1 (graphs around the layers' collectives are not verified yet)"
    if backend != "triton":
        return f"attention backend {backend!r} (graphs need 'triton')"
    if any(g.compress_ratio > 1 for g in groups) or not model.capabilities.graph_safe_decode:
        return f"{type(model).__name__} does not declare graph_safe_decode (DeepSeek-V4 runs eager)"
    return None


def is_plain_decode(s) -> bool:
    """One new token at start_pos > 0 that samples: no prefill, verification or prompt_logprobs."""
    return (s.num_tokens == 1 and s.start_pos > 0 and not s.verify and s.prompt_logprobs is None
            and s.do_sample)


def index_width(group: CacheGroupSpec, max_model_len: int) -> int:
    """L_g: columns of a decode index row of this group (ring: W; paged: max_model_len)."""
    return group.window if group.is_ring else max_model_len


class _Captured:
    """One bucket's CUDA graph and its static output."""

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor):
        self.graph, self.logits = graph, logits  # logits [B, V]

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits  # [B, V]


class _Emulated:
    """One bucket's forward, run eagerly over the static buffers at each replay (CPU tests)."""

    def __init__(self, forward: Callable[[], torch.Tensor]):
        self.forward = forward

    def replay(self) -> torch.Tensor:
        return self.forward()  # [B, V]


class DecodeGraphs:
    """Static buffers sized for the largest bucket, and one captured forward + logits per bucket."""

    def __init__(self, model, groups: list[CacheGroupSpec], max_model_len: int, sizes: list[int],
                 device: torch.device, capture: bool = True):
        self.model, self.sizes, self.capture = model, sorted(sizes), capture
        self.max_batch = b = self.sizes[-1]
        self.widths = [index_width(g, max_model_len) for g in groups]
        with torch.inference_mode():  # the buffers are written under the runner's inference mode
            self.input_ids = torch.zeros(b, device=device, **_LONG)  # [Bmax]
            self.positions = torch.zeros(b, device=device, **_LONG)  # [Bmax]
            self.store_slots = [torch.full((b,), -1, device=device, **_LONG) for _ in groups]  # [Bmax] per group
            self.decode_index = [torch.full((b, w), -1, device=device, **_LONG) for w in self.widths]  # [Bmax, L_g]
            # [Bmax] per paged group: where each index row's slots end (the kernel stops there); None for rings
            self.decode_lens = [None if g.is_ring else torch.zeros(b, device=device, **_LONG) for g in groups]
        self.windows = [g.window if g.is_ring else None for g in groups]
        self.num_replays = 0  # steps served by a graph (emulated or captured)
        self.capture_seconds = 0.0
        self.runs = self._capture_all()

    def _metadata(self, b: int) -> AttentionMetadata:
        """Bucket b's metadata: views of the static buffers, b one-token decode queries."""
        groups = [GroupMetadata(w, slots[:b], None, index[:b], decode_lens=None if lens is None else lens[:b])
                  for w, slots, index, lens in zip(self.windows, self.store_slots, self.decode_index,
                                                   self.decode_lens, strict=True)]
        return AttentionMetadata(self.positions[:b], b, groups, num_decode_spans=b)

    def _forward(self, b: int, metadata: AttentionMetadata) -> torch.Tensor:
        """logits [b, V] of the static rows 0 .. b-1. The ids and positions views are new objects
        at each call: RoPE keeps its cos/sin lookup per positions tensor, and the capture must
        record that lookup rather than reuse the warm-up's result."""
        with forward_context(metadata):
            hidden = self.model(self.input_ids[:b], self.positions[:b])  # [b, hidden]
        return self.model.compute_logits(hidden).float()  # [b, V]

    @torch.inference_mode()
    def _capture_all(self) -> dict[int, _Captured | _Emulated]:
        """One run per bucket, largest first, all graphs in one memory pool."""
        start, runs, pool = time.perf_counter(), {}, None
        for b in reversed(self.sizes):
            metadata = self._metadata(b)
            if not self.capture:
                runs[b] = _Emulated(lambda b=b, md=metadata: self._forward(b, md))
                continue
            self._forward(b, metadata)  # warm-up: Triton compiles, the allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b, metadata)  # [b, V]
            pool = graph.pool()
            runs[b] = _Captured(graph, logits)
        self.capture_seconds = time.perf_counter() - start
        return runs

    def bucket(self, n: int) -> int:
        """The smallest captured batch size >= n."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def accepts(self, inputs) -> bool:
        """True when the step (StepInputs) is N <= Bmax plain decodes whose index rows fit."""
        n = len(inputs.spans)
        if not 0 < n <= self.max_batch or not all(is_plain_decode(s) for s, _ in inputs.spans):
            return False
        return all(isinstance(g, GroupMetadata) and g.decode_index is not None and g.decode_index.shape[1] <= w
                   for g, w in zip(inputs.attn_metadata.groups, self.widths, strict=True))

    def run(self, inputs) -> torch.Tensor:
        """Logits [N, V] of an accepted step: its rows copied into the static buffers (the rest
        of its bucket padding), the bucket's graph replayed."""
        n = len(inputs.spans)
        b = self.bucket(n)
        self._load(inputs, n, b)
        logits = self.runs[b].replay()  # [b, V]
        self.num_replays += 1
        return logits[:n]  # [N, V]

    def _load(self, inputs, n: int, b: int) -> None:
        """Rows 0 .. n-1 from the step, rows n .. b-1 padding (see the module docstring)."""
        self.input_ids[:b].zero_()
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:b].zero_()
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        for g, slots, index, lens in zip(inputs.attn_metadata.groups, self.store_slots, self.decode_index,
                                         self.decode_lens, strict=True):
            slots[:b].fill_(-1)
            slots[:n].copy_(g.store_slots, non_blocking=True)
            width = g.decode_index.shape[1]
            index[:b].fill_(-1)
            index[:n, :width].copy_(g.decode_index, non_blocking=True)
            if lens is not None:  # padding rows: 0 columns; a step without lens: its whole width
                lens[:b].zero_()
                if g.decode_lens is None:
                    lens[:n].fill_(width)
                else:
                    lens[:n].copy_(g.decode_lens, non_blocking=True)

    def describe(self) -> str:
        """One line: what was captured (or emulated), and how long it took."""
        what = "captured" if self.capture else "emulated (no capture)"
        return (f"CUDA graphs {what} for decode batch sizes {', '.join(map(str, self.sizes))} "
                f"in {self.capture_seconds:.1f} s")


def build_decode_graphs(model, groups: list[CacheGroupSpec], backend: str, device: torch.device, config,
                        emulate: bool = False) -> DecodeGraphs | None:
    """The runner's decode graphs for `config` (EngineConfig), or None where steps run eager
    (logged on CUDA, with why). A capture that fails is logged and leaves decode eager."""
    reason = graphs_off_reason(config.enforce_eager, device, backend, groups, model, emulate)
    if reason is not None:
        if device.type == "cuda":
            logger.info("CUDA graphs off: %s; decode steps run eager", reason)
        return None
    sizes = capture_sizes(config.scheduler.max_num_seqs)
    try:
        graphs = DecodeGraphs(model, groups, config.max_model_len, sizes, device, capture=not emulate)
    except Exception as exc:  # a kernel or op that cannot be captured: serve eagerly rather than not at all
        logger.warning("CUDA graph capture failed (%s: %s); decode steps run eager", type(exc).__name__, exc)
        return None
    logger.info("%s", graphs.describe())
    return graphs
