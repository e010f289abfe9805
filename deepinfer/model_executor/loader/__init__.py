"""Model loading: HF checkpoint directories and GGUF files, as one `ModelSource` interface."""

from deepinfer.model_executor.loader.default_model import default_model_path
from deepinfer.model_executor.loader.gguf_config import SUPPORTED_GGUF_ARCHITECTURES
from deepinfer.model_executor.loader.model_source import ModelSource
from deepinfer.model_executor.loader.source import load_model_source

__all__ = ["ModelSource", "SUPPORTED_GGUF_ARCHITECTURES", "default_model_path", "load_model_source"]
