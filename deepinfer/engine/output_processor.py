"""Turns sampled tokens into RequestOutputs: detokenization, stop strings, logprobs. Pure Python.

When a request is added (`add`), its per-request preparation that needs the tokenizer happens
here, before any step: its bad words are tokenized and its structured output compiled completely
(`GrammarCompiler`), unless the server already did both in its tokenizer pool. A refusal is a
ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from deepinfer.engine.detokenizer import IncrementalDetokenizer, NoTextDetokenizer, StopChecker
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured_output import GrammarCompiler


@dataclass
class _State:
    prompt: str | None
    detokenizer: IncrementalDetokenizer | NoTextDetokenizer
    stop: StopChecker
    completion: CompletionOutput
    params: SamplingParams
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class OutputProcessor:
    """Per request: its completion so far, detokenizer and stop checker; folds each step's
    sample in and builds the request's RequestOutput."""

    def __init__(self, tokenizer, vocab_size: int | None = None, eos_token_ids=()):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}
        self._embeddings: dict[str, str | None] = {}  # embedding requests: their prompt text
        # structured output is compiled for the model's vocabulary (None: left to the worker)
        self.grammars = None if vocab_size is None else GrammarCompiler(tokenizer, vocab_size, eos_token_ids)

    def add(self, req: Request, prompt: str | None) -> None:
        if req.pooling_params is not None:  # an embedding: no tokens, no text to follow
            self._embeddings[req.request_id] = prompt
            return
        p = req.sampling_params
        p.set_eos_token_ids(req.eos_token_ids)  # min_tokens masks them
        if not p.bad_words_tokenized:
            p.set_bad_words_tokens(self.tokenizer)  # ValueError without a tokenizer
        if p.structured_output is not None and self.grammars is not None:
            self.grammars.prepare(p.structured_output, p.first_banned_token_ids())  # StructuredOutputError
        detok = NoTextDetokenizer() if self.tokenizer is None else \
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                   p.spaces_between_special_tokens)
        completion = CompletionOutput(index=0, logprobs=[] if p.logprobs is not None else None)
        self._states[req.request_id] = _State(prompt, detok, StopChecker(p.stop), completion, p)

    def update(self, req: Request, samples: list) -> tuple[str | None, int]:
        """Fold this step's tokens and their text in, one token at a time as plain decoding
        would. Returns (the stop string a token completed, or None; how many tokens were taken):
        a stop string ends the run at the token that completed it."""
        state = self._states[req.request_id]
        c = state.completion
        c.delta_token_ids, c.delta_text = [], ""
        if not samples:
            self._fold_text(state, [], req.is_finished, False)
            return None, 0
        for i, sample in enumerate(samples):
            last = i == len(samples) - 1
            self._add_token(state, req, sample)
            matched = self._fold_text(state, [sample.token_id], req.is_finished and last,
                                      last and _ended_by_token(req))
            if matched is not None:
                return matched, i + 1
        return None, len(samples)

    def _fold_text(self, state: _State, new_ids: list[int], finished: bool, drop_last: bool) -> str | None:
        text, matched = self._text_delta(state, new_ids, finished, drop_last)
        state.completion.text += text
        state.completion.delta_text += text
        return matched

    @staticmethod
    def _text_delta(state: _State, new_ids: list[int], finished: bool, drop_last: bool) -> tuple[str, str | None]:
        """A stop token or EOS stays in token_ids but its text is not emitted (as in vLLM).
        Stop strings are checked once min_tokens outputs exist (text before that is emitted as
        is, so a stop string that starts before that point is not matched); a matched one stays
        in the text with include_stop_str_in_output."""
        delta = state.detokenizer.add_tokens(new_ids[:-1] if drop_last else new_ids)
        if finished:
            delta += state.detokenizer.flush()
        if len(state.completion.token_ids) < state.params.min_tokens:
            return delta, None
        text, matched = state.stop.step(delta)
        if matched is None and finished:
            text += state.stop.flush()
        if matched is not None and state.params.include_stop_str_in_output:
            text += matched
        return text, matched

    def output(self, req: Request) -> RequestOutput:
        """The request's output after this step; a finished request's state is dropped."""
        return self._output(req, finished=req.is_finished)

    def abort(self, req: Request) -> RequestOutput | None:
        """The final output of an aborted request (None if it was already reported)."""
        if req.request_id in self._embeddings:
            return self.embedding(req, [], "abort")
        if req.request_id not in self._states:
            return None
        c = self._states[req.request_id].completion
        c.delta_token_ids, c.delta_text = [], ""
        return self._output(req, finished=True)

    def fail(self, req: Request, error: Exception) -> RequestOutput:
        """The final output of a request failed by a fault (finish_reason "error", `error` set).

        Touches neither the detokenizer nor the stop checker (either may be what failed): the
        text is that of the last good step, token_ids every token sampled for it; no delta."""
        if req.pooling_params is not None:
            return self.embedding(req, [], "error", error)
        state = self._states.pop(req.request_id, None)
        if state is None:
            completion, prompt = CompletionOutput(index=0), None
        else:
            completion, prompt = state.completion, state.prompt
        out = replace(completion, token_ids=list(completion.token_ids),
                      logprobs=None if completion.logprobs is None else list(completion.logprobs),
                      delta_token_ids=[], delta_text="", finish_reason="error", stop_reason=None)
        return RequestOutput(req.request_id, prompt, req.prompt_token_ids, [out], finished=True,
                             error=error, num_preemptions=req.num_preemptions,
                             num_cached_tokens=req.num_cached_tokens or 0)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._embeddings.pop(request_id, None)

    def embedding(self, req: Request, vector: list[float], finish_reason: str = "stop",
                  error: Exception | None = None) -> EmbeddingRequestOutput:
        """The final output of an embedding request (its vector, or none when it was aborted or failed)."""
        prompt = self._embeddings.pop(req.request_id, None)
        return EmbeddingRequestOutput(req.request_id, prompt, req.prompt_token_ids, EmbeddingOutput(vector),
                                      finish_reason=finish_reason, error=error)

    def _add_token(self, state: _State, req: Request, sample) -> None:
        c = state.completion
        c.token_ids.append(sample.token_id)
        c.delta_token_ids.append(sample.token_id)
        c.cumulative_logprob += sample.logprob
        if c.logprobs is not None:
            top = [(t, lp, rank) for rank, (t, lp) in enumerate(sample.top_logprobs or [], start=1)]
            c.logprobs.append(self._position(sample.token_id, sample.logprob, sample.rank, top))
        if sample.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = [None if entry is None else self._position(*entry[0], entry[1:])
                                     for entry in sample.prompt_logprobs]

    def _position(self, token_id: int, logprob: float, rank: int | None,
                  top: list[tuple[int, float, int]]) -> PositionLogprobs:
        """{id: Logprob} of one position: the top n (ranks 1..n), then the position's own token."""
        entry = {t: Logprob(lp, r, self._decode(t)) for t, lp, r in top}
        entry[token_id] = Logprob(logprob, rank, self._decode(token_id))
        return entry

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        state = self._states[req.request_id]
        c = state.completion
        c.finish_reason = req.status.finish_reason if finished else None
        c.stop_reason = req.stop_reason
        if finished:
            del self._states[req.request_id]
        snapshot = replace(c, token_ids=list(c.token_ids),  # outputs must not change after return
                           logprobs=None if c.logprobs is None else list(c.logprobs))
        return RequestOutput(req.request_id, state.prompt, req.prompt_token_ids, [snapshot],
                             finished=finished, num_preemptions=req.num_preemptions,
                             num_cached_tokens=req.num_cached_tokens or 0, prompt_logprobs=state.prompt_logprobs)


def _ended_by_token(req: Request) -> bool:
    """Finished by a stop token id or EOS (stop strings set a str stop_reason)."""
    return req.status == RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)
