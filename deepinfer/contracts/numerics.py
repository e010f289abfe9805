"""The row identity: every choice that changes the bits of a cached K/V row, in one record. No torch.

A saved row may be reused only by an engine that would compute the same bits (seed 004: no reuse
after the weights, adapter, positions or prefix change). The weights' content and the model config
are named by the model source; everything the engine chooses on top of them lives here:

    device_type          cpu | cuda | ...
    compute_dtype        float32 | bfloat16 | ...   (activations and the model's float weights)
    quantization         none | gguf | int8 | int4  (the resolved mode, not the request)
    tensor_types         digest of every weight tensor's format: name, dtype, shape, module type and,
                         for a packed weight, its kind / bits / group (GGUF Q4_K kept packed and the
                         same tensor dequantized differ here)
    weight_formats       the distinct formats behind that digest, for people reading logs
    kernel_isa           the CPU kernels' instruction set (avx512 | avx2 | none)
    attention_backend    the attention implementation's name
    kv_cache_dtype       the row format requested (auto | fp8 | ...)
    batch_invariant      the kernels' batch-invariant mode
    torch_version        the library whose kernels compute the rows

The record is built in one place, where the choices are made (`model_loader.numerics_record`),
and hashed as a whole (`prefix_store.cache_identity`): a new field cannot be left out of the
identity. What the record still misses, the start-up canary catches (`worker/cache_canary.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NumericsRecord:
    """The numerics a cached row was computed with (see the module docstring for each field)."""

    device_type: str
    compute_dtype: str
    quantization: str
    tensor_types: str
    weight_formats: tuple[str, ...]
    kernel_isa: str
    attention_backend: str
    kv_cache_dtype: str
    batch_invariant: bool
    torch_version: str
