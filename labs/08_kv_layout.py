"""Lab 08: count KV rows, then bytes; trace ring addresses and overwrite hazards (book ch. 3).

Every number comes from the package's layout functions (deepinfer.model_executor.layers.ops):
the lab only chooses inputs and prints. Defaults reproduce the book; the default ring is the
engine's inference ring for the window under the current DEEPINFER_* environment.

    python labs/08_kv_layout.py
    python labs/08_kv_layout.py --kv-heads 1 --bytes 1
    python labs/08_kv_layout.py --state 3 --positions 134 --drafts 5 --rings 128,134
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labio import emit

from deepinfer.environ import get_environ
from deepinfer.model_executor.layers.ops.cache_common import (
    V41_FORMAT,
    get_inference_swa_block_size,
    kv_payload_bytes,
    row_payload_bytes,
    visible_rows,
    window_kv_payload_bytes,
)
from deepinfer.model_executor.layers.ops.swa_addressing import (
    logical_range,
    overwrite_free_ring_size,
    overwritten_rows_per_query,
    read_index_row,
    read_slot_bounds,
    state_slots,
    write_slot,
)

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results" / "08_kv_layout.txt"
MIB = 1 << 20


def mib(num_bytes):
    """'512 MiB', or two decimals when the bytes are not whole mebibytes."""
    return f"{num_bytes // MIB:,} MiB" if num_bytes % MIB == 0 else f"{num_bytes / MIB:,.2f} MiB"


def generic_block(a):
    full = kv_payload_bytes(a.layers, a.kv_heads, a.head_dim, a.context, a.bytes)
    window = window_kv_payload_bytes(a.layers, a.kv_heads, a.head_dim, a.context, a.window, a.bytes)
    return [f"generic full KV: {full:,} B = {mib(full)}",
            f"generic window KV: {window:,} B = {mib(window)}"]


def swa_row_block(a):
    fmt = V41_FORMAT
    rows = visible_rows(a.context, a.window)
    return [f"SWA row: {fmt.data_bytes} data B + {fmt.scale_bytes} scale B = {fmt.bytes_per_row} B",
            f"{rows} visible rows, one layer: {row_payload_bytes(rows, fmt):,} B",
            f"{a.ring} allocated rows, one layer: {row_payload_bytes(a.ring, fmt):,} B"]


def ring_trace_block(a):
    # Column layout as the book prints it: the range column is one wider than its header.
    lines = ["position | logical range | first/last read slot | write slot"]
    for pos in a.positions:
        first_pos, last_pos = logical_range(pos, a.window)
        first, last = read_slot_bounds(pos, a.state, a.window, a.ring)
        span = f"{first_pos:>3}..{last_pos}"
        slots = f"{first} / {last}"
        lines.append(f"{pos:>8} | {span:<14} | {slots:<20} | {write_slot(a.state, pos, a.ring)}")
    return lines


def overwrite_block(a):
    return [f"S={ring}: overwritten visible rows per query = "
            f"{overwritten_rows_per_query(a.window, ring, a.drafts)}" for ring in a.rings]


def address_problems(a):
    """Check read rows on partial windows, repeated wraps and neighbouring states."""
    problems = []
    own = set(state_slots(a.state, a.ring))
    neighbours = set(state_slots(a.state + 1, a.ring))
    for pos in sorted({0, a.window // 2, *a.positions, 3 * a.ring + a.window // 2, 7 * a.ring}):
        row = read_index_row(pos, a.state, a.window, a.ring)
        first, last = logical_range(pos, a.window)
        valid = [i for i in row if i != -1]
        if valid != [write_slot(a.state, q, a.ring) for q in range(first, last + 1)]:
            problems.append(f"position {pos}: read row is not the window's write slots")
        if row[len(valid):] != [-1] * (a.window - len(valid)):
            problems.append(f"position {pos}: -1 columns are not all after the valid ones")
        if not set(valid) <= own or set(valid) & neighbours:
            problems.append(f"position {pos}: read row leaves state {a.state}'s block")
    return problems


def int_list(text):
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv):
    try:
        env = get_environ()
    except ValueError as e:
        sys.exit(f"08_kv_layout.py: {e}")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=4096, help="tokens in the context (L)")
    p.add_argument("--bytes", type=int, default=2, help="bytes per element")
    p.add_argument("--window", type=int, default=128, help="window size W")
    p.add_argument("--ring", type=int, help="ring size S (default: the engine's inference ring)")
    p.add_argument("--state", type=int, default=2, help="state id b of the traced request")
    p.add_argument("--positions", type=int_list, help="positions to trace (default W-1,W,S-1,S)")
    p.add_argument("--drafts", type=int, default=env.use_nextn_decode, help="draft tokens k per step")
    p.add_argument("--rings", type=int_list, help="rings for the overwrite table (default W,W+k,S)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to save the output")
    a = p.parse_args(argv)
    try:
        a.ring = get_inference_swa_block_size(a.window, env) if a.ring is None else a.ring
        a.positions = a.positions or [a.window - 1, a.window, a.ring - 1, a.ring]
        a.rings = a.rings or [a.window, overwrite_free_ring_size(a.window, a.drafts), a.ring]
    except ValueError as e:
        p.error(str(e))
    return p, a


def main(argv=None):
    parser, a = parse_args(argv)
    try:
        blocks = [generic_block(a), swa_row_block(a), ring_trace_block(a), overwrite_block(a)]
        problems = address_problems(a)
    except ValueError as e:
        parser.error(str(e))
    emit(blocks, a.out)
    for line in problems:
        print(f"ADDRESS CHECK FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
