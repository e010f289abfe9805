"""Prompt-lookup drafts (n-gram speculation): no model, just the request's own tokens.

For n = max_n down to min_n, the last n tokens are searched for in the earlier history (prompt and
outputs); at the latest earlier occurrence, the k tokens that followed it are the drafts:

    history:  the cat sat on the mat . the cat sat on
    suffix (n = 3):                            cat sat on
    latest earlier match:  cat sat on  -> followed by "the mat . the" -> drafts (k = 4)

The longest n with a match wins; no match for any n: no drafts. One numpy comparison of the
history's n-grams per tried n.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Drafts up to k tokens from the history's own earlier continuations (see the module)."""

    def __init__(self, k: int, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k (default: self.k) drafts to follow `token_ids`; [] when no suffix recurs."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _latest_match(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest n-gram before the suffix that equals the last n tokens, or None."""
    grams = sliding_window_view(tokens[:-1], n)  # [L - n, n]: every n-gram with a token after it
    hits = np.flatnonzero((grams == tokens[-n:]).all(axis=1))  # [h]
    return int(hits[-1]) if hits.size else None
