"""A request's routing key: the tokens of what its prompt starts with, for prefix-aware routing.

The key is not the engine's prompt (that needs the chat template, the tools' rendering and the
server's checks, which the replica does); it only has to start with the same tokens whenever two
prompts start the same. So it is the tokenizer's ids of the parts in prompt order:

    /v1/completions, /api/generate      the prompt (text, or token ids as given)
    /v1/chat/completions, /api/chat     the tools (as JSON), then each message: role, content
    /v1/messages (Anthropic)            the system text, the tools, then the messages
    /v1/responses                       the instructions, the tools, then the input

A body the key cannot be read from (malformed, another route) has no key: the request goes to the
least loaded replica, and that replica answers whatever error it deserves.
"""

from __future__ import annotations

import json
from typing import Any

_PROMPT_ROUTES = ("/v1/completions", "/api/generate")
_MESSAGE_ROUTES = ("/v1/chat/completions", "/api/chat", "/v1/messages")
MAX_KEY_CHARS = 16_384  # enough for the first blocks of any prompt; a longer text is cut


def routing_text(path: str, body: Any) -> str | list[int] | None:
    """The text (or token ids) a request's prompt starts with, or None when there is none."""
    if not isinstance(body, dict):
        return None
    if path in _PROMPT_ROUTES:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [t for t in prompt if isinstance(t, int)]
        return _text(prompt)
    if path in _MESSAGE_ROUTES:
        return _joined([body.get("system"), body.get("tools"), *_messages(body.get("messages"))])
    if path == "/v1/responses":
        return _joined([body.get("instructions"), body.get("tools"), body.get("input")])
    return None


def routing_tokens(tokenizer, path: str, body: Any) -> list[int]:
    """The routing key as token ids (empty when the request has none)."""
    key = routing_text(path, body)
    if isinstance(key, list):
        return key
    if not key:
        return []
    return tokenizer.encode(key[:MAX_KEY_CHARS], add_special_tokens=False)


def _messages(messages: Any) -> list[Any]:
    if not isinstance(messages, list):
        return []
    return [f"{m.get('role', '')}\n{_text(m.get('content'))}" if isinstance(m, dict) else _text(m)
            for m in messages]


def _joined(parts: list[Any]) -> str | None:
    texts = [_text(p) for p in parts if p]
    return "\n".join(texts) if texts else None


def _text(value: Any) -> str:
    """A prompt part as text: strings as they are; lists of text parts joined; anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and "text" in p for p in value):
        return "".join(str(p["text"]) for p in value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False)[:MAX_KEY_CHARS]
