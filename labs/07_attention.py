"""Lab 07: what caching keys and values saves, and what a window changes (book chapter 3).

Five two-number inputs each yield a query, a key and a value. The lab computes causal
attention twice: by recomputing every growing prefix from scratch, and incrementally while
keeping keys and values. Every output of every prefix must agree within 1e-12 (absolute and
relative); otherwise the lab exits with status 1.

    python labs/07_attention.py              # the table, full attention, window=3
    python labs/07_attention.py --window 1   # one run; a window >= 5 equals full attention

Self-contained on purpose: plain Python, no package import.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from labio import emit

INPUTS = [(1, 0), (0, 1), (1, 1), (2, 0), (0, 2)]
TOLERANCE = 1e-12
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results" / "07_attention.txt"


def project(x):
    """One input row -> (query, key, value). The query is the input itself."""
    a, b = x
    query = (a, b)
    key = (a - b, a + b)
    value = (a + 2 * b, 2 * a - b)
    return query, key, value


def attend(query, keys, values):
    """softmax(q·k / sqrt(d)) over the given keys, mixing the matching value rows."""
    scale = 1.0 / math.sqrt(len(query))
    scores = [scale * sum(q * k for q, k in zip(query, key, strict=True)) for key in keys]
    top = max(scores)  # subtract the maximum: same ratios, largest exponent is zero
    masses = [math.exp(s - top) for s in scores]
    norm = sum(masses)
    width = len(values[0])
    return tuple(sum(m * v[d] for m, v in zip(masses, values, strict=True)) / norm for d in range(width))


def visible(i, window):
    """First position query i may read: 0 for full attention, else max(0, i - window + 1)."""
    return 0 if window is None else max(0, i - window + 1)


def recompute(prefix, window):
    """Project every row of `prefix` and compute every causal output: (outputs, rows, pairs)."""
    rows = [project(x) for x in prefix]
    outputs, pairs = [], 0
    for i, (query, _, _) in enumerate(rows):
        seen = rows[visible(i, window): i + 1]
        outputs.append(attend(query, [r[1] for r in seen], [r[2] for r in seen]))
        pairs += len(seen)
    return outputs, len(rows), pairs


def incremental(xs, window):
    """Project each row once, keep (at most `window`) keys and values: (outputs, pairs, kept)."""
    kept_keys, kept_values, outputs, pairs = [], [], [], 0
    for x in xs:
        query, key, value = project(x)
        kept_keys.append(key)
        kept_values.append(value)
        if window is not None and len(kept_keys) > window:
            del kept_keys[0], kept_values[0]
        outputs.append(attend(query, kept_keys, kept_values))
        pairs += len(kept_keys)
    return outputs, pairs, len(kept_keys)


def mismatches(cached, recomputed_prefix, n):
    """Describe every output of prefix length n that differs beyond TOLERANCE."""
    bad = []
    for i, (got, want) in enumerate(zip(cached[:n], recomputed_prefix, strict=True)):
        for d, (g, w) in enumerate(zip(got, want, strict=True)):
            if not math.isclose(g, w, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
                bad.append(f"prefix {n}, position {i}, entry {d}: cached {g!r} vs recomputed {w!r}")
    return bad


def experiment(xs, window):
    """Compare both algorithms on every prefix; return (report lines, mismatch descriptions)."""
    cached, cache_pairs, kept = incremental(xs, window)
    rows = pairs = 0
    bad = []
    for n in range(1, len(xs) + 1):
        outputs, n_rows, n_pairs = recompute(xs[:n], window)
        rows, pairs = rows + n_rows, pairs + n_pairs
        bad += mismatches(cached, outputs, n)
    label = "full" if window is None else f"window={window}"
    verdict = "match every recomputed prefix" if not bad else "DIFFER from recomputed prefixes"
    lines = [
        f"{label}: cached outputs {verdict}",
        f"projected rows: recompute={rows}, cache={len(xs)}",
        f"query/key pairs: recompute={pairs}, cache={cache_pairs}",
        f"retained KV rows: {kept}",
        "last output: " + ", ".join(f"{v:.6f}" for v in cached[-1]),
    ]
    return lines, bad


def table(xs):
    """The position / query / key / value table."""
    lines = ["position | input = query | key     | value"]
    for i, x in enumerate(xs):
        query, key, value = project(x)
        lines.append(f"{i:>8} | {str(query):<13} | {str(key):<7} | {value}")
    return lines


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--window must be >= 1, got {value}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=positive_int, help="run one window of this size only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to save the output")
    args = parser.parse_args(argv)
    if args.window is None:
        blocks = [(table(INPUTS), [])] + [experiment(INPUTS, w) for w in (None, 3)]
    else:
        blocks = [experiment(INPUTS, args.window)]
    emit([lines for lines, _ in blocks], args.out)
    bad = [b for _, errors in blocks for b in errors]
    for line in bad:
        print(f"MISMATCH {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
