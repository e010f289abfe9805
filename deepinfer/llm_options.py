"""The keywords `LLM(...)` takes: EngineArgs' fields, and vLLM's keywords that DeepInfer has no option
of its own for (this module is the one place that names those). Pure Python (no torch).

Code written for vLLM passes keywords like `pipeline_parallel_size=1` or `trust_remote_code=True`.
Those that mean something here are checked (a value we cannot honour is a ValueError naming the
keyword and the value); those that change nothing here are accepted, and why is said below. Any
other keyword is a TypeError that names the closest accepted ones and lists them all, so a typo is
never silently ignored; it is raised before anything loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os

from deepinfer.engine_args import EngineArgs

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


def accepted_keywords() -> list[str]:
    """Every keyword `LLM(...)` takes: EngineArgs' fields and vLLM's names above."""
    return sorted({f.name for f in dataclasses.fields(EngineArgs)} | NO_EFFECT.keys() | CHECKED.keys())


def llm_engine_args(model: str | None, keywords: dict) -> EngineArgs:
    """The EngineArgs of `LLM(model, **keywords)`: vLLM's keywords are checked and dropped; an unknown
    keyword is a TypeError naming the closest accepted ones."""
    accepted = accepted_keywords()
    unknown = sorted(set(keywords) - set(accepted))
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(_with_suggestion, unknown))}; accepted keywords: {', '.join(accepted)}")
    vllm = {name: value for name, value in keywords.items() if name in NO_EFFECT or name in CHECKED}
    check_vllm_keywords(model, vllm)
    return EngineArgs(model=model, **{name: value for name, value in keywords.items() if name not in vllm})


def _with_suggestion(name: str) -> str:
    """'name', with the accepted keywords closest to it ("did you mean ...?") when some are close."""
    close = difflib.get_close_matches(name, accepted_keywords(), n=3, cutoff=0.6)
    return f"{name!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(name)


def init_signature(init) -> inspect.Signature:
    """`LLM.__init__`'s signature as `inspect` and `help()` show it: `model`, then every EngineArgs
    field as a keyword with its default, then `**vllm_keywords`."""
    params = list(inspect.signature(init).parameters.values())[:2]  # self, model
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    return inspect.Signature([*params, inspect.Parameter("vllm_keywords", inspect.Parameter.VAR_KEYWORD)])


def check_vllm_keywords(model: str | None, keywords: dict) -> None:
    """Check the vLLM keywords given to `LLM(...)` (ValueError naming one we cannot honour)."""
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
