"""Embeddings on the engine side: how the model pools (`PoolingConfig`, read once from the
checkpoint), and an embedding request's admission. Pure Python.

Where the pooling comes from, in order:

    --pooling last|mean|cls        overrides the type (normalisation stays as declared, else L2)
    modules.json (sentence-transformers):
        Transformer -> Pooling -> [Normalize]   the Pooling module's mode (`pooling_mode`, or the
                                                older `pooling_mode_*_token` flags): mean, cls or
                                                lasttoken; Normalize present: L2-normalised
    GGUF `{arch}.pooling_type`     llama.cpp's 1 mean, 2 cls, 3 last (loader/gguf_config.py), L2-normalised
    otherwise                      none: a generative model serves no embeddings, rerank or score (all
                                   refused alike, naming --pooling), as vLLM serves a generative
                                   model's embeddings only when told how to pool

A checkpoint whose modules change the vector in ways not computed here (a Dense projection, max or
weighted-mean pooling, several modes concatenated) still serves generation; its embedding requests
are refused with the reason. Matryoshka (`dimensions`): allowed when the model's config declares
`is_matryoshka` or `matryoshka_dimensions`, as in vLLM.

An embedding request is a `Request` whose `pooling_params` are set: it is scheduled like any prompt
(chunked prefill included), takes no prefix-cache hit (every row must be computed for its pool),
samples nothing, and finishes with the step that completes its prompt, its blocks freed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from deepinfer.config import POOLING_TYPES
from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.pooling import PoolingParams
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams, short_repr

_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}  # sentence-transformers mode -> ours
_ST_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
             "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
NO_POOLING = ("this model declares no pooling (no sentence-transformers modules.json, no GGUF pooling_type), so it "
              "serves no embeddings, rerank or score; start it with --pooling last|mean|cls (LLM(..., pooling=...)) "
              "to pool its final hidden states")
UNDECLARED = "none declared"
_REFUSED = "this model's embeddings are not supported"


@dataclass(frozen=True)
class PoolingConfig:
    """How this model turns a prompt's final hidden rows into one embedding."""

    pooling_type: str  # "last", "mean" or "cls"
    normalize: bool
    hidden_size: int
    matryoshka: bool = False  # `dimensions` may shorten the vector
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only lengths allowed, when declared
    source: str = UNDECLARED  # where the choice came from (shown at start-up and in errors)
    unsupported: str | None = NO_POOLING  # why this model serves no embeddings (None: it does)

    @property
    def serves(self) -> bool:
        """Embeddings, rerank and score are served (the model or --pooling names a pooling)."""
        return self.unsupported is None

    def summary(self) -> str:
        """The start-up line: how embeddings pool and why, or why none are served."""
        if self.unsupported == NO_POOLING:
            return ("embeddings, rerank and score: off (the model declares no pooling; "
                    "--pooling last|mean|cls serves them)")
        if not self.serves:
            return f"embeddings: refused ({self.unsupported})"
        norm = "L2-normalised" if self.normalize else "not normalised"
        return f"embeddings: {self.pooling_type} pooling, {norm} ({self.source})"

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """A copy of `params` with the pooling type and normalisation filled in; ValueError naming
        `dimensions`, or saying why the model serves no embeddings, when the request cannot be served."""
        if self.unsupported is not None:
            raise ValueError(self.unsupported)
        params = dataclasses.replace(params)  # validates, and the caller's object stays as it was
        self._check_dimensions(params.dimensions)
        normalize = self.normalize if params.normalize is None else params.normalize
        return dataclasses.replace(params, pooling_type=self.pooling_type, normalize=normalize)

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.matryoshka:
            raise ValueError(f"dimensions={short_repr(dimensions)}: this model does not declare Matryoshka "
                             f"embeddings (is_matryoshka or matryoshka_dimensions in its config), so its "
                             f"{self.hidden_size}-value vectors cannot be shortened")
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {list(allowed)} for this model, got {dimensions}")
        if dimensions > self.hidden_size:
            raise ValueError(f"dimensions must be <= {self.hidden_size} (the model's embedding size), "
                             f"got {dimensions}")


