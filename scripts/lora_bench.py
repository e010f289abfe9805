"""The batched LoRA op's time beside its base layer's: 4 adapters of rank 16 on a [576 -> 1536] layer
(SmolLM2-135M's gate/up projection), rows spread over the adapters, for T = 1, 16 and 256 rows.

    python scripts/lora_bench.py [--threads 1] [--reps 200]

Prints per T the median time of `lora_delta` (the op the layers call: the C++ kernel for fp32 CPU
tensors), of its torch reference `lora_delta_ref`, and of the base layer's fp32 `F.linear`, with the
op's time as a fraction of the base layer's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.ops.lora import lora_delta, lora_delta_ref, lora_op_name

IN_FEATURES, OUT_FEATURES, NUM_ADAPTERS, RANK = 576, 1536, 4, 16


def median_ms(fn, reps: int) -> float:
    """Median wall time of `fn()` in ms over `reps` calls, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * 0.05  # [out, in]
    a = torch.randn(NUM_ADAPTERS, RANK, IN_FEATURES, generator=gen) * 0.05  # [S, r, in]
    b = torch.randn(NUM_ADAPTERS, OUT_FEATURES, RANK, generator=gen) * 0.05  # [S, out, r]
    scale = torch.full((NUM_ADAPTERS,), 2.0)  # [S]
    print(f"lora_delta on {lora_op_name(torch.device('cpu'), torch.float32)}, {args.threads} thread(s), "
          f"[{IN_FEATURES} -> {OUT_FEATURES}], {NUM_ADAPTERS} adapters of rank {RANK}")
    for num_tokens in (1, 16, 256):
        x = torch.randn(num_tokens, IN_FEATURES, generator=gen)  # [T, in]
        slot = torch.arange(num_tokens) % NUM_ADAPTERS  # [T]
        base = median_ms(lambda: F.linear(x, weight), args.reps)  # noqa: B023
        op = median_ms(lambda: lora_delta(x, slot, a, b, scale), args.reps)  # noqa: B023
        ref = median_ms(lambda: lora_delta_ref(x, slot, a, b, scale), args.reps)  # noqa: B023
        print(f"T={num_tokens:4d}  base F.linear {base:7.3f} ms  lora_delta {op:7.3f} ms ({op / base:5.1%} of base)  "
              f"reference {ref:7.3f} ms ({ref / base:5.1%} of base)")


if __name__ == "__main__":
    main()
