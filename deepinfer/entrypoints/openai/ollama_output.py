"""Ollama's answers: chat and generate replies (whole or as NDJSON lines), model cards, errors.

A chat reply is `{model, created_at, message: {role: "assistant", content, thinking?, tool_calls?},
done, ...}`; a generate reply has `response` (and `thinking`) in place of `message`. A whole reply
and the last streamed line carry `done: true`, `done_reason` ("stop", or "length" when num_predict
or the context cut the answer) and the counters in nanoseconds, as Ollama sends them:

    total_duration        arrival -> last token
    load_duration         0 (the model is loaded at start-up)
    prompt_eval_count     prompt tokens       prompt_eval_duration  arrival -> first token
    eval_count            answer tokens       eval_duration         first token -> last token

A streamed reply is one JSON object per line: a line per step with new text (`done: false`), the
calls (each `{id, function: {index, name, arguments: object}}`) in one line once the answer ends,
then the `done` line with empty content. The reading (reasoning -> `thinking`, tool calls) is the
chat path's (`chat_output.py`). An error is `{"error": "message"}`, in a stream too.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import UTC, datetime

from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.serving.chat.output import ChatOutputPlan, ParsedMessage

OLLAMA_VERSION = "0.6.3"  # the Ollama API version these routes follow (GET /api/version)


def created_at() -> str:
    """Now, in RFC 3339 (UTC), as Ollama writes timestamps."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ndjson(line: dict) -> str:
    return json.dumps(line, ensure_ascii=False) + "\n"


class OllamaReply:
    """One reply of /api/chat (`chat`) or /api/generate, whole or streamed; `plan` reads the answer
    (None: raw text, no parsing)."""

    def __init__(self, model: str, chat: bool, plan: ChatOutputPlan | None, num_prompt_tokens: int):
        self.model, self.chat, self.num_prompt_tokens = model, chat, num_prompt_tokens
        self.plan = plan if plan is not None and plan.parses else None
        self._stream = None if self.plan is None else self.plan.stream()
        self._calls: dict[int, dict] = {}  # streamed calls by index: {id, name, arguments (text)}
        self.arrival_ns = time.monotonic_ns()
        self.first_ns: int | None = None

    def start(self) -> list[dict]:
        return []

    def whole(self, out: RequestOutput) -> dict:
        """The reply of a finished request."""
        self._mark()
        c = out.outputs[0]
        parsed = ParsedMessage(None, c.text) if self.plan is None else self.plan.read(c)
        calls = [(call.id, call.function.name, call.function.arguments) for call in parsed.tool_calls]
        body = self._body(parsed.content or "", parsed.reasoning_content, calls)
        return body | self._done(out)

    def step(self, out: RequestOutput) -> list[dict]:
        """The lines of one streamed step (the done line included once the request finished)."""
        self._mark()
        c = out.outputs[0]
        lines = []
        thinking, content = self._feed(c)
        if thinking or content:
            lines.append(self._body(content, thinking or None, []))
        if c.finished:
            if self._calls:
                calls = [(v["id"], v["name"], v["arguments"]) for _, v in sorted(self._calls.items())]
                lines.append(self._body("", None, calls))
            lines.append(self._body("", None, []) | self._done(out))
        return lines

    def _feed(self, c: CompletionOutput) -> tuple[str, str]:
        if self._stream is None:
            return "", c.delta_text
        parts = self._stream.read(c)
        for call in parts.tool_calls:
            entry = self._calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            entry["id"] = call.get("id", entry["id"])
            entry["name"] = call["function"].get("name", entry["name"])
            entry["arguments"] += call["function"].get("arguments") or ""
        return parts.reasoning_content, parts.content

    def _mark(self) -> None:
        if self.first_ns is None:
            self.first_ns = time.monotonic_ns()

    def _body(self, content: str, thinking: str | None, calls: list[tuple[str, str, str]]) -> dict:
        body: dict = {"model": self.model, "created_at": created_at()}
        if not self.chat:
            return body | {"response": content, "done": False} | ({"thinking": thinking} if thinking else {})
        message: dict = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [tool_call(i, *call) for i, call in enumerate(calls)]
        return body | {"message": message, "done": False}

    def _done(self, out: RequestOutput) -> dict:
        c, end = out.outputs[0], time.monotonic_ns()
        first = self.first_ns or end
        return {"done": True, "done_reason": "length" if c.finish_reason == "length" else "stop",
                "total_duration": end - self.arrival_ns, "load_duration": 0,
                "prompt_eval_count": self.num_prompt_tokens, "prompt_eval_duration": first - self.arrival_ns,
                "eval_count": len(c.token_ids), "eval_duration": end - first}


