"""Time the integer dot-product kernels (`ops/qdot.py`) against torch's fp32 GEMM on dense weights.

For a small ([576 -> 1536]; [512 -> 1536] for Q4_K, whose blocks need K % 256 == 0) and a large
([1536 -> 8960]) Q4_K and Q4_1 weight, prints the time per call for M = 1, 8, 32, 512 activation
rows on each qdot variant this CPU runs (activation quantization included), torch's fp32 GEMM on
the weight dequantized beforehand (`--quantization none`'s path, 4 bytes per weight), and, for
M = 1, GB/s of weight bytes as stored: with the weight in cache (these weights fit in L2/L3), and
"cold", over enough copies of it (> 3x a 32 MB L3) that each call reads its weight from memory, as a
model's layers do.

    python scripts/qdot_bench.py [--threads 2] [--rows 1,8,32,512] [--isa avx2,...] [--min-time 0.3] [--rounds 1]

On a shared machine, --rounds R times every cell R times, interleaved, and keeps each cell's best
(a neighbour that holds a core stalls a 2-thread call by a scheduler tick, milliseconds).
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from deepinfer.model_executor.layers.ops import qdot as qd
from deepinfer.model_executor.layers.ops.cpu_kernels import qdot_levels


class Weight:
    """The blocks qdot reads (data, kind, shape) plus the weight dequantized to fp32 (`dense`)."""

    def __init__(self, kind: str, n: int, k: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        if kind == "Q4_1":
            data = quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                   GGMLQuantizationType.Q4_1)
        else:  # gguf cannot quantize Q4_K: random codes and 6-bit scales, valid fp16 d / dmin
            spec = qd.KINDS[kind]
            data = rng.integers(0, 256, (n, k // spec.block_values * spec.block_bytes), dtype=np.uint8)
            blocks = data.reshape(n, -1, spec.block_bytes)
            blocks[..., 0:4] = (rng.random((n, blocks.shape[1], 2)) * 1e-3).astype(np.float16).view(np.uint8)
        self.data, self.kind, self.shape = torch.from_numpy(np.ascontiguousarray(data)), kind, (n, k)
        self.dense = qd.dequantize_ref(self)  # [N, K] fp32


def best_time(fn, min_time: float) -> float:
    """The fastest call of `fn` (after a warm-up) over at least `min_time` seconds (and 3 calls)."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while spent < min_time or calls < 3:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
        if took > 2.0:  # a slow variant: one timed call is enough
            break
    return best


def dense_path(x: torch.Tensor, w: Weight):
    """The dequantized weight through torch's fp32 GEMM (no quantization of anything at call time)."""
    return lambda: F.linear(x, w.dense)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,32,512")
    parser.add_argument("--isa", default=None, help="comma-separated qdot variants (default: all this CPU runs)")
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = args.isa.split(",") if args.isa else [qd.ISA_NAMES[i] for i in reversed(qdot_levels())]
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [("Q4_K", 512, 1536), ("Q4_1", 576, 1536), ("Q4_K", 1536, 8960), ("Q4_1", 1536, 8960)]
    weights = [(kind, k, n, Weight(kind, n, k)) for kind, k, n in shapes]
    inputs = {(k, m): torch.randn(m, k) for _, k, _, _ in weights for m in rows}
    copies = {(kind, k): cold_copies(w) for kind, k, _, w in weights} if 1 in rows else {}
    best: dict[tuple, float] = {}
    for _ in range(args.rounds):
        for kind, k, _, w in weights:
            for m in rows:
                x = inputs[k, m]
                calls = [lambda x=x, w=w, isa=isa: qd.qlinear(x, w, isa=isa) for isa in isas] + [dense_path(x, w)]
                for column, call in enumerate(calls):
                    cell = (kind, k, m, column)
                    best[cell] = min(best.get(cell, float("inf")), best_time(call, args.min_time))
                if m == 1:  # the weight from memory: one call on each copy in turn
                    cold = [[lambda x=x, c=c, isa=isa: qd.qlinear(x, c, isa=isa) for c in copies[kind, k]]
                            for isa in isas] + [[dense_path(x, c) for c in copies[kind, k]]]
                    for column, group in enumerate(cold):
                        cell = (kind, k, "cold", column)
                        best[cell] = min(best.get(cell, float("inf")), cold_time(group))
    print(f"threads {args.threads}; times in ms per call (activation quantization included); "
          f"GB/s: weight bytes as stored / time, M = 1")
    header = f"{'weight':<22}{'M':>5}" + "".join(f"{name:>13}" for name in [*isas, "fp32 dense"])
    for kind, k, n, w in weights:
        print(f"\n{header}")
        for m in rows:
            times = [best[kind, k, m, column] for column in range(len(isas) + 1)]
            label = f"{kind} [{k} -> {n}]"
            print(f"{label:<22}{m:>5}" + "".join(f"{t * 1e3:>13.3f}" for t in times))
            if m == 1:
                print(f"{'  GB/s':<27}" + "".join(f"{g:>13.1f}" for g in gb_per_s(w, times)))
                cold = [best[kind, k, "cold", column] for column in range(len(isas) + 1)]
                print(f"{'  GB/s cold':<27}" + "".join(f"{g:>13.1f}" for g in gb_per_s(w, cold)))


def gb_per_s(w: Weight, times: list[float]) -> list[float]:
    """Weight bytes per second: qdot's columns read the blocks, the dense one its fp32 weight."""
    dense_bytes = w.dense.numel() * w.dense.element_size()
    return [w.data.numel() / t / 1e9 for t in times[:-1]] + [dense_bytes / times[-1] / 1e9]


def cold_copies(w: Weight) -> list[Weight]:
    """Copies of w in their own memory, 96 MB of blocks at least (3x a 32 MB L3)."""
    copies = []
    for _ in range(-(-96 * 2**20 // w.data.numel())):
        c = copy.copy(w)
        c.data, c.dense = w.data.clone(), w.dense.clone()
        copies.append(c)
    return copies


def cold_time(calls: list) -> float:
    """Seconds per call, the calls made in turn (each reads its own weight from memory); best of 3."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - start) / len(calls))
    return best


if __name__ == "__main__":
    main()
