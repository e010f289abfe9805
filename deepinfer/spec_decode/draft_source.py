"""The draft model of `speculative_model`: opened and checked before anything is built, then built
like the target.

    open_draft       the checkpoint (GGUF file or HF directory), its tokenizer checked against the
                     target's and its quantization resolved by the target's rule (`--quantization`
                     for the draft's own source: a GGUF draft stays quantized on a CPU with the
                     kernels, int8 / int4 quantize it at load); the max_model_len fit reads it
                     before any model is built (`worker/context_length.py`)
    check_tokenizer  drafts are token ids of the target's vocabulary: the draft must share the
                     tokenizer (same vocabulary size, the same special-token ids, the same ids for
                     a probe text); a ValueError naming speculative_model otherwise
    load_draft       the built model in the target's compute dtype at the resolved max_model_len,
                     its linears settled as the target's are (batch-invariant, or few-row linears)

The draft may be narrower or shallower than the target and its LM head may have more or fewer
rows (a padded vocabulary); drafts are argmax ids below the target's vocabulary size. Its cache
rows sit at the target's units (`worker/draft_cache.py`, which also adds the draft to the cache
identity); it drafts through `spec_decode/draft_model.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig
from deepinfer.contracts.numerics import NumericsRecord
from deepinfer.model_executor.layers.batch_invariant import make_batch_invariant, native_path
from deepinfer.model_executor.layers.linear import use_few_row_linear
from deepinfer.model_executor.loader import load_model_source
from deepinfer.model_executor.model_loader import build_model, resolve_quantization

logger = logging.getLogger("deepinfer.worker")

FIELD = "speculative_model"
_PROBE = "Hello, world! The draft's ids must be the target's: 0123456789 <|>"
_SPECIAL = ("bos_token_id", "eos_token_id", "unk_token_id")
@dataclass(frozen=True)
class DraftSource:
    """The draft checkpoint, opened and checked against the target's tokenizer, and the
    quantization it will be built with (`--quantization` resolved for its own source)."""

    source: object
    quantization: str

    @property
    def path(self) -> str:
        return self.source.path


@dataclass
class DraftModel:
    """The loaded draft: its source, the built model and the quantization it was built with."""

    source: object
    model: torch.nn.Module
    quantization: str

    @property
    def path(self) -> str:
        return self.source.path


def open_draft(config: EngineConfig, target_source, device: torch.device, batch_invariant: bool) -> DraftSource:
    """The draft checkpoint `config.speculative.model` names, checked (its tokenizer is the target's)
    and its quantization resolved, before anything is built; ValueError naming speculative_model
    when it cannot draft for `target_source`."""
    path = config.speculative.model
    try:
        source = load_model_source(path, load_format=config.load_format)  # "dummy": seeded random, as the target
    except (OSError, ValueError) as exc:
        raise ValueError(f"{FIELD}={path!r} cannot be loaded: {exc}") from exc
    check_tokenizer(target_source, source, path)
    try:
        quantization = resolve_quantization(config.quantization, source, device, batch_invariant).value
    except ValueError as exc:
        raise ValueError(f"{FIELD}={path!r}: {exc}") from exc
    return DraftSource(source, quantization)


def load_draft(config: EngineConfig, draft: DraftSource, numerics: NumericsRecord, dtype: torch.dtype,
               device: torch.device) -> DraftModel:
    """The draft model built on `device` in `dtype` at the resolved max_model_len, its linears
    settled as the target's (batch-invariant, or few-row linears)."""
    source, quantization = draft.source, draft.quantization
    model = build_model(source, dtype, device, config.max_model_len, None, quantization, 1, config.activation_levels)
    if numerics.batch_invariant:
        make_batch_invariant(model, native_path(device, dtype, model.capabilities))
    else:
        use_few_row_linear(model)
    logger.info("speculative model: %s (%s, %d layers, quantization %s)", draft.path, source.hf_config.model_type,
                source.hf_config.num_hidden_layers, quantization)
    return DraftModel(source, model, quantization)


def _vocab_size(source) -> int:
    tokenizer = source.tokenizer
    return len(tokenizer) if tokenizer is not None else source.hf_config.vocab_size


def _probe_ids(source) -> list[int] | None:
    tokenizer = source.tokenizer
    return None if tokenizer is None else list(tokenizer.encode(_PROBE, add_special_tokens=False))


def check_tokenizer(target_source, draft_source, path: str) -> None:
    """ValueError naming speculative_model when the draft's tokenizer is not the target's: its
    vocabulary size, bos / eos / unk ids, or the ids of a probe text differ."""
    differences = []
    target_vocab, draft_vocab = _vocab_size(target_source), _vocab_size(draft_source)
    if target_vocab != draft_vocab:
        differences.append(f"vocabulary size {draft_vocab} vs the target's {target_vocab}")
    for name in _SPECIAL:
        want = getattr(target_source.tokenizer, name, None) if target_source.tokenizer is not None else None
        got = getattr(draft_source.tokenizer, name, None) if draft_source.tokenizer is not None else None
        if want != got:
            differences.append(f"{name} {got} vs the target's {want}")
    if not differences and _probe_ids(target_source) != _probe_ids(draft_source):
        differences.append("a probe text encodes to other ids")
    if differences:
        raise ValueError(f"{FIELD}={path!r} does not share the target's tokenizer: {'; '.join(differences)}")


