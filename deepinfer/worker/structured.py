"""Structured output on the worker: per-request grammar matchers (llguidance) and the token masks
they put on logits rows before sampling.

A matcher is a function of the request's output tokens. Before its rows are sampled, a request's
matcher is brought up to `output_token_ids` (consuming what it has not seen), so the token sampled
last step is accepted here, and a request preempted and recomputed keeps its matcher as it was.
EOS tokens are never consumed: once the grammar is complete the mask allows only EOS, the
request samples it and stops with finish_reason "stop".

A verification step (speculative decoding) scores k + 1 rows for drafts d1..dk; row i gets the
mask after d1..di:

    row 0: mask(state)      consume d1 (if allowed)
    row 1: mask(+d1)        consume d2 (if allowed)
    ...                     a draft the grammar forbids stops the walk; the rows after it copy
    row k: mask(+d1..dk)    the last mask (they are never reached: that draft is rejected)

then the drafts are rolled back; the tokens the rejection sampler keeps come back as outputs and
are consumed at the next step. A forbidden draft x at row i has p_i(x) = 0, so it is never kept.

A request's spec normally arrives compiled (`StructuredOutputsParams.compiled`, by the server's
tokenizer pool or the engine's add path): its matcher is copied, and nothing is compiled on the
engine thread. Otherwise (another vocabulary size or EOS set) the worker compiles each distinct
grammar once itself (an LRU of compiled matchers, copied per request); the tokenizer's llguidance
view is then built once, on first use (about half a second for 49k tokens).

Every failure of a request's grammar here raises `StructuredOutputError` with a short message
(llguidance's first lines): the runner reports it as that request's fault, and the engine logs
one line for it.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.contracts.hf_config import end_of_generation_ids
from deepinfer.structured_output import StructuredOutputError, first_lines, grammar_engine, grammar_limits

if TYPE_CHECKING:
    import llguidance
from deepinfer.worker.input_batch import num_logits_rows

_MAX_COMPILED = 64  # distinct grammars kept compiled


@dataclass
class _Tracked:
    """A request's matcher and how many of its output tokens it has seen (consumed or skipped)."""

    matcher: llguidance.LLMatcher
    num_synced: int = 0


def eos_ids_of(source) -> list[int]:
    """The model's end-of-generation ids (the engine's set): what the grammar ends with."""
    return sorted(end_of_generation_ids(source.hf_config, source.tokenizer, source.generation_config))


