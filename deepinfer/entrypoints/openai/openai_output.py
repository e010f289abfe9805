"""OpenAI's answers to /v1/completions and /v1/chat/completions: whole JSON bodies or SSE chunks.

A formatter knows one endpoint's shapes (text completion or chat completion); `OpenAIStream` is
its stream encoder for `serving.run.stream`, and `final()` the whole answer of `serving.run.whole`'s
output. `finish_reason` is one of OpenAI's values ("stop", "length", "tool_calls"); a request that
ends otherwise is an error (`serving.run.request_failure`), reported in a stream as an
`{"error": ...}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import abc
import json
import time
from dataclasses import asdict, replace

from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.serving.chat.output import ChatOutputPlan, ChoiceStream
from deepinfer.serving.errors import ServingError

MIN_LOGPROB = -9999.0  # JSON has no -inf


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


class _Formatter(abc.ABC):
    """Shared state of one response: id, model, token strings, usage. An endpoint supplies the
    choice of one streamed chunk and of the whole response."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, tokenizer, num_prompt_tokens: int,
                 num_logprobs: int | None):
        self.response_id, self.model, self.tokenizer = response_id, model, tokenizer
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_logprobs = num_logprobs
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at admission
        self._prompt_logprobs_sent = False
        self._finish_sent: set[int] = set()  # choice indices whose finish_reason was streamed

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        return {"id": self.response_id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self) -> dict:
        body = self.envelope([], chunk=True)
        body["usage"] = self.usage()
        return body

    def usage(self) -> dict:
        return usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)

    def start_chunks(self) -> list[dict]:
        return []

    def chunk(self, out: RequestOutput) -> dict | None:
        """The SSE chunk for this step's deltas: a choice per completion (n of them) with new
        text or just finished, each with its index; None when the step added nothing to show."""
        self.num_completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.num_cached_tokens = out.num_cached_tokens
        choices = [self.chunk_choice(one) for one in self._news(out)]
        if not choices:
            return None
        return self.add_prompt_logprobs(self.envelope(choices, chunk=True), out)

    def _news(self, out: RequestOutput) -> list[RequestOutput]:
        """`out` narrowed to each completion that has news (one choice each)."""
        news = []
        for c in out.outputs:
            if c.delta_token_ids or c.delta_text or (c.finished and c.index not in self._finish_sent):
                news.append(replace(out, outputs=[c]))
                if c.finished:
                    self._finish_sent.add(c.index)
        return news

    def final(self, out: RequestOutput) -> dict:
        """The whole response of a finished request, with usage."""
        self.num_completion_tokens = sum(len(c.token_ids) for c in out.outputs)  # usage sums the n choices
        self.num_cached_tokens = out.num_cached_tokens
        choices = [self.final_choice(replace(out, outputs=[c])) for c in out.outputs]
        body = self.add_prompt_logprobs(self.envelope(choices, chunk=False), out)
        body["usage"] = self.usage()
        return body

    @abc.abstractmethod
    def chunk_choice(self, out: RequestOutput) -> dict: ...

    @abc.abstractmethod
    def final_choice(self, out: RequestOutput) -> dict: ...

    def _entries(self, out: RequestOutput, num_last: int | None) -> list[tuple[int, dict[int, float]]]:
        """(token id, {id: logprob}) for the last `num_last` tokens (None: all)."""
        c = out.outputs[0]
        if self.num_logprobs is None or c.logprobs is None:
            return []
        ids, entries = c.token_ids, c.logprobs
        if num_last is not None:
            ids, entries = ids[len(ids) - num_last:], entries[len(entries) - num_last:]
        return [(t, {i: lp.logprob for i, lp in entry.items()}) for t, entry in zip(ids, entries, strict=True)]

    def add_prompt_logprobs(self, body: dict, out: RequestOutput) -> dict:
        """A top-level `prompt_logprobs` list, as vLLM renders it (an extension): per prompt token
        None (the first) or {token id: {logprob, rank, decoded_token}}. Sent once per request:
        in the whole response, or in the first streamed chunk after the prompt was scored."""
        if out.prompt_logprobs is None or self._prompt_logprobs_sent:
            return body
        self._prompt_logprobs_sent = True
        body["prompt_logprobs"] = [None if entry is None else {
            str(t): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()} for entry in out.prompt_logprobs]
        return body


