"""A STREAM-like memory-bandwidth probe, and what share of it a decode step's weight reads reach.

Batch-1 decode reads every weight once per generated token, so its speed is bounded by memory
bandwidth: a token can take no less than (weight bytes) / (bandwidth). The probe measures that
bandwidth the way STREAM's Copy kernel does: `dst.copy_(src)` over two fp32 buffers far larger
than the last-level cache, on the benchmark's thread count, best of a few; each copy counts its
bytes read plus its bytes written (2 * nbytes; the write-allocate read STREAM does not count
either). The share of one engine is then

    achieved = weight_bytes * tokens_per_s        (bytes read per token / time per token)
    share    = achieved / copy_bytes_per_s

with `weight_bytes` the engine's own count of what it holds: DeepInfer's packed matrices plus its
dense parameters (`engine_weight_bytes`), llama.cpp's GGUF tensor bytes (`gguf_tensor_bytes`). It
counts every weight once: exact for a model with tied embeddings (the LM head reads the whole
table), an overstatement by the embedding table otherwise (a token reads one row of it). The KV
rows a short context reads are left out. A share near or above 1 means the weights stayed in
cache between tokens (a model smaller than the last-level cache) or the copy probe was slowed
by other work on the machine.

Decode only reads its weights, so the probe also measures a read alone (`measure_read_bandwidth`:
a sum over one buffer of the same size, counting its bytes once), the wall a decode kernel can
reach; the share of it is printed beside the copy's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

DEFAULT_PROBE_BYTES = 256 << 20  # per buffer: far past any last-level cache here (32 MiB)
DEFAULT_PROBE_REPEATS = 5


@dataclass(frozen=True)
class CopyProbe:
    """The best of `repeats` copies of `nbytes` on `threads` threads."""

    nbytes: int  # bytes of one buffer (the copy reads nbytes and writes nbytes)
    best_s: float  # the fastest run's seconds
    threads: int
    repeats: int

    @property
    def bytes_per_s(self) -> float:
        return copy_bytes_per_s(self.nbytes, self.best_s)

    def as_json(self) -> dict:
        return asdict(self) | {"bytes_per_s": self.bytes_per_s}


@dataclass(frozen=True)
class ReadProbe(CopyProbe):
    """The best of `repeats` sums over one buffer of `nbytes`: the same record, each byte counted once."""

    @property
    def bytes_per_s(self) -> float:
        return copy_bytes_per_s(self.nbytes, self.best_s) / 2


def copy_bytes_per_s(nbytes: int, seconds: float) -> float:
    """STREAM Copy's bandwidth: a copy of `nbytes` moves nbytes read + nbytes written."""
    if nbytes <= 0 or seconds <= 0:
        raise ValueError(f"copy bandwidth needs positive bytes and seconds, got {nbytes!r} and {seconds!r}")
    return 2 * nbytes / seconds


def weight_read_bytes_per_s(weight_bytes: int, tokens_per_s: float) -> float:
    """Bytes read per second when each generated token reads `weight_bytes`."""
    return weight_bytes * tokens_per_s


def bandwidth_share(weight_bytes: int, tokens_per_s: float, copy_rate: float) -> float:
    """(weight bytes per token / seconds per token) as a share of the copy bandwidth `copy_rate`."""
    if copy_rate <= 0:
        raise ValueError(f"copy bandwidth must be positive, got {copy_rate!r}")
    return weight_read_bytes_per_s(weight_bytes, tokens_per_s) / copy_rate


def measure_copy_bandwidth(threads: int, nbytes: int | None = None,
                           repeats: int = DEFAULT_PROBE_REPEATS) -> CopyProbe:
    """Copy an fp32 buffer of `nbytes` (default DEFAULT_PROBE_BYTES) into another `repeats` times on
    `threads` torch threads (after one untimed copy that faults the pages in); torch's thread count
    is restored after."""
    def setup(src):
        dst = src.clone()  # [n]: every page of dst touched
        return lambda: dst.copy_(src)

    return CopyProbe(*_best_of(threads, nbytes, repeats, setup), threads, repeats)


def _best_of(threads: int, nbytes: int | None, repeats: int, setup) -> tuple[int, float]:
    """(bytes of the fp32 buffer, fastest of `repeats` runs) of `setup(buffer)`'s operation, on `threads`
    torch threads (after one untimed run); torch's thread count is restored after."""
    import torch

    nbytes = DEFAULT_PROBE_BYTES if nbytes is None else nbytes
    if threads < 1 or repeats < 1 or nbytes < 4:
        raise ValueError(f"threads, repeats >= 1 and nbytes >= 4 needed, got {threads!r}, {repeats!r}, {nbytes!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)  # [n]
        run = setup(src)
        run()  # untimed
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        return src.numel() * 4, best
    finally:
        torch.set_num_threads(before)


def measure_read_bandwidth(threads: int, nbytes: int | None = None,
                           repeats: int = DEFAULT_PROBE_REPEATS) -> ReadProbe:
    """Sum an fp32 buffer of `nbytes` (default DEFAULT_PROBE_BYTES) `repeats` times on `threads` torch
    threads (after one untimed sum); torch's thread count is restored after."""
    return ReadProbe(*_best_of(threads, nbytes, repeats, lambda src: src.sum), threads, repeats)


def engine_weight_bytes(llm) -> int:
    """The bytes of weights our engine holds (packed quantized matrices plus dense parameters)."""
    from deepinfer.worker.summary import weight_bytes

    return weight_bytes(llm.engine.runner.model)


def gguf_tensor_bytes(path: str) -> int:
    """The bytes of every tensor stored in the GGUF file at `path` (what llama.cpp maps and reads)."""
    from deepinfer.model_executor.loader.gguf_file import read_gguf_file

    return sum(t.data.nbytes for t in read_gguf_file(path).tensors)