class StructuredOutputs:
    """Matchers of the requests that have a `structured_output`, and the masks they give."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._matchers: dict[str, _Tracked] = {}

    @staticmethod
    def wanted(rows: Sequence) -> bool:
        return any(s.sampling_params is not None and s.sampling_params.structured_output is not None for s in rows)

    def apply(self, logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
        """logits [M, V] for `rows` (one per plain request, k + 1 per verification) -> a copy with
        -inf wherever a structured request's grammar forbids the token (unchanged rows as they are).
        Raises StructuredOutputError (a ValueError) for a request whose grammar cannot be used (engine isolates it)."""
        vocab_size = logits.shape[-1]
        index, masks, first = [], [], 0
        for s in rows:
            size = num_logits_rows(s)
            if s.sampling_params is not None and s.sampling_params.structured_output is not None:
                masks.append(self._masks(s, vocab_size))  # [size, W]
                index.extend(range(first, first + size))
            first += size
        if not index:
            return logits
        allowed = unpack_bitmask(torch.cat(masks), vocab_size).to(logits.device)  # [R, V] bool
        if len(index) == logits.shape[0]:  # every row constrained
            return logits.masked_fill(~allowed, float("-inf"))  # [M, V]
        rows_at = torch.tensor(index, device=logits.device)  # [R]
        masked = logits.clone()  # [M, V]
        masked[rows_at] = logits.index_select(0, rows_at).masked_fill_(~allowed, float("-inf"))  # [R, V]
        return masked

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget the matchers of finished or aborted requests."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def _masks(self, s, vocab_size: int) -> torch.Tensor:
        """The request's mask rows [k + 1 or 1, W] (int32 bitmask words), its matcher synced first."""
        tracked = self._tracked(s, vocab_size)
        self._sync(tracked, s)
        matcher, drafts = tracked.matcher, s.draft_token_ids
        bitmask = torch.zeros(num_logits_rows(s), (vocab_size + 31) // 32, dtype=torch.int32)  # [k+1, W]
        _fill(matcher, bitmask[0], s.request_id)
        consumed = 0
        for i, draft in enumerate(drafts, start=1):
            if matcher.is_stopped() or draft in self.eos_token_ids or matcher.validate_tokens([draft]) != 1:
                bitmask[i:] = bitmask[i - 1]  # unreachable rows: draft i is refused at row i - 1
                break
            matcher.consume_token(draft)
            consumed += 1
            _fill(matcher, bitmask[i], s.request_id)
        if consumed and not matcher.rollback(consumed):
            raise StructuredOutputError(f"request {s.request_id!r}: the grammar matcher could not roll back "
                                        f"{consumed} drafts: {first_lines(matcher.get_error())}")
        return bitmask

    def _tracked(self, s, vocab_size: int) -> _Tracked:
        tracked = self._matchers.get(s.request_id)
        if tracked is None:
            spec = s.sampling_params.structured_output
            ready = spec.compiled
            if ready is not None and ready.fits(vocab_size, self.eos_token_ids):
                compiled = ready.matcher  # compiled before admission, off the engine thread
            else:
                compiled = self._compile(spec.grammar_text, vocab_size)
            tracked = self._matchers[s.request_id] = _Tracked(compiled.deep_copy())
        return tracked

    def _sync(self, tracked: _Tracked, s) -> None:
        """Consume the request's output tokens the matcher has not seen (skipping EOS and what
        follows a completed grammar). StructuredOutputError when one does not fit the grammar."""
        outputs, matcher = s.output_token_ids, tracked.matcher
        if len(outputs) < tracked.num_synced:  # outputs never shrink; start over if they did
            matcher.reset()
            tracked.num_synced = 0
        for token in outputs[tracked.num_synced:]:
            if not (matcher.is_stopped() or token in self.eos_token_ids) and not matcher.consume_token(token):
                raise StructuredOutputError(f"request {s.request_id!r}: output token {token} does not fit its "
                                            f"structured_output grammar: {first_lines(matcher.get_error())}")
            tracked.num_synced += 1

    def _compile(self, grammar_text: str, vocab_size: int) -> llguidance.LLMatcher:
        """A fresh matcher of the grammar, compiled once per distinct text (LRU)."""
        compiled = self._compiled.get(grammar_text)
        if compiled is not None:
            self._compiled.move_to_end(grammar_text)
            return compiled
        compiled = grammar_engine().LLMatcher(self._tokenizer_info(vocab_size), grammar_text, log_level=0,
                                              limits=grammar_limits())
        if compiled.is_error():
            raise StructuredOutputError(f"structured_output grammar does not compile: "
                                        f"{first_lines(compiled.get_error())}")
        self._compiled[grammar_text] = compiled
        if len(self._compiled) > _MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

    def _tokenizer_info(self, vocab_size: int) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (every token's bytes), built once."""
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured_output needs the model's tokenizer, and this model has none")
            import llguidance.hf  # imports transformers: only when structured output is used

            eos = sorted(self.eos_token_ids) or None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=vocab_size, eos_token=eos)
        return self._ll_tokenizer


def _fill(matcher: llguidance.LLMatcher, words: torch.Tensor, request_id: str) -> None:
    """Write the matcher's next-token bitmask into words [W] (int32, CPU, contiguous)."""
    if not matcher.is_error():
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
    if matcher.is_error():
        raise StructuredOutputError(f"request {request_id!r}: structured_output grammar error: "
                                    f"{first_lines(matcher.get_error())}")
    if not bool(words.any()):
        raise StructuredOutputError(f"request {request_id!r}: its structured_output grammar allows no token here")


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask words [R, W] int32 (bit j of word w: token 32·w + j) -> allowed [R, V] bool."""
    as_bytes = words.numpy().view(np.uint8)  # [R, 4W]; little-endian: byte b of word w = tokens 32w + 8b ..
    if sys.byteorder != "little":
        as_bytes = words.numpy().byteswap().view(np.uint8)  # [R, 4W]
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # [R, 32W]; bit 0 of a byte first
    return torch.from_numpy(bits[:, :vocab_size]).bool()  # [R, V]
