"""The one start-up line that says what was built: load time, weights, KV cache, concurrency,
dtype, quantization, attention backend and device."""

from __future__ import annotations

from deepinfer.model_executor.layers.ops.cpu_kernels import portable_reason, qdot_levels
from deepinfer.model_executor.layers.ops.qmatmul import qdot_variant
from deepinfer.model_executor.layers.quant_linear import packed_weights
from deepinfer.model_executor.loader.gguf import packed_file_bytes
from deepinfer.worker.cache_sizing import max_concurrency, mib


def weight_bytes(model) -> int:
    """Bytes of the model's weights: dense parameters plus packed quantized matrices."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(w.nbytes for w in packed_weights(model))


def packed_summary(model, source=None) -> str | None:
    """The packed matrices against the file's bytes of the same matrices, e.g. '211 (Q4_1 x210,
    Q8_0 x1), 93.8 MiB packed for 93.8 MiB in the file (1.00x), qdot avx2'; None when nothing is packed.
    `source`: the model source; a GGUF's tensor table gives the file's side (one rank holds its slices)."""
    packed = packed_weights(model)
    if not packed:
        return None
    kinds: dict[str, int] = {}
    for w in packed:
        kinds[w.kind] = kinds.get(w.kind, 0) + 1
    layout = ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
    held = sum(w.nbytes for w in packed)
    text = f"{len(packed)} ({layout}), {mib(held)} packed"
    if source is not None and source.format == "gguf":
        in_file = sum(packed_file_bytes(source.path).values())
        text += f" for {mib(in_file)} in the file ({held / max(in_file, 1):.2f}x)"
    return f"{text}, qdot {qdot_variant()}{_portable_note()}"


def _portable_note() -> str:
    """Why the integer dot products run without SIMD, when they do: a CPU without AVX2, no kernel
    library, or DEEPINFER_CPU_ISA's cap."""
    variant = qdot_variant()
    if variant == "plain":
        return f" (portable C++: {portable_reason()})"
    if variant == "none":
        return " (the torch reference: " + ("no CPU kernel library)" if not qdot_levels() else
                                            "DEEPINFER_CPU_ISA=none caps it)")
    return ""


def startup_summary(runner, max_model_len: int, load_s: float, source=None) -> str:
    """e.g. 'engine ready in 2.1 s: weights 258.3 MiB, KV cache 384.0 MiB (6,144 blocks), max
    concurrency 24 requests at max_model_len 4,096, dtype float32, quantization gguf, attention torch, device cpu';
    with matrices kept packed, the weights' part adds what `packed_summary` says."""
    requests = max_concurrency(runner.caches.cache_need, runner.num_blocks, runner.num_state_slots)
    units = f"{runner.num_blocks:,} blocks" if runner.num_blocks else ""
    if runner.num_state_slots:
        units += (", " if units else "") + f"{runner.num_state_slots:,} state slots"
    if runner.device.type == "cpu":
        units += "; reserved, resident only as rows are written"
    packed = packed_summary(runner.model, source)
    weights = mib(weight_bytes(runner.model)) + (f" (quantized matrices: {packed})" if packed else "")
    return (f"engine ready in {load_s:.1f} s: weights {weights}, "
            f"KV cache {mib(runner.caches.cache.num_bytes)} ({units}), max concurrency {requests:,} requests at "
            f"max_model_len {max_model_len:,}, dtype {runner.dtype_choice.value}, quantization "
            f"{runner.quantization.value}, attention {runner.attention_backend.name}, device {runner.device}"
            f"{_draft_summary(runner)}")


def _draft_summary(runner) -> str:
    """With speculative_model: the draft's weights and its rows at the target's units."""
    if runner.draft is None:
        return ""
    return (f"; draft model {runner.draft.path}: weights {mib(weight_bytes(runner.draft.model))}, "
            f"KV cache {mib(runner.caches.draft.num_bytes)} at the same blocks and state slots")
