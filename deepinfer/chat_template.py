"""A chat template that replaces the model's own: `--chat-template FILE|TEMPLATE` (every command that
builds an engine: serve, chat, generate, ...) and `LLM(chat_template=...)`, as vLLM's flag.

The value is the template text itself when it holds Jinja (`{{ ... }}` or `{% ... %}`), else a path
to a file holding one. It is resolved and compiled when the engine config is built, so a missing
file or a template that does not compile is refused before the model loads; the engine then puts it
on the tokenizer (`apply_chat_template_override`), where every chat path (the server's routes,
`LLM.chat`, `deepinfer chat`, `deepinfer generate`) and the tool-call format detection read it.
Pure Python until a template is given (then transformers compiles it as it will render it).
"""

from __future__ import annotations

import os

_SHOWN_CHARS = 60


def resolve_chat_template(value) -> str:
    """The template text `value` gives (itself, or the content of the file it names), compiled once
    to check it. ValueError naming chat_template and the value when it is neither, or does not compile."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"chat_template must be a Jinja template or a path to a file holding one, got {value!r}")
    text = value if is_template_text(value) else _read_template_file(value)
    _check_compiles(text, value)
    return text


def is_template_text(value: str) -> bool:
    """Whether a value is Jinja text rather than a path: it holds `{{` or `{%`."""
    return "{{" in value or "{%" in value


def _read_template_file(value: str) -> str:
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise ValueError(f"chat_template {_shown(value)}: no such file, and not a Jinja template either "
                         f"(a template holds {{{{ ... }}}} or {{% ... %}})")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template {_shown(value)}: cannot read the file ({exc})") from None
    if not is_template_text(text):
        raise ValueError(f"chat_template {_shown(value)}: the file holds no Jinja template (no {{{{ ... }}}} "
                         f"or {{% ... %}})")
    return text


def _check_compiles(text: str, value: str) -> None:
    """Compile the template as transformers does when it renders a chat (its extensions and filters)."""
    from jinja2 import TemplateError, TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as exc:
        line = f" (line {exc.lineno})" if isinstance(exc, TemplateSyntaxError) and exc.lineno else ""
        raise ValueError(f"chat_template {_shown(value)} is not a valid Jinja template: {exc}{line}") from None


def _shown(value: str) -> str:
    """A value as a message shows it: its repr, cut to _SHOWN_CHARS characters."""
    return repr(value) if len(value) <= _SHOWN_CHARS else repr(value[:_SHOWN_CHARS]) + "..."


def apply_chat_template_override(tokenizer, template: str | None) -> None:
    """Put `template` (resolved text) on the tokenizer in place of the model's own (None: keep that).
    ValueError when the model ships no tokenizer to render it with."""
    if template is None:
        return
    if tokenizer is None:
        raise ValueError("chat_template: this model ships no tokenizer, so a chat template cannot be applied "
                         "(send token ids, or use a model with a tokenizer)")
    tokenizer.chat_template = template
