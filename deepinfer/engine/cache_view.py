"""A plain-data picture of the cache for the server's dashboard: the running requests, and one
request's block tables and rings (book §3.4: a block table, and a ring of S = W + backtracking
rows). Pure Python; built on the engine thread from the scheduler and the KV cache manager, then
read by other threads as it is (nothing in it refers back to engine objects). Block ids and
positions only: no token ids, no text.

A ring of S rows holding the positions 0 .. n-1 written so far (n = num_computed_tokens):

    row r:     0    1    2    3    4          S = 5, W = 3, n = 7 (positions 0..6 written)
    holds:     5    6    2    3    4          row r holds the last p < n with p mod S == r
    state:    win  win  old  old  win         the window of the latest query (position 6):
                                              positions max(0, n - W) .. n - 1 = 4, 5, 6

Row r of state slot b is flattened slot b*S + r (`kv_allocator`); "old" rows left the window
and wait to be overwritten (S > W: eviction and overwrite are different events).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping


def ring_rows(num_written: int, ring_size: int) -> list[int]:
    """Per ring row r, the position it holds after positions 0 .. num_written-1 were written
    (the last p < num_written with p % ring_size == r), or -1 if none has reached it yet."""
    last = num_written - 1
    return [r + (last - r) // ring_size * ring_size if r <= last else -1 for r in range(ring_size)]


def ring_picture(name: str, state_id: int, ring_size: int, window: int, num_written: int) -> dict:
    """One ring group's rows for a request holding `state_id` with `num_written` positions computed:
    which position each row holds, and the window of its latest query."""
    return {"group": name, "state_id": state_id, "ring_size": ring_size, "window": window,
            "num_written": num_written, "first_slot": state_id * ring_size,
            "window_start": max(0, num_written - window), "rows": ring_rows(num_written, ring_size)}


def paged_picture(spec, table: list[tuple[int, bool]], num_cached_tokens: int) -> dict:
    """One paged group's block table: block ids, which are registered in the prefix cache
    (`cached`), and how many leading blocks came from a prefix hit at admission."""
    return {"group": spec.name, "block_size": spec.block_size, "compress_ratio": spec.compress_ratio,
            "tokens_per_block": spec.tokens_per_block, "block_ids": [b for b, _ in table],
            "cached": [c for _, c in table],
            "num_hit_blocks": min(len(table), num_cached_tokens // spec.tokens_per_block)}


def request_picture(kv, req, windows: Mapping[str, int]) -> dict | None:
    """The request's block tables (per paged group) and rings (per ring group of `windows`:
    group name -> W); None when it holds no cache."""
    tables = kv.block_view(req.request_id)
    if tables is None:
        return None
    hit = req.num_cached_tokens or 0
    rings = [ring_picture(spec.name, state_id, spec.ring_size, windows.get(spec.name, spec.ring_size),
                          req.num_computed_tokens)
             for spec, state_id in zip(kv.ring_specs, kv.state_ids(req.request_id), strict=True)]
    return {**request_summary(req),
            "paged": [paged_picture(s, t, hit) for s, t in zip(kv.paged_specs, tables, strict=True)],
            "rings": rings}


def request_summary(req) -> dict:
    """A running request's progress, and `owner`: the client it counts for (its tenant, with API keys)."""
    return {"request_id": req.request_id, "num_prompt_tokens": req.num_prompt_tokens,
            "num_tokens": req.num_tokens, "num_computed_tokens": req.num_computed_tokens,
            "num_cached_tokens": req.num_cached_tokens or 0, "owner": req.client_id}


def cache_snapshot(running: Iterable, kv, windows: Mapping[str, int], selected: str | None = None,
                   visible: Callable[[str | None], bool] = lambda owner: True) -> dict:
    """The running requests (oldest first) and the picture of `selected` if it runs, else of the
    oldest running one (`request` None when nothing runs); the picture is only of a request whose
    owner is `visible`."""
    reqs = sorted(running, key=lambda r: r.arrival_time)
    shown = [r for r in reqs if visible(r.client_id)]
    chosen = next((r for r in shown if r.request_id == selected), shown[0] if shown else None)
    return {"running": [request_summary(r) for r in reqs],
            "request": request_picture(kv, chosen, windows) if chosen is not None else None}
