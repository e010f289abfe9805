"""The one start-up line that says what was built: load time, weights, KV cache, concurrency,
dtype, quantization, attention backend and device."""

from __future__ import annotations

from deepinfer.worker.cache_sizing import max_concurrency, mib


def weight_bytes(model) -> int:
    """Bytes of the model's weights: dense parameters plus packed quantized matrices."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(m.qweight.nbytes for m in model.modules() if hasattr(m, "qweight"))
    return dense + packed


def startup_summary(runner, max_model_len: int, load_s: float) -> str:
    """e.g. 'engine ready in 2.1 s: weights 258.3 MiB, KV cache 384.0 MiB (6,144 blocks), max
    concurrency 24 requests at max_model_len 4,096, dtype float32, quantization gguf, attention torch, device cpu'."""
    requests = max_concurrency(runner.cache_need, runner.num_blocks, runner.num_state_slots)
    units = f"{runner.num_blocks:,} blocks" if runner.num_blocks else ""
    if runner.num_state_slots:
        units += (", " if units else "") + f"{runner.num_state_slots:,} state slots"
    if runner.device.type == "cpu":
        units += "; reserved, resident only as rows are written"
    return (f"engine ready in {load_s:.1f} s: weights {mib(weight_bytes(runner.model))}, "
            f"KV cache {mib(runner.cache.num_bytes)} ({units}), max concurrency {requests:,} requests at "
            f"max_model_len {max_model_len:,}, dtype {runner.dtype_choice.value}, quantization "
            f"{runner.quantization.value}, attention {runner.attention_backend.name}, device {runner.device}")
