"""Decode metadata and read-index rows for ring (sliding-window) groups: the torch reference.

Vectorized forms of the scalar semantics in swa_addressing.py (book listings 3.9 and 3.10),
one entry per query. A Triton kernel with the same contract can replace each function.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.model_executor.layers.ops.addressing import ring_read_index, ring_slot


class DecodeMetadataBatch(NamedTuple):
    swa_len: torch.Tensor  # [N] rows each query reads: min(pos + 1, W)
    window_start: torch.Tensor  # [N] first logical position read
    offset: torch.Tensor  # [N] flat slot of window_start
    write_slot: torch.Tensor  # [N] flat slot each query's own row goes to


def prepare_decode_metadata(positions: torch.Tensor, state_ids: torch.Tensor, window_size: int,
                            swa_block_size: int) -> DecodeMetadataBatch:
    """positions, state_ids [N] -> per-query read bounds and write slot (listing 3.9)."""
    swa_len = torch.clamp(positions + 1, max=window_size)  # [N]
    start = positions - swa_len + 1  # [N]
    return DecodeMetadataBatch(swa_len, start, ring_slot(state_ids, start, swa_block_size),
                               ring_slot(state_ids, positions, swa_block_size))


def get_kv_index(offset: torch.Tensor, length: torch.Tensor, window_size: int,
                 swa_block_size: int) -> torch.Tensor:
    """(offset, length) [N] -> read indices [N, W]: wrap inside the state's block, -1 past length.

        column c:  base + (offset + c) mod S   if c < length      base = offset // S * S
                   -1                           otherwise
    """
    return ring_read_index(offset, length, window_size, swa_block_size)  # [N, W]
