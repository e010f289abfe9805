"""model_type -> model class."""

from __future__ import annotations

from deepinfer.model_executor.models.deepseek_v3.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from deepinfer.model_executor.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.model_executor.models.gemma2 import Gemma2ForCausalLM
from deepinfer.model_executor.models.gemma3 import Gemma3ForCausalLM
from deepinfer.model_executor.models.gpt_oss import GptOssForCausalLM
from deepinfer.model_executor.models.llama import LlamaForCausalLM
from deepinfer.model_executor.models.moe_llama import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from deepinfer.model_executor.models.phi3 import Phi3ForCausalLM

_MODELS = {
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v4": DeepseekV4ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_MODELS))


def model_types_with(capability) -> tuple[str, ...]:
    """The model types whose class's `capabilities` satisfy `capability` (a predicate), sorted."""
    return tuple(t for t in SUPPORTED_MODEL_TYPES if capability(_MODELS[t].capabilities))


def get_model_class(model_type: str):
    if model_type not in _MODELS:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return _MODELS[model_type]
