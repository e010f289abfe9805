"""The workloads of `deepinfer bench`, one module each, and the token-id draws of the simple ones.

`make_workload` draws cpu32, decode1 and long (token ids, so a model without tokenizer files runs
too); `throughput` runs cpu32 and decode1 on one engine, `long` the sliding-window workload,
`kv` the KV-byte lines of a model with compressed cache groups, `copy` plain against speculative
decoding, `prefix` (+ `prefix_prompts`) the shared-prefix cache, and `serve` replays cpu32
against a running server. Each workload is described in `deepinfer.entrypoints.bench`.
"""

from __future__ import annotations

import random

from deepinfer.entrypoints.bench.common import Workload

WORKLOADS = ("cpu32", "decode1", "long", "copy")


def _capped(n: int, max_output_len: int | None) -> int:
    return n if max_output_len is None else min(n, max_output_len)


def make_workload(name: str, vocab_size: int, num_requests: int = 32, seed: int = 0,
                  max_output_len: int | None = None) -> Workload:
    """The workload's token-id prompts and output lengths; `max_output_len` caps the outputs of
    cpu32 and decode1 (the prompts and the other draws stay the same). `copy` needs the model's
    tokenizer: see `workloads.copy.copy_workload`."""
    rng = random.Random(seed)
    if name == "cpu32":
        lens = [(rng.randint(32, 256), rng.randint(32, 256)) for _ in range(num_requests)]
        prompts = [[rng.randrange(100, vocab_size) for _ in range(p)] for p, _ in lens]
        return Workload(name, prompts, [_capped(o, max_output_len) for _, o in lens])
    if name == "decode1":
        return Workload(name, [[rng.randrange(100, vocab_size) for _ in range(8)]], [_capped(128, max_output_len)])
    if name == "long":
        return Workload(name, [[rng.randrange(100, vocab_size) for _ in range(2048)] for _ in range(16)],
                        [256] * 16)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
