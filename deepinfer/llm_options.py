"""vLLM's `LLM(...)` keywords that DeepInfer has no parameter of its own for. Pure Python (no torch).

Code written for vLLM passes keywords like `pipeline_parallel_size=1` or `trust_remote_code=True`.
Those that mean something here are checked (a value we cannot honour is a ValueError naming the
keyword and the value); those that change nothing here are accepted, and why is said below. Any
other keyword is a TypeError that lists every accepted one, so a typo is never silently ignored.
"""

from __future__ import annotations

import os

# keyword -> what it does here (the TypeError and the docs list these)
NO_EFFECT = {
    "trust_remote_code": "accepted; no code from a checkpoint is ever run (every architecture is DeepInfer's own)",
    "swap_space": "accepted; preempted requests are recomputed, never swapped to CPU memory",
    "disable_log_stats": "accepted; LLM logs no periodic statistics (the server does)",
}
CHECKED = {
    "pipeline_parallel_size": "1 only (one device)",
    "tokenizer": "the model's own tokenizer only (None or the model's path)",
    "tokenizer_mode": "'auto' only",
}


def check_vllm_keywords(model: str | None, keywords: dict, accepted: list[str]) -> None:
    """Check vLLM keywords given to `LLM(...)` beside DeepInfer's own (`accepted`)."""
    unknown = sorted(set(keywords) - NO_EFFECT.keys() - CHECKED.keys())
    if unknown:
        names = sorted({*accepted, *NO_EFFECT, *CHECKED})
        raise TypeError(f"LLM() got unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))}; accepted keywords: {', '.join(names)}")
    value = keywords.get("pipeline_parallel_size", 1)
    if value != 1 or isinstance(value, bool):
        raise ValueError(f"pipeline_parallel_size={value!r}: only 1 is supported (tensor_parallel_size splits "
                         f"a model over devices)")
    if keywords.get("tokenizer_mode", "auto") != "auto":
        raise ValueError(f"tokenizer_mode={keywords['tokenizer_mode']!r}: only 'auto' is supported")
    _check_tokenizer(model, keywords.get("tokenizer"))


def _check_tokenizer(model: str | None, tokenizer) -> None:
    """The tokenizer is the model's own: `tokenizer` may only name the model itself."""
    if tokenizer is None:
        return
    same = model is not None and isinstance(tokenizer, str) and (
        tokenizer == model or os.path.realpath(os.path.expanduser(tokenizer))
        == os.path.realpath(os.path.expanduser(model)))
    if not same:
        raise ValueError(f"tokenizer={tokenizer!r}: only the model's own tokenizer is supported "
                         f"(model is {model!r}); leave tokenizer unset")
