"""Encoder outputs of pictures, kept by content hash (bounded, least recently used first).

A picture is encoded once however many prefill chunks read its run, however many requests show
it, and when a preempted request recomputes: `PictureCache.rows` returns the cached output, and
encodes only the pictures it lacks, in one call to the model's `encode_pictures`.

    content_hash -> [length, hidden]     at most `max_entries` entries and `max_bytes` bytes;
                                         the least recently read one goes first
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from deepinfer.contracts.multimodal import PictureInput

DEFAULT_MAX_ENTRIES = 64
DEFAULT_MAX_BYTES = 1 << 30


class PictureCache:
    """Encoder outputs by content hash, LRU-bounded by entries and bytes."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._outputs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # pictures encoded since start (a hit encodes none)

    def __len__(self) -> int:
        return len(self._outputs)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._outputs

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._outputs.values())

    def rows(self, pictures: Sequence[PictureInput],
             encode: Callable[[list[PictureInput]], list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """content hash -> encoder output [length, hidden] of every picture in `pictures`: cached
        ones as they are, the others from one `encode(missing)` call (then cached). The result
        holds its tensors even when the bound evicts them from the cache."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, PictureInput] = {}
        for p in pictures:
            if p.content_hash in self._outputs:
                self._outputs.move_to_end(p.content_hash)
                found[p.content_hash] = self._outputs[p.content_hash]
            else:
                missing.setdefault(p.content_hash, p)
        if missing:
            found.update(self._encode(list(missing.values()), encode))
        return found

    def _encode(self, pictures: list[PictureInput], encode) -> dict[str, torch.Tensor]:
        outputs = encode(pictures)
        if len(outputs) != len(pictures):
            raise ValueError(f"encode_pictures returned {len(outputs)} outputs for {len(pictures)} pictures")
        made = {}
        for p, out in zip(pictures, outputs, strict=True):
            if out.shape[0] != p.length:
                raise ValueError(f"picture {p.content_hash[:12]}: the encoder gave {out.shape[0]} rows for "
                                 f"a placeholder run of length {p.length}")
            made[p.content_hash] = self._outputs[p.content_hash] = out
        self.num_encoded += len(pictures)
        self._evict()
        return made

    def _evict(self) -> None:
        """Drop the least recently read entries past either bound."""
        while len(self._outputs) > self.max_entries or (len(self._outputs) > 1 and self.num_bytes > self.max_bytes):
            self._outputs.popitem(last=False)
