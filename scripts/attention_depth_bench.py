"""Time one decode query of the CPU batch-invariant attention (ops/invariant_cpu.cpp) over a deep cache.

    python scripts/attention_depth_bench.py                         # 4096 / 16384 / 32768 keys
    python scripts/attention_depth_bench.py --depths 8192 --threads 1 2 4
    python scripts/attention_depth_bench.py --heads 9 3 64               # SmolLM2-135M's heads
    git show REV:deepinfer/model_executor/layers/ops/invariant_cpu.cpp > /tmp/old.cpp
    python scripts/attention_depth_bench.py --baseline-source /tmp/old.cpp    # adds that kernel's times

Heads as Qwen2-1.5B by default: H = 12 query heads, H_kv = 2, D = 128. One query at the last
position sees every key; its index row names cache rows in shuffled blocks of 16 (as a paged cache holds them).
Row formats: fp32 rows and int8 (q8) rows. Each figure is the best and the median of --repeats
calls after two warm-up calls (on a shared machine the best is the steadier one). A baseline
source (an earlier invariant_cpu.cpp) is built as its own library with its ops renamed, and timed
on the fp32 rows only (an earlier kernel may not read q8 rows).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
import types

import torch

from deepinfer.model_executor.layers.ops import fused
from deepinfer.model_executor.layers.ops.cpu_kernels import _CFLAGS, kernel_isa, load_library
from deepinfer.model_executor.layers.ops.q8 import q8_row_bytes, quantize_q8

R = 16  # rows per paged block


def make_cache(depth: int, kind: str, heads: tuple[int, int, int], seed: int = 0):
    """A one-layer paged cache of `depth` rows in shuffled blocks -> (cache, slots [depth])."""
    _, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(depth, 2 * hkv * d, generator=g)  # [P, E]
    units = -(-depth // R)
    table = torch.randperm(units, generator=g)
    slots = table[torch.arange(depth) // R] * R + torch.arange(depth) % R  # [P]
    if kind == "int8":
        rows = torch.zeros(units * R, q8_row_bytes(2 * hkv * d), dtype=torch.uint8)
        rows[slots] = quantize_q8(kv)
    else:
        rows = torch.zeros(units * R, 2 * hkv * d)
        rows[slots] = kv
    codec = types.SimpleNamespace(fp8=False, num_kv_heads=hkv, head_dim=d)
    return types.SimpleNamespace(rows2d=rows, rows_per_unit=R, lines_per_unit=R, layer_offset=0, codec=codec), slots


def best_and_median_ms(fn, repeats: int) -> tuple[float, float]:
    fn(), fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3, statistics.median(times) * 1e3


def current_kernel(isa: int):
    op = fused.invariant_decode_attention_op(None)
    return lambda cache, q, index, first: op.kernel(isa, cache, q, index, first, q.shape[-1] ** -0.5)


def baseline_kernel(source: str, isa: int):
    """An earlier invariant_cpu.cpp, its ops moved to the namespace deepinfer_cpu_baseline."""
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "invariant_baseline.cpp")
    with open(source) as f, open(path, "w") as out:
        out.write(f.read().replace("deepinfer_cpu", "deepinfer_cpu_baseline"))
    pool = os.path.join(folder, "work_pool_baseline.cpp")  # the kernels' thread pool: a copy of its own
    with open(os.path.join(os.path.dirname(fused.__file__), "work_pool.cpp")) as f, open(pool, "w") as out:
        out.write(f.read().replace("deepinfer_cpu", "deepinfer_cpu_baseline"))
    load_library("invariant_baseline", [path, pool], _CFLAGS)
    op = torch.ops.deepinfer_cpu_baseline.invariant_decode_attn
    return lambda cache, q, index, first: op(q, cache.rows2d, index, first, cache.codec.num_kv_heads,
                                             cache.rows_per_unit, cache.lines_per_unit, cache.layer_offset,
                                             q.shape[-1] ** -0.5, isa, 0.0, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--heads", type=int, nargs=3, default=[12, 2, 128], metavar=("H", "H_KV", "D"))
    parser.add_argument("--baseline-source", help="an earlier invariant_cpu.cpp to time beside this one")
    args = parser.parse_args()
    isa = kernel_isa()
    if isa == 0:
        raise SystemExit("the CPU kernels are not available here (kernel_isa() == 0)")
    kernels = {"new": current_kernel(isa)}
    if args.baseline_source:
        kernels["old"] = baseline_kernel(args.baseline_source, isa)
    heads = tuple(args.heads)
    q = torch.randn(1, heads[0], heads[2], generator=torch.Generator().manual_seed(1))  # [1, H, D]
    print(f"isa {isa}; one decode query, H={heads[0]} H_kv={heads[1]} D={heads[2]}; ms, best / median of "
          f"{args.repeats} calls")
    print(f"{'depth':>6} {'rows':>5} {'kernel':>6} " + " ".join(f"{f'{n} thr':>15}" for n in args.threads))
    for depth in args.depths:
        for kind in ("fp32", "int8"):
            cache, slots = make_cache(depth, kind, heads)
            index, first = slots[None], torch.zeros(1, dtype=torch.long)  # [1, P], [1]
            for name, kernel in kernels.items():
                if name == "old" and kind == "int8":
                    continue  # an earlier kernel may not read q8 rows
                cells = []
                call = functools.partial(kernel, cache, q, index, first)
                for n in args.threads:
                    torch.set_num_threads(n)
                    cells.append(best_and_median_ms(call, args.repeats))
                print(f"{depth:>6} {kind:>5} {name:>6} " + " ".join(f"{b:7.3f}/{m:7.3f}" for b, m in cells))


if __name__ == "__main__":
    main()
