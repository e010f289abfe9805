"""One host-to-device copy for all of a step's small index tensors.

A step's inputs are a few dozen small int64 tensors (ids, positions, slots, index rows). Copied
one by one, each is its own transfer; here they travel together:

    host    [ ids | positions | g0.store_slots | g0.decode_index | seg0.load_slots | ... ]   int64, pinned
              |  one non_blocking copy
    device  [ ids | positions | g0.store_slots | g0.decode_index | seg0.load_slots | ... ]
              each input comes back as a view (its offset, its shape) of this one buffer

Absent fields (None) stay None. A pinned host buffer lets the copy run asynchronously: the host
never waits for it, and the caching host allocator keeps the buffer until the copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedTensors:
    """Tensors laid end to end in one flat buffer; `shapes[i]` None marks an absent input."""

    buffer: torch.Tensor  # [total] int64
    shapes: list[torch.Size | None]


def pack(tensors: Sequence[torch.Tensor | None], pin: bool = False) -> PackedTensors:
    """Copy `tensors` (int64, any device, None allowed) into one flat host buffer (pinned when
    `pin`). Raises TypeError for another dtype: one buffer holds one dtype."""
    present = [t for t in tensors if t is not None]
    for t in present:
        if t.dtype != torch.int64:
            raise TypeError(f"a packed step input must be int64, got {t.dtype} of shape {tuple(t.shape)}")
    total = sum(t.numel() for t in present)
    buffer = torch.empty(total, dtype=torch.int64, pin_memory=pin)  # [total]
    if present:
        torch.cat([t.reshape(-1).cpu() for t in present], out=buffer)  # [total]
    return PackedTensors(buffer, [None if t is None else t.shape for t in tensors])


def unpack(packed: PackedTensors, buffer: torch.Tensor) -> list[torch.Tensor | None]:
    """The packed inputs as views of `buffer` (the packed buffer or a copy of it), in order."""
    out, offset = [], 0
    for shape in packed.shapes:
        if shape is None:
            out.append(None)
            continue
        n = shape.numel()
        out.append(buffer[offset:offset + n].view(shape))  # [*shape]
        offset += n
    return out


def transfer(tensors: Sequence[torch.Tensor | None], device: torch.device | str,
             force: bool = False) -> list[torch.Tensor | None]:
    """`tensors` on `device` through one copy: packed (pinned for a CUDA target), copied with
    non_blocking=True, returned as views of the one device buffer. Without `force`, tensors that
    are all on `device` already come back as they are; with it they are packed even then (on the
    CPU the views share the host buffer)."""
    device = torch.device(device)
    if not force and all(t is None or _is_on(t, device) for t in tensors):
        return list(tensors)
    packed = pack(tensors, pin=device.type == "cuda")
    return unpack(packed, packed.buffer.to(device, non_blocking=True))  # [total] on the device


def _is_on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device` ("cuda" without an index: any CUDA device)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)
