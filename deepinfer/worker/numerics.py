"""The numerics choices of one engine, resolved together before the model is built.

Five settings may say 'auto' (quantization, dtype, DEEPINFER_BATCH_INVARIANT, attention backend and,
after the build, few-row linears); each choice depends on the ones above it:

    quantization      <- requested, source format, device, CPU kernels built   (model_loader)
    dtype             <- requested, device, quantization, batch-invariant knob  (model_loader)
    batch-invariant   <- knob, device, requested backend, model class, dtype    (batch_invariant)
    attention backend <- requested, device, batch-invariant, Triton installed   (attention/triton_backend)
    kernel set        <- attention backend, device                              (layers/kernel_set)
    few-row linear    <- batch-invariant, the built model's largest weight      (linear, after the build)

`resolve_numerics` makes them in that order into one `NumericsRecord` (contracts/numerics.py), with
a reason each; `with_weights` adds what only the final model knows (its weights' formats, the few-row
count). That record is what the runner logs once and what the cache identity hashes.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.config import EngineConfig
from deepinfer.contracts.numerics import NumericsRecord
from deepinfer.model_executor import model_loader
from deepinfer.model_executor.layers.attention.triton_backend import resolve_attention_backend
from deepinfer.model_executor.layers.batch_invariant import resolve_batch_invariant
from deepinfer.model_executor.layers.kernel_set import kernels_for
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa_name
from deepinfer.model_executor.models.registry import get_model_class


def resolve_numerics(source, config: EngineConfig, device: torch.device) -> NumericsRecord:
    """Every numerics choice for `source` on `device`, before the build (the weights' formats are
    filled in by `with_weights`). A choice this device cannot make (a backend) fails here, before
    the weights load."""
    capabilities = get_model_class(source.hf_config.model_type).capabilities
    knob = config.env.batch_invariant  # None: auto (on for the CPU path with its C++ kernels)
    quantization = model_loader.resolve_quantization(config.quantization, source, device, bool(knob))
    dtype = model_loader.resolve_dtype(config.dtype, device, source, quantization.value, bool(knob))
    batch_invariant = resolve_batch_invariant(knob, device, config.attention_backend, capabilities,
                                              model_loader.torch_dtype(dtype))
    backend = resolve_attention_backend(config.attention_backend, device, batch_invariant)
    kernels = kernels_for(backend, device)
    reasons = (("dtype", dtype.reason), ("quantization", quantization.reason),
               ("batch_invariant", _batch_invariant_reason(knob, batch_invariant)),
               ("attention_backend", _backend_reason(config.attention_backend, backend)),
               ("kernel_set", f"the {backend} backend on {device.type}"))
    dtype_name = str(model_loader.torch_dtype(dtype)).removeprefix("torch.")  # fp32 -> float32
    return NumericsRecord(device_type=device.type, compute_dtype=dtype_name, quantization=quantization.value,
                          tensor_types="", weight_formats=(), kernel_isa=kernel_isa_name(), attention_backend=backend,
                          kv_cache_dtype=config.cache.kv_cache_dtype, batch_invariant=batch_invariant,
                          torch_version=torch.__version__, kernel_set=kernels.name, reasons=reasons)


def with_weights(record: NumericsRecord, model, num_few_row_linear: int) -> NumericsRecord:
    """`record` with the final model's weight formats (`model_loader.numerics_record`: module types and
    every weight's format, read off the model) and its few-row linear count. Call it once the model is
    final: after the layer swaps and the cache binding."""
    built = model_loader.numerics_record(model, torch.device(record.device_type), compute_dtype(record),
                                         record.quantization, record.attention_backend, record.kv_cache_dtype,
                                         record.batch_invariant)
    return dataclasses.replace(record, tensor_types=built.tensor_types, weight_formats=built.weight_formats,
                               kernel_isa=built.kernel_isa, few_row_linear=num_few_row_linear,
                               reasons=(*record.reasons, ("few_row_linear", _few_row_reason(record))))


def _few_row_reason(record: NumericsRecord) -> str:
    if record.batch_invariant:
        return "off: batch-invariant linears"
    if record.device_type != "cpu":
        return f"off: a CPU choice, the device is {record.device_type}"
    return "auto: large linears where a probe on the largest weight finds W @ x.T faster"


def compute_dtype(record: NumericsRecord) -> torch.dtype:
    """The torch dtype the record's `compute_dtype` names."""
    return model_loader.torch_dtype(model_loader.Choice(record.compute_dtype, ""))


def _batch_invariant_reason(knob: bool | None, on: bool) -> str:
    if knob is not None:
        return f"DEEPINFER_BATCH_INVARIANT={int(knob)}"
    if on:
        return "auto: fp32 on the CPU with the C++ kernels and the torch backend, a model the native path covers"
    return "auto: off the native path (fp32 CPU, C++ kernels, torch backend, a covered model)"


def _backend_reason(requested: str, backend: str) -> str:
    if requested != "auto":
        return "requested"
    if backend == "triton":
        return "auto: CUDA with Triton installed"
    return "auto: not CUDA with Triton, or batch-invariant"
