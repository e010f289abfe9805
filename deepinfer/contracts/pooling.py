"""What an embedding request asks for: `PoolingParams`. Plain data, no torch.

An embedding (pooling) request computes its prompt like a prefill, samples nothing, and ends with
one vector pooled from the prompt's final hidden rows. The engine fills `pooling_type` and
`normalize` from the model's declaration (`engine/pooling.py`) before the request is queued; the
worker follows them (`worker/pooling.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config import POOLING_TYPES
from deepinfer.sampling_params import short_repr


@dataclass
class PoolingParams:
    """vLLM's `PoolingParams` for embeddings.

    dimensions: keep the first `dimensions` values (Matryoshka models only), renormalised when the
        model normalises; None keeps them all.
    normalize: L2-normalise the vector; None: as the model declares.
    truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last max_model_len); None:
        a prompt longer than max_model_len is refused.
    pooling_type: "last", "mean" or "cls"; set by the engine from the model's declaration.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    pooling_type: str | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> PoolingParams:
        """Check every field; ValueError naming the field and the value. Returns self."""
        if self.dimensions is not None and not _is_int(self.dimensions, low=1):
            raise ValueError(f"dimensions must be an integer >= 1, got {short_repr(self.dimensions)}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None, got {short_repr(self.normalize)}")
        k = self.truncate_prompt_tokens
        if k is not None and not (_is_int(k, low=1) or (_is_int(k) and k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), "
                             f"got {short_repr(k)}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(map(repr, POOLING_TYPES))}, "
                             f"got {short_repr(self.pooling_type)}")
        return self


def _is_int(value, low: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
