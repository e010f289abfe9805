"""A step's picture rows: which packed rows take a picture's encoder output, and those rows.

For every scheduled request, each picture whose placeholder run overlaps its chunk gives the
slice of its run the chunk holds; a chunk may start or end inside a run (chunked prefill, a
prefix hit that ends mid-run), so the slice [lo, hi) of the run's rows is taken:

    prompt      ... | text | <img> <img> <img> <img> <img> | text ...
                           ^offset                  end^
    chunk              [start ............ stop)
    rows taken                [lo ...... hi)     (run-relative: lo = max(offset, start) - offset)
    packed rows        first + (offset + lo - start) ..

The encoder outputs come from the `PictureCache` (encoded once per content hash, the step's
missing pictures in one batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.contracts.multimodal import PictureInput
from deepinfer.worker.picture_cache import PictureCache


def picture_slices(spans: Sequence) -> list[tuple[PictureInput, int, int, int]]:
    """(picture, first packed row, lo, hi) for every run slice the step's chunks hold: rows
    [lo, hi) of the picture's run fill packed rows first .. first + hi - lo."""
    slices = []
    for s, first in spans:
        start, stop = s.start_pos, s.start_pos + s.num_tokens
        for p in s.pictures:
            if p.overlaps(start, stop):
                lo, hi = max(p.offset, start), min(p.end, stop)
                slices.append((p, first + lo - start, lo - p.offset, hi - p.offset))
    return slices


class PictureRows:
    """Builds each step's `picture_rows` for a picture model (`PictureModel`)."""

    def __init__(self, model, device: torch.device, cache: PictureCache | None = None):
        self.model, self.device = model, device
        self.cache = PictureCache() if cache is None else cache

    def build(self, spans: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [P] packed-row indices, embeds [P, hidden]) of the step, None when no chunk holds
        a picture's placeholder."""
        slices = picture_slices(spans)
        if not slices:
            return None
        outputs = self.cache.rows([p for p, *_ in slices], self.model.encode_pictures)
        rows = torch.cat([torch.arange(first, first + hi - lo) for _, first, lo, hi in slices])  # [P]
        embeds = torch.cat([outputs[p.content_hash][lo:hi] for p, _, lo, hi in slices])  # [P, hidden]
        return rows.to(self.device), embeds.to(self.device)
