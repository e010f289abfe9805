"""model_type -> model class, each family's module imported when its model type is first asked for
(a start-up imports only the family it runs)."""

from __future__ import annotations

import importlib

_PACKAGE = "deepinfer.model_executor.models"
_MODELS = {  # model_type -> (module under models/, class name)
    "deepseek_v2": ("deepseek_v3.model", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("deepseek_v3.model", "DeepseekV3ForCausalLM"),
    "deepseek_v4": ("deepseek_v4.model", "DeepseekV4ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_vision", "Gemma3ForConditionalGeneration"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "llava": ("llava", "LlavaForConditionalGeneration"),
    "llava_next": ("llava_next", "LlavaNextForConditionalGeneration"),
    "llava_onevision": ("llava_next", "LlavaOnevisionForConditionalGeneration"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "mixtral": ("moe_llama", "MixtralForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen2_5_vl": ("qwen2_vl.model", "Qwen2_5_VLForConditionalGeneration"),
    "qwen2_moe": ("moe_llama", "Qwen2MoeForCausalLM"),
    "qwen2_vl": ("qwen2_vl.model", "Qwen2VLForConditionalGeneration"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "qwen3_moe": ("moe_llama", "Qwen3MoeForCausalLM"),
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_MODELS))


def model_types_with(capability) -> tuple[str, ...]:
    """The model types whose class's `capabilities` satisfy `capability` (a predicate), sorted."""
    return tuple(t for t in SUPPORTED_MODEL_TYPES if capability(get_model_class(t).capabilities))


def get_model_class(model_type: str):
    if model_type not in _MODELS:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    module, name = _MODELS[model_type]
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), name)
