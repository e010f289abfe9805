"""M-RoPE: three position rows (time, row, column) per token, and the rotary that reads them.

Positions of one request (HF's `get_rope_index`, images only). Text tokens have the three rows
equal and count on from the text before them; a picture's run of t*H'*W' placeholders (H', W':
its patch grid after the 2x2 merge) takes (s + frame, s + row, s + col) where s is the position
the run starts at, and the text after it resumes at s + max(H', W'):

    prompt index   0 1 2 | 3 4 5 6 7 8 (a 2x3 picture) | 9 10
    time           0 1 2 | 3 3 3 3 3 3                 | 6  7
    row            0 1 2 | 3 3 3 4 4 4                 | 6  7
    col            0 1 2 | 3 4 5 3 4 5                 | 6  7

So every token after a picture is shifted by max(H', W') - t*H'*W' (<= 0), summed over the
pictures before it; generated tokens (index >= the prompt's length) carry the whole sum, HF's
`rope_deltas`. The rows never exceed the token's index: the cos/sin tables of `max_positions`
rows suffice.

`mrope_section` = (s_t, s_h, s_w), summing to head_dim/2: frequency i of the rotate-half layout
rotates by the time row for i < s_t, the row position for the next s_h, the column for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.model_executor.layers.rotary import RotaryEmbedding, _rotate


@dataclass(frozen=True)
class PictureGrid:
    """A picture's placeholder run in its prompt and its token grid after the merge."""

    offset: int  # prompt index of its first placeholder
    t: int
    h: int  # rows of merged groups (H')
    w: int  # columns of merged groups (W')

    @property
    def length(self) -> int:
        return self.t * self.h * self.w

    @property
    def advance(self) -> int:
        """How far the position moves over the run (HF: max(H', W'))."""
        return max(self.h, self.w)


def mrope_positions(pictures: Sequence[PictureGrid], start: int, count: int) -> torch.Tensor:
    """Rope positions [3, count] of token indices start .. start+count-1 of one request (prompt or
    generated: an index past the prompt is text). `pictures` in prompt order, runs disjoint."""
    index = torch.arange(start, start + count)  # [count]
    pos = index.expand(3, count).clone()  # [3, count] text: its index, shifted below
    shift = 0  # the position of index i after the pictures before it is i + shift
    for p in pictures:
        inside = (index >= p.offset) & (index < p.offset + p.length)  # [count]
        if bool(inside.any()):
            k = index[inside] - p.offset  # [n] place in the run
            base = p.offset + shift
            pos[:, inside] = torch.stack((base + k // (p.h * p.w), base + k // p.w % p.h, base + k % p.w))  # [3, n]
        shift += p.advance - p.length
        pos[:, index >= p.offset + p.length] += p.advance - p.length
    return pos  # [3, count]


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE at positions [T] (text only: as RotaryEmbedding) or [3, T] (M-RoPE by `mrope_section`)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, mrope_section: Sequence[int],
                 scaling: float = 1.0):
        super().__init__(inv_freq, max_positions, scaling)
        half = inv_freq.shape[0]
        if sum(mrope_section) != half or len(mrope_section) != 3:
            raise ValueError(f"rope_parameters.mrope_section={list(mrope_section)} must be 3 sizes summing to "
                             f"head_dim/2 = {half}")
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section)))  # [D/2]
        self.register_buffer("row_of_dim", torch.cat((rows, rows)), persistent=False)  # [D]
        self._last_m: tuple | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        cos, sin = self.mrope_cos_sin(positions, q.dtype)  # [T, 1, D] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def mrope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, 1, D]: dim d at positions[row_of_dim[d]]; one lookup per step for all layers."""
        last = self._last_m
        if last is None or last[0] is not positions or last[1].dtype != dtype:
            index = positions[self.row_of_dim].T  # [T, D]
            cos = self.cos.gather(0, index).unsqueeze(1).to(dtype)  # [T, 1, D]
            sin = self.sin.gather(0, index).unsqueeze(1).to(dtype)  # [T, 1, D]
            self._last_m = last = (positions, cos, sin)
        return last[1], last[2]
