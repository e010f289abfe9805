"""Embeddings: a pooling request's vector, from its prompt's final hidden rows, chunk by chunk.

A chunk of an embedding request (`ScheduledRequest.pooling`) hands its rows of the model's final
(normed) hidden states here; the chunk that completes the prompt yields the vector:

    last   the prompt's last row (the final chunk's last row)
    cls    the first row (position 0, in the first chunk)
    mean   the sum of every row / the prompt length, summed in fixed blocks of BLOCK rows aligned to
           absolute positions, so that where the chunks were cut never changes a bit:

    positions   0 ........ 15 | 16 ....... 31 | 32 .. 37          (BLOCK = 16)
    chunk A     [ rows 0..21                ]
    chunk B                        [22 ....... 37]
    block sums  s0 (A)        | s1 (A's 6 pending rows + B's 10) | open block (B's 6)
    total       ((s0 + s1) + open block), each block summed row by row in position order

Then `dimensions` keeps the first values and `normalize` divides by the L2 norm (as
sentence-transformers' Normalize: x / max(|x|, 1e-12)). Sums are float32.

The per-request state is replaced, never changed in place, and the state before a request's latest
chunk is kept beside it: a step the engine re-runs (a fault elsewhere in the batch) finds the chunk
it already pooled and starts it again from there. A chunk at position 0 (a recompute after
preemption) starts afresh. States go with `release` (finished, aborted requests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer.contracts.plan import ScheduledRequest

BLOCK = 16  # rows summed together for mean pooling (a block starts at a multiple of BLOCK)
_EPS = 1e-12  # as torch.nn.functional.normalize


@dataclass(frozen=True)
class _PoolState:
    """What a request's chunks so far left for its pool (position `next_pos` comes next)."""

    next_pos: int
    total: torch.Tensor | None = None  # [H] float32: the sum of the full blocks (mean)
    pending: torch.Tensor | None = None  # [r, H] float32, r < BLOCK: the open block's rows (mean)
    first: torch.Tensor | None = None  # [H] float32: position 0's row (cls)
    last: torch.Tensor | None = None  # [H] float32: the latest row (last)
    previous: _PoolState | None = None  # the state before the latest chunk


class Pooler:
    """Per request: the state of its pool over its chunks so far (see the module)."""

    def __init__(self):
        self._states: dict[str, _PoolState] = {}

    def collect(self, spans: list, hidden: torch.Tensor) -> dict[str, list[float]]:
        """spans: (ScheduledRequest, first packed row) of the step; hidden [T, H]. Pools each
        embedding request's chunk; returns the vector of each whose prompt this step completed.
        Nothing is kept unless every request's chunk pooled."""
        states, done = {}, {}
        for s, start in spans:
            if s.pooling is None or s.verify:
                continue
            state = _advance(self._state_before(s), hidden[start:start + s.num_tokens], s.pooling.pooling_type)
            states[s.request_id] = state
            if state.next_pos == len(s.prompt_token_ids):
                done[s.request_id] = finish(state, s.pooling.pooling_type, s.pooling.dimensions,
                                            bool(s.pooling.normalize)).tolist()
        self._states.update(states)
        return done

    def _state_before(self, s: ScheduledRequest) -> _PoolState:
        if s.start_pos == 0:
            return _PoolState(0)
        state = self._states.get(s.request_id)
        if state is not None and state.next_pos != s.start_pos and state.previous is not None:
            state = state.previous  # the step that pooled this chunk is run again
        if state is None or state.next_pos != s.start_pos:
            where = "none" if state is None else f"position {state.next_pos}"
            raise RuntimeError(f"request {s.request_id!r}: its embedding chunk starts at position "
                               f"{s.start_pos}, but its pool holds {where}")
        return state

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)


def _advance(state: _PoolState, rows: torch.Tensor, pooling_type: str) -> _PoolState:
    """The state after the chunk `rows` [n, H] (positions state.next_pos ..); rows kept are copies
    (a view would hold the step's whole hidden tensor)."""
    rows = rows.float()  # [n, H]
    end, before = state.next_pos + rows.shape[0], replace(state, previous=None)
    if pooling_type == "last":
        return _PoolState(end, last=rows[-1].clone(), previous=before)
    if pooling_type == "cls":
        return _PoolState(end, first=rows[0].clone() if state.next_pos == 0 else state.first, previous=before)
    total, pending = add_blocks(state.total, state.pending, rows)
    return _PoolState(end, total=total, pending=pending.clone(), previous=before)


def add_blocks(total: torch.Tensor | None, pending: torch.Tensor | None, rows: torch.Tensor
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fold rows [n, H] (following `pending` [r, H], which starts on a block boundary) into the
    running `total` [H] of full blocks; returns (total, the rows of the new open block [r', H])."""
    rows = rows if pending is None else torch.cat([pending, rows])  # [r + n, H]
    num_full = rows.shape[0] // BLOCK * BLOCK
    if num_full:
        for block_sum in _block_sums(rows[:num_full].view(-1, BLOCK, rows.shape[1])):  # [H] each
            total = block_sum if total is None else total + block_sum
    return total, rows[num_full:]


def _block_sums(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [k, BLOCK, H] -> their sums [k, H], row by row in position order (elementwise adds:
    the same bits whatever k is)."""
    sums = blocks[:, 0]  # [k, H]
    for j in range(1, blocks.shape[1]):
        sums = sums + blocks[:, j]  # [k, H]
    return sums


def finish(state: _PoolState, pooling_type: str, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """The request's vector [D] (float32) from its completed state."""
    if pooling_type == "last":
        vector = state.last  # [H]
    elif pooling_type == "cls":
        vector = state.first  # [H]
    else:
        total = state.total
        if state.pending is not None and state.pending.shape[0]:
            open_sum = _block_sums(state.pending[None])[0]  # [H]
            total = open_sum if total is None else total + open_sum
        vector = total / state.next_pos  # [H]
    if dimensions is not None:
        vector = vector[:dimensions]  # [D]
    if normalize:
        vector = vector / vector.norm().clamp_min(_EPS)  # [D]
    return vector
