"""The optional fields of a checkpoint's transformers config, declared once with their defaults.

A transformers `PretrainedConfig` holds only what its model class and config.json name:
`eos_token_id`, `max_position_embeddings`, `quantization_config`, the sentence-transformers
(Matryoshka), FIM (from GGUF metadata) and RoPE fields may each be absent. The engine, the loaders
and the entry points read them through `HFConfigFields.of(hf_config)`, never probing the config
where they use a field. Fields every config has (`model_type`, `architectures`) and those every
model class of ours requires (`vocab_size`, ...) are read from the config directly.

A model family declares the optional fields it reads the same way, in a subclass next to its
code (`LlamaConfigFields` in models/llama.py, ...): each field once, with the default its
transformers config class has (a member family's subclass may change a parent's default, as
GPT-OSS does for `attention_bias`), read through the inherited `of` where the family builds its
modules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self


@dataclass(frozen=True)
class HFConfigFields:
    """What a config sets of the optional fields; a field it does not set has the default here."""

    max_position_embeddings: int = 4096  # the model's context (4096 when the config names none)
    eos_token_id: int | list[int] | None = None  # one id or several
    hidden_size: int = 0  # 0: unknown (a bare PretrainedConfig)
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None  # None: as many KV heads as heads
    # RoPE: transformers >= 5 keeps theta inside rope_parameters; older configs (and GGUF's) a field
    rope_parameters: dict | None = None
    rope_theta: float = 10000.0
    quantization_config: Any = None  # a dict as config.json holds it, or transformers' config object
    # sentence-transformers' Matryoshka embeddings: the sizes a vector may be shortened to
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    # fill-in-the-middle token ids (GGUF metadata, loader/gguf_config.py)
    fim_pre_token_id: int | None = None
    fim_suf_token_id: int | None = None
    fim_mid_token_id: int | None = None
    fim_sep_token_id: int | None = None

    @classmethod
    def of(cls, hf_config: Any) -> Self:
        """The fields `hf_config` sets (a transformers config, or any object with such attributes); a
        field it does not set takes this class's default, one it sets to None stays None."""
        return cls(**{f.name: getattr(hf_config, f.name, f.default) for f in fields(cls)})


def eos_token_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """The model's EOS ids: its config's (one id or several) and its tokenizer's (None: none)."""
    ids = set()
    from_tokenizer = None if tokenizer is None else tokenizer.eos_token_id
    for value in (HFConfigFields.of(hf_config).eos_token_id, from_tokenizer):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
