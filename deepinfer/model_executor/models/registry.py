"""model_type -> model class."""

from __future__ import annotations

from deepinfer.model_executor.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.model_executor.models.gemma3 import Gemma3ForCausalLM
from deepinfer.model_executor.models.llama import LlamaForCausalLM

_MODELS = {
    "deepseek_v4": DeepseekV4ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_MODELS))


def get_model_class(model_type: str):
    if model_type not in _MODELS:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return _MODELS[model_type]