def pooling_config(path: str | None, hf_config, choice: str = "auto") -> PoolingConfig:
    """The model's pooling: `choice` ("auto" or a type that overrides), the checkpoint directory's
    sentence-transformers modules (when `path` is a directory holding modules.json), a GGUF file's
    pooling_type; without any of them, none (`unsupported` says so and names --pooling)."""
    fields = HFConfigFields.of(hf_config)
    kind, normalize, source, problem, no_kind = _declared(path, fields)
    if choice != "auto":
        source = f"--pooling {choice}" + ("" if kind or source != UNDECLARED else ": the model declares none")
        kind = choice
    elif kind is None:
        problem = problem or no_kind
    dims = fields.matryoshka_dimensions
    return PoolingConfig(kind or "last", normalize, int(fields.hidden_size or 0),
                         bool(fields.is_matryoshka or dims), tuple(dims) if dims else None,
                         source, problem)


def _declared(path: str | None, fields: HFConfigFields) -> tuple[str | None, bool, str, str | None, str]:
    """What the checkpoint declares: (pooling type or None, normalised, where from, why its embeddings
    cannot be computed whatever the pooling (modules), why there is no type (--pooling gives one))."""
    modules = _read_json(path, "modules.json") if path and os.path.isdir(path) else None
    if isinstance(modules, list):
        mode, normalize, others = _st_modules(path, modules)
        source = f"sentence-transformers modules.json of {os.path.basename(os.path.normpath(path))}"
        problem = f"{_REFUSED}: its sentence-transformers module(s) {', '.join(others)} are not computed here" \
            if others else None
        no_kind = f"{_REFUSED}: its sentence-transformers pooling {mode!r} is not computed here " \
                  f"(mean, cls, lasttoken are)"
        return _ST_MODES.get(mode), normalize, source, problem, no_kind
    if fields.pooling_type is not None:
        kind = fields.pooling_type if fields.pooling_type in POOLING_TYPES else None
        no_kind = f"{_REFUSED}: its GGUF pooling_type {fields.pooling_type!r} is not computed here " \
                  f"({', '.join(POOLING_TYPES)} are)"
        return kind, True, f"GGUF pooling_type {fields.pooling_type}", None, no_kind
    return None, True, UNDECLARED, None, NO_POOLING


def _st_modules(path: str, modules: list) -> tuple[str | None, bool, list[str]]:
    """(the Pooling module's mode, whether a Normalize follows, other modules) of a
    sentence-transformers pipeline."""
    mode, normalize, others = None, False, []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
        if kind == "Pooling":
            mode = _st_pooling(_read_json(os.path.join(path, str(module.get("path", ""))), "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            others.append(kind or short_repr(module))
    return mode, normalize, others


def _st_pooling(config) -> str | None:
    """A Pooling module's one mode ("mean", "cls", "lasttoken", ...), or a description of several."""
    if not isinstance(config, dict):
        return None
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _ST_FLAGS.items() if config.get(key)] or ["mean"]
    if isinstance(mode, list):
        return mode[0] if len(mode) == 1 else "+".join(map(str, mode))
    return str(mode)


def _read_json(directory: str, name: str):
    try:
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# -- admission --------------------------------------------------------------------------------------


def truncated(ids: list[int], params: PoolingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` ids (-1: the last max_model_len), or all of them."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:]


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """An embedding input is not empty, fits the context (all of it: nothing is generated after it)
    and holds only ids of the vocabulary; ValueError naming the prompt otherwise."""
    if not ids:
        raise ValueError("prompt is empty (0 tokens); give at least one token")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {max_model_len} (pass "
                         f"truncate_prompt_tokens to keep only its last tokens)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {short_repr(bad[0])} is outside the vocabulary [0, {vocab_size})")


def pooling_request(request_id: str, ids: list[int], params: PoolingParams, max_model_len: int,
                    cache_salt: str | None = None) -> Request:
    """The Request of an embedding: it computes `ids` and samples nothing (its SamplingParams are a
    placeholder the scheduler never hands to the sampler)."""
    return Request(request_id, ids, SamplingParams(max_tokens=1), max_model_len=max_model_len,
                   cache_salt=cache_salt, pooling_params=params)