class CompletionFormatter(_Formatter):
    """POST /v1/completions: `text` choices and the legacy logprobs shape."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # per choice index: characters streamed so far

    def chunk_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        return {"index": c.index, "text": c.delta_text, "logprobs": self._logprobs(out, len(c.delta_token_ids)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def final_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        return {"index": c.index, "text": c.text, "logprobs": self._logprobs(out, None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _logprobs(self, out: RequestOutput, num_last: int | None) -> dict | None:
        if self.num_logprobs is None:
            return None
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        index = out.outputs[0].index
        for token_id, entry in self._entries(out, num_last):
            text = self.token_text(token_id)
            result["tokens"].append(text)
            result["token_logprobs"].append(max(entry[token_id], MIN_LOGPROB))
            result["top_logprobs"].append({self.token_text(t): max(lp, MIN_LOGPROB)
                                           for t, lp in entry.items()})
            result["text_offset"].append(self._text_offsets.get(index, 0))
            self._text_offsets[index] = self._text_offsets.get(index, 0) + len(text)
        return result


class ChatFormatter(_Formatter):
    """POST /v1/chat/completions: `message` / `delta` choices and the chat logprobs shape. With a
    `plan` that parses (`chat_output.py`), each choice's text is read into reasoning_content,
    content and tool_calls, whole or streamed (one ChoiceStream per choice); a choice that made
    calls and stopped finishes with "tool_calls"."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, plan: ChatOutputPlan | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._roles_sent: set[int] = set()  # choice indices (beyond 0) whose first delta carried the role
        self.plan = plan if plan is not None and plan.parses else None
        self._streams: dict[int, ChoiceStream] = {}  # per choice index

    def start_chunks(self) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self.envelope([choice], chunk=True)]

    def chunk_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        delta, finish_reason = self._delta(c)
        if c.index and c.index not in self._roles_sent:  # index 0's role went in the first chunk
            self._roles_sent.add(c.index)
            delta = {"role": "assistant", **delta}
        return {"index": c.index, "delta": delta, "logprobs": self._logprobs(out, len(c.delta_token_ids)),
                "finish_reason": finish_reason}

    def _delta(self, c: CompletionOutput) -> tuple[dict, str | None]:
        if self.plan is None:
            return ({"content": c.delta_text} if c.delta_text or not c.finished else {}), c.finish_reason
        stream = self._streams.setdefault(c.index, self.plan.stream())
        parts = stream.read(c)
        delta = {"reasoning_content": parts.reasoning_content, "content": parts.content,
                 "tool_calls": parts.tool_calls}
        return {key: value for key, value in delta.items() if value}, tool_finish_reason(c.finish_reason,
                                                                                         stream.num_calls)

    def final_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        message: dict = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if self.plan is not None:
            parsed = self.plan.read(c)
            message["content"] = parsed.content
            if self.plan.reasoning is not None:
                message["reasoning_content"] = parsed.reasoning_content
            if parsed.tool_calls:
                message["tool_calls"] = [asdict(call) for call in parsed.tool_calls]
            finish_reason = tool_finish_reason(finish_reason, len(parsed.tool_calls))
        return {"index": c.index, "message": message, "logprobs": self._logprobs(out, None),
                "finish_reason": finish_reason}

    def _logprobs(self, out: RequestOutput, num_last: int | None) -> dict | None:
        if self.num_logprobs is None:
            return None
        content = []
        for token_id, entry in self._entries(out, num_last):
            best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:self.num_logprobs]
            item = self._token_logprob(token_id, entry[token_id])
            item["top_logprobs"] = [self._token_logprob(t, lp) for t, lp in best]
            content.append(item)
        return {"content": content, "refusal": None}

    def _token_logprob(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}


def tool_finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """"tool_calls" for an answer that made calls and stopped (OpenAI's finish reason then)."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class OpenAIStream:
    """The stream encoder (`serving.run.StreamEncoder`) of /v1/completions and /v1/chat/completions:
    a formatter's SSE chunks, the usage chunk when asked for, an error as an `{"error": ...}` event,
    and `data: [DONE]` last, whatever happened."""

    def __init__(self, formatter: _Formatter, include_usage: bool):
        self.formatter, self.include_usage = formatter, include_usage
        self._failed = False

    def start(self) -> list[str]:
        return [sse(chunk) for chunk in self.formatter.start_chunks()]

    def step(self, out: RequestOutput) -> list[str]:
        chunk = self.formatter.chunk(out)
        if chunk is None:
            return []
        if self.include_usage:
            chunk["usage"] = None
        return [sse(chunk)]

    def failed(self, error: ServingError) -> list[str]:
        self._failed = True
        return [sse(error.to_dict())]

    def end(self) -> list[str]:
        usage_chunk = [sse(self.formatter.usage_chunk())] if self.include_usage and not self._failed else []
        return usage_chunk + [sse("[DONE]")]
