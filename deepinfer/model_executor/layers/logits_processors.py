"""Per-request logits processing beyond penalties: logit_bias, min_tokens and bad_words.

    logits [N, V] --(penalties)--> + logit_bias[id]            (rows with a bias)
                                   -inf at stop ids + EOS        (rows with fewer than min_tokens outputs)
                                   -inf at a bad word's last id  (rows whose output tail is that word's
                                                                  other tokens; one-token words always)

Only the rows that ask for one of these are touched, through one scatter per kind over the
(row, token id) pairs gathered in Python (a loop over rows and their few ids, never over the
vocabulary). Every decision depends on the row's own output history: a verification row that
sees drafts 1..i as outputs is processed as plain decoding would process that position.
Banned tokens get -inf here; the sampler gives them weight 0 (see `drop_banned`).
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata, device_tensor
from deepinfer.sampling_params import SamplingParams, check_token_ids_in_vocab


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata, owned: bool) -> torch.Tensor:
    """logits [N, V] -> the same with bias and bans applied to `metadata.processor_rows`.

    Writes in place when `owned` (the caller's own copy), else into a copy; returns `logits`
    untouched when no row asks. Raises ValueError for a logit_bias id outside the vocabulary.
    """
    rows = metadata.processor_rows
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    bias_pairs: list[tuple[int, int, float]] = []
    ban_pairs: list[tuple[int, int]] = []
    for i in rows:
        params = metadata.params[i]
        check_token_ids_in_vocab(params, vocab_size)
        bias_pairs.extend((i, t, b) for t, b in params.logit_bias.items())
        ban_pairs.extend((i, t) for t in banned_token_ids(params, metadata.output_token_ids[i]) if t < vocab_size)
    if not bias_pairs and not ban_pairs:
        return logits
    out = logits if owned else logits.clone()  # [N, V]
    if bias_pairs:
        rows_t, ids_t, values = _pairs_to_tensors(bias_pairs, logits.device)
        out.index_put_((rows_t, ids_t), values, accumulate=True)  # [N, V]
    if ban_pairs:
        rows_t, ids_t, _ = _pairs_to_tensors([(i, t, 0.0) for i, t in ban_pairs], logits.device)
        out.index_put_((rows_t, ids_t), torch.full((), float("-inf"), device=logits.device))  # [N, V]
    return out


def banned_token_ids(params: SamplingParams, output_token_ids: list[int]) -> set[int]:
    """The ids this row may not emit next: stop ids and EOS while fewer than min_tokens outputs
    exist, and the last token of each bad word whose other tokens end the output."""
    banned = set(params.all_stop_token_ids) if len(output_token_ids) < params.min_tokens else set()
    for word in params._bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            banned.add(word[-1])
    return banned


def drop_banned(weights: torch.Tensor, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """weights [R, V] (sampling weights of logits [R, V]) with every -inf logit's weight set to
    exactly 0: the sampler floors exponents (a -inf logit would keep e^-80). In place; a no-op
    when no row bans a token."""
    if metadata.any_ban:
        weights.masked_fill_(logits == float("-inf"), 0.0)  # [R, V]
    return weights


def _pairs_to_tensors(pairs: list[tuple[int, int, float]], device) -> tuple[torch.Tensor, ...]:
    """[(row, id, value)] -> rows [n] long, ids [n] long, values [n] fp32."""
    rows, ids, values = zip(*pairs, strict=True)
    return (device_tensor(rows, torch.long, device), device_tensor(ids, torch.long, device),
            device_tensor(values, torch.float32, device))
