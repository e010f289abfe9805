"""StepPlan -> packed input tensors and attention metadata (decode rows first, then segments)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model_executor.layers.attention.backend import AttentionMetadata, PrefillSegment


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_rows: list  # the ScheduledRequests that sample, in logits-row order
    sample_index: torch.Tensor  # [N] row of each one's last token on the packed axis


def _is_decode(s) -> bool:
    return s.num_tokens == 1 and s.start_pos > 0


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position: block_table[p // bs] * bs + p % bs."""
    return block_table[positions // block_size] * block_size + positions % block_size


def _block_table_matrix(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)  # [B, max_blocks]


def _decode_metadata(decodes, block_size: int):
    """slot_mapping [B] and read index rows [B, L_max] (-1 past each query's length)."""
    tables = _block_table_matrix([s.block_ids[0] for s in decodes])  # [B, W]
    pos = torch.tensor([s.start_pos for s in decodes], dtype=torch.long)  # [B]
    cols = torch.arange(int(pos.max()) + 1, dtype=torch.long)  # [L]
    index = tables.gather(1, (cols // block_size).expand(len(decodes), -1)) * block_size + cols % block_size
    index = index.masked_fill(cols[None, :] > pos[:, None], -1)  # [B, L]
    slots = index.gather(1, pos[:, None]).squeeze(1)  # [B]
    return pos, slots, index


def _segment(s, token_start: int, block_size: int):
    table = torch.tensor(s.block_ids[0], dtype=torch.long)
    positions = torch.arange(s.start_pos, s.start_pos + s.num_tokens, dtype=torch.long)  # [n]
    old_positions = torch.arange(s.start_pos, dtype=torch.long)  # [start]
    seg = PrefillSegment(token_start, token_start + s.num_tokens, s.start_pos,
                         load_index=slots_of(table, old_positions, block_size),
                         load_positions=old_positions)
    return seg, positions, slots_of(table, positions, block_size)


def build_step_inputs(plan, block_size: int, device: torch.device) -> StepInputs:
    decodes = [s for s in plan.scheduled if _is_decode(s)]
    others = [s for s in plan.scheduled if not _is_decode(s)]
    ids, pos_parts, slot_parts, segments, ends = [], [], [], [], []
    decode_index = None
    if decodes:
        pos, slots, decode_index = _decode_metadata(decodes, block_size)
        ids += [s.token_ids[0] for s in decodes]
        pos_parts.append(pos)
        slot_parts.append(slots)
        ends += list(range(1, len(decodes) + 1))
    offset = len(decodes)
    for s in others:
        seg, positions, slots = _segment(s, offset, block_size)
        ids += s.token_ids
        pos_parts.append(positions)
        slot_parts.append(slots)
        segments.append(seg)
        offset += s.num_tokens
        ends.append(offset)
    return _finish(decodes + others, ids, pos_parts, slot_parts, segments, decode_index, ends, device)


def _finish(ordered, ids, pos_parts, slot_parts, segments, decode_index, ends, device) -> StepInputs:
    to = lambda t: t.to(device, non_blocking=True)
    for seg in segments:
        seg.load_index, seg.load_positions = to(seg.load_index), to(seg.load_positions)
    positions = to(torch.cat(pos_parts))
    md = AttentionMetadata(slot_mapping=to(torch.cat(slot_parts)), positions=positions,
                           num_decode_tokens=sum(1 for s in ordered if _is_decode(s)),
                           decode_kv_index=None if decode_index is None else to(decode_index),
                           prefills=segments)
    rows = [(s, end - 1) for s, end in zip(ordered, ends, strict=True) if s.do_sample]
    return StepInputs(input_ids=to(torch.tensor(ids, dtype=torch.long)), positions=positions,
                      attn_metadata=md, sample_rows=[s for s, _ in rows],
                      sample_index=to(torch.tensor([i for _, i in rows], dtype=torch.long)))
