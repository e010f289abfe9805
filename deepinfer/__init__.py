"""DeepInfer: an inference engine whose KV cache is shaped by the model.

`from deepinfer import LLM, SamplingParams`. The package imports lazily so that the pure-Python
parts (layout formulas, scheduler) load without torch.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "Logprob", "LoRARequest"]


def __getattr__(name):
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deepinfer.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from deepinfer.structured_output import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "LoRARequest":
        from deepinfer.contracts.lora import LoRARequest

        return LoRARequest
    if name == "PoolingParams":
        from deepinfer.contracts.pooling import PoolingParams

        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "Logprob"):
        from deepinfer.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput

        return {"RequestOutput": RequestOutput, "CompletionOutput": CompletionOutput,
                "EmbeddingRequestOutput": EmbeddingRequestOutput, "Logprob": Logprob}[name]
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
