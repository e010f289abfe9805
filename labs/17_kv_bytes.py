"""Lab 17: the KV payload of a cached prefix, 2 · layers · kv_heads · head_dim · tokens · bytes.

The worked example of the KV-reuse section: 2 layers, 1 KV head, head width 4, 3 tokens and
2 bytes per element give 96 bytes. The number comes from the package's payload formula; the
lab only chooses inputs and prints. The formula excludes batching, allocator blocks, alignment
and runtime workspace.

    python labs/17_kv_bytes.py
    python labs/17_kv_bytes.py --tokens 4096 --layers 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labio import emit

from deepinfer.model_executor.layers.ops.cache_common import kv_payload_bytes

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results" / "17_kv_bytes.txt"


def report(a):
    per_token = kv_payload_bytes(a.layers, a.kv_heads, a.head_dim, 1, a.bytes)
    total = kv_payload_bytes(a.layers, a.kv_heads, a.head_dim, a.tokens, a.bytes)
    return [
        f"inputs: layers={a.layers}, kv_heads={a.kv_heads}, head_dim={a.head_dim}, "
        f"tokens={a.tokens}, bytes={a.bytes}",
        f"KV payload per token (K and V, all layers): {per_token:,} B",
        f"KV payload of {a.tokens:,} tokens: {total:,} B",
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=4)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--bytes", type=int, default=2, help="bytes per element")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to save the output")
    a = p.parse_args(argv)
    try:
        lines = report(a)
    except ValueError as e:
        p.error(str(e))
    emit([lines], a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
