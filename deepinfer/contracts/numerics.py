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

and, not hashed (marked `DERIVED`: each follows from the hashed fields, or only explains them):

    kernel_set           the kernel set the layers run (torch | cpu | triton: from attention_backend and
                         device_type, layers/kernel_set.py)
    few_row_linear       how many large linear layers run a few rows as W @ x.T (their module type is
                         in tensor_types)
    reasons              (setting, why) for each choice, 'auto' ones included: for people reading logs

The choices are resolved in one place before the model is built (`worker/numerics.py`), the weights'
formats filled in once it is final, and the record is logged once at start-up (`describe`). It is
hashed as a whole less the derived fields (`identity`, read by `prefix_store.cache_identity`): a new
field is in the identity unless it is marked derived. What the record still misses, the start-up
canary catches (`worker/cache_canary.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

DERIVED = {"derived": True}  # field metadata: left out of the identity


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
    kernel_set: str = field(default="", metadata=DERIVED)
    few_row_linear: int = field(default=0, metadata=DERIVED)
    reasons: tuple[tuple[str, str], ...] = field(default=(), metadata=DERIVED)

    def identity(self) -> dict[str, object]:
        """Every field but the derived ones, by name: what the cache identity hashes."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("derived")}

    def reason(self, setting: str) -> str:
        """Why `setting` (a key of `reasons`) went as it did ('' when the record has no reason for it)."""
        return dict(self.reasons).get(setting, "")

    def describe(self) -> str:
        """The record on one line, each choice with its reason, for the start-up log."""
        why = dict(self.reasons)
        parts = [f"device {self.device_type}", f"dtype {self.compute_dtype}", f"quantization {self.quantization}",
                 f"batch-invariant {'on' if self.batch_invariant else 'off'}",
                 f"attention {self.attention_backend}", f"kernel set {self.kernel_set}", f"cpu isa {self.kernel_isa}",
                 f"few-row linear {self.few_row_linear}", f"kv cache {self.kv_cache_dtype}"]
        keys = ("device", "dtype", "quantization", "batch_invariant", "attention_backend", "kernel_set", "kernel_isa",
                "few_row_linear", "kv_cache_dtype")
        text = "; ".join(f"{part} ({why[key]})" if why.get(key) else part
                         for part, key in zip(parts, keys, strict=True))
        return f"{text}; weights {'+'.join(self.weight_formats) or '?'}; torch {self.torch_version}"
