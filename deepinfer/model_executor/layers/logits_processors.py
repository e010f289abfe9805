"""Per-request logits processing beyond penalties: logit_bias, min_tokens and bad_words.

    logits [N, V] --(penalties)--> + logit_bias[id]            (rows with a bias)
                                   -inf at stop ids + EOS        (rows with fewer than min_tokens outputs)
                                   -inf at a bad word's last id  (rows whose output tail is that word's
                                                                  other tokens; one-token words always)

Only the rows that ask for one of these are touched, through one scatter per kind. The per-step
Python work of a row does not grow with its lists: its logit_bias becomes (ids, values) tensors
once per request, and its bad words an index by prefix length, then by prefix (`BadWordsIndex`),
so a step looks up one output tail per distinct prefix length, never scans the words. Every
decision depends on the row's own output history: a verification row that sees drafts 1..i as
outputs is processed as plain decoding would process that position.
Banned tokens get -inf here; the sampler gives them weight 0 (see `drop_banned`). A
structured-output row whose grammar mask and bans leave no token raises StructuredOutputError
(its request alone fails).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata, device_tensor
from deepinfer.sampling_params import SamplingParams, check_token_ids_in_vocab
from deepinfer.structured_output import StructuredOutputError


class BadWordsIndex:
    """A request's bad-word tokenizations by prefix: `always` (one-token words) and, per prefix
    length L >= 1, {the L tokens before the last: the last tokens they ban}."""

    def __init__(self, words: tuple[tuple[int, ...], ...]):
        self.words = words  # the tuple indexed (identity tells a stale index)
        self.always: set[int] = set()
        self.by_length: dict[int, dict[tuple[int, ...], set[int]]] = {}
        for word in words:
            if len(word) == 1:
                self.always.add(word[0])
            elif word:
                self.by_length.setdefault(len(word) - 1, {}).setdefault(word[:-1], set()).add(word[-1])

    def banned(self, output_token_ids: Sequence[int]) -> set[int]:
        """The last tokens of the words whose other tokens end `output_token_ids`."""
        found = set(self.always)
        num_outputs = len(output_token_ids)
        for length, by_prefix in self.by_length.items():
            if length <= num_outputs:
                found.update(by_prefix.get(tuple(output_token_ids[num_outputs - length:]), ()))
        return found


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata, owned: bool) -> torch.Tensor:
    """logits [N, V] -> the same with bias and bans applied to `metadata.processor_rows`.

    Writes in place when `owned` (the caller's own copy), else into a copy; returns `logits`
    untouched when no row asks. Raises ValueError for a logit_bias id outside the vocabulary,
    StructuredOutputError for a structured-output row left with no token.
    """
    rows = metadata.processor_rows
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    biased: list[int] = []
    ban_pairs: list[tuple[int, int]] = []
    for i in rows:
        params = metadata.params[i]
        if params.logit_bias:
            biased.append(i)
        ban_pairs.extend((i, t) for t in banned_token_ids(params, metadata.output_token_ids[i]) if t < vocab_size)
    if not biased and not ban_pairs:
        return logits
    out = logits if owned else logits.clone()  # [N, V]
    if biased:
        rows_t, ids_t, values = _bias_tensors([metadata.params[i] for i in biased], biased, vocab_size)
        out.index_put_(tuple(t.to(logits.device) for t in (rows_t, ids_t)), values.to(logits.device),
                       accumulate=True)  # [N, V]
    if ban_pairs:
        rows_t = device_tensor([i for i, _ in ban_pairs], torch.long, logits.device)  # [n]
        ids_t = device_tensor([t for _, t in ban_pairs], torch.long, logits.device)  # [n]
        out.index_put_((rows_t, ids_t), torch.full((), float("-inf"), device=logits.device))  # [N, V]
        _check_some_token_left(out, metadata, sorted({i for i, _ in ban_pairs}))
    return out


def banned_token_ids(params: SamplingParams, output_token_ids: list[int]) -> set[int]:
    """The ids this row may not emit next: stop ids and EOS while fewer than min_tokens outputs
    exist, and the last token of each bad word whose other tokens end the output."""
    banned = set(params.all_stop_token_ids) if len(output_token_ids) < params.min_tokens else set()
    if params._bad_words_token_ids:
        banned |= bad_words_index(params).banned(output_token_ids)
    return banned


def bad_words_index(params: SamplingParams) -> BadWordsIndex:
    """The params' BadWordsIndex, built on first use and kept on the params (rebuilt when its
    `_bad_words_token_ids` were replaced)."""
    index = params.__dict__.get("_bad_words_index")
    if index is None or index.words is not params._bad_words_token_ids:
        index = BadWordsIndex(params._bad_words_token_ids)
        params.__dict__["_bad_words_index"] = index
    return index


def _bias_tensors(params: list[SamplingParams], rows: list[int], vocab_size: int) -> tuple[torch.Tensor, ...]:
    """rows [n], ids [n] long and values [n] fp32 (CPU) of the rows' logit_bias entries; each
    request's (ids, values) are built and checked against the vocabulary once, then kept."""
    parts = []
    for p, row in zip(params, rows, strict=True):
        cached = p.__dict__.get("_logit_bias_tensors")
        if cached is None or cached[0] is not p.logit_bias:
            check_token_ids_in_vocab(p, vocab_size)
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)  # [b]
            cached = (p.logit_bias, ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
            p.__dict__["_logit_bias_tensors"] = cached
        parts.append((torch.full_like(cached[1], row), cached[1], cached[2]))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


def _check_some_token_left(out: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    """StructuredOutputError when a structured-output row among `rows` has no finite logit: its
    grammar allows only tokens its bad_words ban (one device sync, only for such rows)."""
    structured = [i for i in rows if metadata.params[i].structured_output is not None]
    if not structured:
        return
    index = device_tensor(structured, torch.long, out.device)  # [S]
    empty = torch.isneginf(out.index_select(0, index)).all(dim=1).tolist()  # [S]
    for i, is_empty in zip(structured, empty, strict=True):
        if is_empty:
            raise StructuredOutputError(
                f"request {metadata.request_ids[i]!r}: no token is left to sample after "
                f"{len(metadata.output_token_ids[i])} output tokens: every token its structured_output "
                f"grammar allows is banned by bad_words")


def drop_banned(weights: torch.Tensor, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """weights [R, V] (sampling weights of logits [R, V]) with every -inf logit's weight set to
    exactly 0: the sampler floors exponents (a -inf logit would keep e^-80). In place; a no-op
    when no row bans a token."""
    if metadata.any_ban:
        weights.masked_fill_(logits == float("-inf"), 0.0)  # [R, V]
    return weights