def tool_call(index: int, call_id: str, name: str, arguments: str) -> dict:
    """One call as Ollama returns it: arguments as an object."""
    return {"id": call_id, "function": {"index": index, "name": name,
                                        "arguments": json.loads(arguments) if arguments else {}}}


def loaded_reply(model: str, chat: bool) -> dict:
    """The answer to a request without messages (or prompt): Ollama's "the model is loaded"."""
    body = {"model": model, "created_at": created_at(), "done": True, "done_reason": "load"}
    return body | ({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})


def model_entry(name: str, card: dict) -> dict:
    """An entry of GET /api/tags (and of /api/ps): Ollama names a model `name:tag`."""
    full = name if ":" in name else f"{name}:latest"
    return {"name": full, "model": full, "modified_at": card["modified_at"], "size": card["size"],
            "digest": card["digest"], "details": card["details"]}


def show_reply(card: dict, template: str, capabilities: list[str], parameters: dict, model_info: dict) -> dict:
    """POST /api/show: what is known of the model (its chat template is Jinja, not a Go template)."""
    lines = [f"{key} {json.dumps(value) if isinstance(value, str) else value}" for key, value in parameters.items()]
    return {"modelfile": f"FROM {card['name']}\n" + "".join(f"PARAMETER {line}\n" for line in lines),
            "parameters": "\n".join(lines), "template": template, "details": card["details"],
            "model_info": model_info, "capabilities": capabilities, "modified_at": card["modified_at"]}


_DTYPE_LEVELS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def base_card(engine, name: str) -> dict:
    """What /api/tags and /api/show tell of the served model: its weight files' bytes, a digest of their
    content, their time, the format, family (HF model_type), parameter count and weight format."""
    source, runner = engine.source, engine.runner
    files = _weight_files(source.path)
    mtime = max((os.path.getmtime(f) for f in files), default=time.time())
    quantization, dtype = runner.quantization.value, runner.dtype_choice.value
    family = source.hf_config.model_type or ""
    level = quantization.upper() if quantization != "none" else _DTYPE_LEVELS.get(dtype, dtype)
    details = {"parent_model": "", "format": "gguf" if source.format == "gguf" else "safetensors",
               "family": family, "families": [family], "parameter_size": _parameter_size(source.path, runner),
               "quantization_level": level}
    return {"name": name, "size": sum(os.path.getsize(f) for f in files), "digest": source.identity,
            "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
            "details": details}


def adapter_card(base: dict, name: str, path: str) -> dict:
    """An adapter's entry: the base model's facts, its own name and digest, the base as parent."""
    digest = hashlib.sha256(f"{base['digest']}\0{name}\0{path}".encode()).hexdigest()
    return {**base, "name": name, "digest": digest, "details": {**base["details"], "parent_model": base["name"]}}


def _weight_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        return []
    return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith((".safetensors", ".gguf"))]


def _parameter_size(path: str, runner) -> str:
    """The parameter count as Ollama writes it ("494.03M", "7.62B"): the values in the checkpoint's files
    (a quantized matrix is a buffer of blocks, not a parameter, so the module cannot count it), else
    the module's parameters (dummy weights)."""
    from deepinfer.entrypoints.model_host.catalog import parameter_size, read_facts

    try:
        count = read_facts(path).parameter_count
    except (OSError, ValueError, KeyError, TypeError):
        count = None
    return parameter_size(count or sum(p.numel() for p in runner.model.parameters()))
