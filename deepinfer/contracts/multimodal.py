"""Pictures in a request: what the serving layer hands the engine, and the engine the worker.

A picture enters a prompt as a run of placeholder tokens (how many: the checkpoint's processor
says). The model computes the run's rows from the picture's encoder output instead of the token
embedding, so the tokens alone no longer identify the input (seed 004: a prefix is shared only
for identical inputs). Every picture therefore carries a content hash, and

- the prefix cache's unit keys mix in the hash and the run's place of every picture whose run a
  unit holds (`engine/prefix_cache.py`): two different pictures never share blocks, the same
  picture in a later request does;
- the worker keeps encoder outputs by content hash (bounded, least recently used first), so a
  picture is encoded once however many chunks or requests read it.

This floor imports neither torch nor numpy: `tensors` are the processor's arrays, passed through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class PictureInput:
    """One picture of a request, processed for its model.

    content_hash: hex digest of the decoded picture (mode, size and pixels): its identity for the
        prefix cache and the encoder-output cache;
    offset: index in the prompt of the first placeholder token of its run;
    length: the run's placeholder tokens (the rows its encoder output fills, in order);
    tensors: the processor's inputs to the vision encoder for this picture alone (e.g.
        `pixel_values`, `image_grid_thw`), as numpy arrays or tensors; read only by the model.
    """

    content_hash: str
    offset: int
    length: int
    tensors: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        """The prompt index one past its run."""
        return self.offset + self.length

    def overlaps(self, start: int, stop: int) -> bool:
        """Whether its run shares a position with prompt positions [start, stop)."""
        return self.offset < stop and start < self.end


def check_pictures(pictures: tuple[PictureInput, ...], prompt_len: int) -> None:
    """ValueError naming the picture unless every run lies inside the prompt, in order, disjoint."""
    previous_end = 0
    for i, p in enumerate(pictures):
        if p.length <= 0 or p.offset < previous_end or p.end > prompt_len:
            raise ValueError(f"pictures[{i}]: placeholder run [{p.offset}, {p.end}) must be non-empty, "
                             f"after the previous picture's (ends at {previous_end}) and inside the "
                             f"prompt of {prompt_len} tokens")
        previous_end = p.end
