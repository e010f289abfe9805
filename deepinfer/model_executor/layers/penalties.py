"""Penalties and the logit processing that runs before a draw.

    logits [N, V] --> repetition (HF / vLLM; over prompt + output tokens)
                  --> presence / frequency (OpenAI; over output tokens)
                  --> logit_bias, -inf bans for min_tokens / bad_words (`logits_processors`)

Only the rows that ask are touched, and of a penalty row only its history's entries (gather /
scatter over [P, L] ids), never the whole vocabulary. A step without penalties, bias or bans gets
its logits back unchanged and uncopied. The sampler applies this once per step; the rejection
sampler at each draft position.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.logits_processors import apply_logits_processors
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata, row_subset


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Penalties, then logit_bias, min_tokens and bad_words (`logits_processors`). [N, V]:
    `logits` itself when no row asks for any, else a processed copy."""
    penalized = apply_penalties(logits, metadata)  # [N, V]
    return apply_logits_processors(penalized, metadata, owned=penalized is not logits)  # [N, V]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Returns `logits` itself when no row asks for a penalty, else a penalized copy. [N, V].

    Repetition (HF / vLLM): over prompt + output tokens, positive logits are divided by the
    penalty and negative ones multiplied. Presence / frequency (OpenAI): over output tokens,
    subtract presence * [count > 0] + frequency * count. Only the history's entries are touched
    (gather / scatter over [P, L] ids), never the whole vocabulary.
    """
    rows = metadata.penalty_rows
    if not rows:
        return logits
    sub, index = row_subset(logits, rows)
    sub = sub.clone() if index is None else sub  # [P, V], ours to write
    if metadata.repetition_penalty is not None:
        ids, valid = _history_ids([metadata.prompt_token_ids[i] + metadata.output_token_ids[i]
                                   for i in rows], sub)  # [P, L], [P, L]
        penalty = torch.where(valid[:, :1] > 0, metadata.repetition_penalty, 1.0)  # [P, 1]; 1: empty history
        seen = sub.gather(1, ids)  # [P, L]
        sub.scatter_(1, ids, torch.where(seen > 0, seen / penalty, seen * penalty))  # [P, V]
    if metadata.frequency_penalty is not None:
        ids, valid = _history_ids([metadata.output_token_ids[i] for i in rows], sub)  # [P, L]
        sub.scatter_add_(1, ids, -metadata.frequency_penalty * valid)  # once per occurrence (padding adds 0)
        presence = metadata.presence_penalty  # [P, 1]
        sub.scatter_(1, ids, sub.gather(1, ids) - presence * valid[:, :1])  # once per distinct id
    return sub if index is None else logits.index_copy(0, index, sub)  # [N, V]


def _history_ids(token_lists: list[list[int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids padded to one length -> (ids [n, L] long, valid [n, L] fp32 0 / 1).

    Padding repeats the row's last id, so every entry of a non-empty row names a token of its
    history and a scatter of per-token values writes equal values for duplicates. An empty row
    has one entry, id 0 with valid 0, and the callers leave it unchanged (factor 1 or 0 added).
    Ids outside [0, V) (a tokenizer larger than the logits) are dropped.
    """
    vocab_size = like.shape[1]
    width = max(1, max(len(ids) for ids in token_lists))
    padded = [ids + [ids[-1] if ids else 0] * (width - len(ids)) for ids in token_lists]
    ids = torch.tensor(padded, dtype=torch.long, device=like.device)  # [n, L]
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        return _history_ids([[t for t in row if 0 <= t < vocab_size] for row in token_lists], like)
    lengths = torch.tensor([len(row) for row in token_lists], device=like.device)  # [n]
    valid = torch.arange(width, device=like.device) < lengths[:, None]  # [n, L]
    return ids, valid.float()
