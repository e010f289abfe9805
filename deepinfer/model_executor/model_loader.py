"""From a model source to modules: which weights stay quantized, which dtype computes, the model.

    resolve_quantization   auto | none | gguf | int8 | int4  ->  what loading does, and why
    resolve_cpu_dtype      auto on a CPU                     ->  fp32 or bf16, and why
    build_model            modules (weights not initialized), checkpoint or dummy weights, swaps
    numerics_record        every choice above that changes a cached row's bits, in one record

`--dtype auto` on a CPU, by rule and measurement:
    batch-invariant mode      fp32
    quantized weights         fp32: the integer kernels quantize fp32 activations (int8 per 32
                              values); attention and norms are a small share of the step and stay exact
    < 32M matmul weights      fp32: a step of a small model is mostly overhead, not matmul
    otherwise                 a start-up probe (~0.1 s) times the model's MLP shape for 1 and 16
                              rows in fp32 and bf16; bf16 is chosen if it takes < 90% of fp32's time
(On an AMD EPYC with AVX-512 BF16, bf16 matmuls were 2-3x faster than fp32; on an Intel AMX machine
batch-1 bf16 decode was slower than fp32: hence a measurement, not a table.)
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import gc
import hashlib
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import check_load_format, check_quantization
from deepinfer.contracts.numerics import NumericsRecord
from deepinfer.distributed.parallel_state import tp_size
from deepinfer.model_executor.layers.fused_moe import quantize_experts
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa, kernel_isa_name, kernel_status
from deepinfer.model_executor.layers.ops.qmatmul import QUANTIZE_SCHEMES, best_time, one_thread, qdot_variant
from deepinfer.model_executor.layers.quant_linear import quantize_linears, set_activation_levels
from deepinfer.model_executor.loader.dummy import init_dummy_weights
from deepinfer.model_executor.models.registry import get_model_class, model_types_with

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
SMALL_MODEL_WEIGHTS = 1 << 25  # matmul weight elements below which `auto` stays fp32
_BF16_WIN = 0.9
_LOAD_QUANTIZE = ("int8", "int4")


@dataclass(frozen=True)
class Choice:
    """A resolved setting and the reason, for `deepinfer info` and the start-up log."""

    value: str
    reason: str


def resolve_quantization(requested: str, source, device: torch.device, batch_invariant: bool = False) -> Choice:
    """What `--quantization` does for this source on this device (ValueError for an impossible request)."""
    check_quantization(requested)
    if requested == "none":
        return Choice("none", "requested: quantized weights are dequantized (the reference path)")
    if requested == "auto":
        return _auto_quantization(source, device, batch_invariant)
    _check_quantization_request(requested, source, device, batch_invariant)
    if requested == "gguf":
        return Choice("gguf", f"requested; {kernel_status()}")
    return Choice(requested, f"requested: linear layers quantized at load ({requested}: "
                             f"{QUANTIZE_SCHEMES[requested]} blocks of 32); "
                             f"{kernel_status()}")


def _auto_quantization(source, device: torch.device, batch_invariant: bool) -> Choice:
    if source.format != "gguf" or source.load_format == "dummy":
        return Choice("none", "auto: not a GGUF checkpoint with weights")
    if device.type != "cpu":
        return Choice("none", f"auto: the quantized kernels are CPU kernels; on {device.type} weights are dequantized")
    if not kernel_isa():
        return Choice("none", f"auto: {kernel_status()}; weights are dequantized")
    return Choice("gguf", f"auto: GGUF weights stay quantized, {kernel_isa_name()} kernels, "
                          f"integer dot products {qdot_variant()}")


def _check_quantization_request(requested: str, source, device: torch.device, batch_invariant: bool) -> None:
    where = f"quantization={requested!r}"
    if device.type != "cpu":
        raise ValueError(f"{where} runs on the CPU only; device is {device.type!r} (use quantization='none')")
    if source.load_format == "dummy":
        raise ValueError(f"{where} needs real weights; load_format is 'dummy'")
    if requested == "gguf" and source.format != "gguf":
        raise ValueError(f"{where} needs a .gguf model; {source.path!r} is a {source.format} checkpoint")
    model_type = source.hf_config.model_type
    if requested in _LOAD_QUANTIZE and not get_model_class(model_type).capabilities.quantize_at_load:
        supported = model_types_with(lambda capabilities: capabilities.quantize_at_load)
        raise ValueError(f"{where} supports model types {', '.join(supported)}; got {model_type!r}")


def resolve_dtype(name: str, device: torch.device, source=None, quantization: str = "none",
                  batch_invariant: bool = False) -> Choice:
    """The compute dtype (`Choice.value` a key of _DTYPES); 'auto' is bf16 on a GPU and measured on a CPU."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
        return Choice(name, "requested")
    if device.type != "cpu":
        return Choice("bfloat16", f"auto: bf16 on {device.type}")
    if batch_invariant:
        return Choice("float32", "auto: batch-invariant mode computes in fp32")
    return resolve_cpu_dtype(source, quantization)


def torch_dtype(choice: Choice) -> torch.dtype:
    return _DTYPES[choice.value]


def resolve_cpu_dtype(source, quantization: str) -> Choice:
    if quantization != "none":
        return Choice("float32", "auto: quantized matmuls take fp32 activations (quantized to int8 per 32)")
    cfg = getattr(source, "hf_config", None)
    hidden, inter = getattr(cfg, "hidden_size", 0), getattr(cfg, "intermediate_size", 0)
    layers = getattr(cfg, "num_hidden_layers", 0)
    if not hidden or not inter or 3 * hidden * inter * layers < SMALL_MODEL_WEIGHTS:
        return Choice("float32", "auto: a small model (< 32M matmul weights) stays fp32")
    fp32, bf16 = _probe_matmul(hidden, inter)
    faster = bf16 < _BF16_WIN * fp32
    return Choice("bfloat16" if faster else "float32",
                  f"auto: measured [{inter}x{hidden}] matmuls, fp32 {fp32 * 1e3:.2f} ms vs bf16 {bf16 * 1e3:.2f} ms")


_PROBES: dict[tuple[int, int], tuple[float, float]] = {}


@torch.inference_mode()
def _probe_matmul(hidden: int, inter: int) -> tuple[float, float]:
    """Seconds for an [inter, hidden] matmul of 1 and of 16 rows, in fp32 and in bf16 (once per
    shape, on one thread: a busy core does not stall it, and the ratio carries over)."""
    if (hidden, inter) not in _PROBES:
        with one_thread():
            _PROBES[(hidden, inter)] = _probe_times(hidden, inter)
    return _PROBES[(hidden, inter)]


def _probe_times(hidden: int, inter: int) -> tuple[float, float]:
    w = torch.randn(inter, hidden)  # [inter, hidden]
    xs = [torch.randn(rows, hidden) for rows in (1, 16)]
    times = []
    for dtype in (torch.float32, torch.bfloat16):
        wd, xd = w.to(dtype), [x.to(dtype) for x in xs]
        times.append(sum(best_time(lambda x=x: F.linear(x, wd)) for x in xd))  # noqa: B023
    return times[0], times[1]



_SHAPES_ONLY = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only_dummy_weights():
    """Inside it, a model with load_format "dummy" gets its weights on the meta device: shapes and
    dtypes without values (for `deepinfer info`, which reports sizes and never runs the model: a
    V4-Flash-wide config costs no 13 GB and no minute of random numbers)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


@contextlib.contextmanager
def skip_weight_init():
    """Build Linear and Embedding modules without drawing random weights: loading overwrites them,
    and an fp32 weight that a quantized one replaces is then never written (nor resident)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def build_model(source, dtype: torch.dtype, device: torch.device, max_positions: int,
                speculative_method: str | None = None, quantization: str = "none", expert_parallel_size: int = 1,
                activation_levels: str = "auto"):
    """The source's model on `device` in `dtype`: checkpoint weights (`quantization` 'gguf': its
    quantized matrices kept quantized; 'int8'/'int4': linear layers quantized after loading), or
    seeded random values when the source's load_format is "dummy" (no weight file is read).
    speculative_method="mtp" adds the model's next-n draft module, refused for a model without one.
    With tensor_parallel_size > 1 (distributed.parallel_state) the model holds this rank's slices,
    read from the checkpoint slice by slice; `expert_parallel_size` > 1 (a model whose
    `capabilities` say `expert_parallel`: DeepSeek-V4 and the Llama-family MoE models) splits its routed
    experts over that many rank groups. int8 / int4 quantize routed experts as well (`quantize_experts`).
    `activation_levels` ("auto", "1", "2"): the int8 levels of the quantized modules' activations
    (quant_linear.set_activation_levels; auto keeps each module's own)."""
    gc.freeze()  # what exists before loading is not loading's garbage: release_free_memory skips it
    try:
        return _build_model(source, dtype, device, max_positions, speculative_method, quantization,
                            expert_parallel_size, activation_levels)
    finally:
        gc.unfreeze()


def _build_model(source, dtype: torch.dtype, device: torch.device, max_positions: int,
                 speculative_method: str | None, quantization: str, expert_parallel_size: int,
                 activation_levels: str):
    cfg = source.hf_config
    model_cls = get_model_class(cfg.model_type)
    dummy = check_load_format(getattr(source, "load_format", "auto")) == "dummy"
    check_tensor_parallel_source(source, model_cls)
    check_expert_parallel(model_cls, cfg.model_type, expert_parallel_size)
    expert_kwargs = {"expert_parallel_size": expert_parallel_size} if expert_parallel_size > 1 else {}
    shapes_only = dummy and _SHAPES_ONLY.get()
    model = _modules(model_cls, cfg, torch.device("meta") if shapes_only else device, max_positions,
                     speculative_method, expert_kwargs)
    if shapes_only:
        pass  # meta tensors: nothing to fill
    elif dummy:
        init_dummy_weights(model)
    else:
        model.load_weights(weight_progress(_checkpoint_weights(source, quantization)))
    if quantization in _LOAD_QUANTIZE:
        quantize_linears(model, quantization)
        quantize_experts(model, quantization)
    set_activation_levels(model, activation_levels)
    model = model.to(dtype=dtype).eval()
    release_free_memory()
    return model


def _modules(model_cls, cfg, device: torch.device, max_positions: int, speculative_method: str | None,
             expert_kwargs: dict):
    """The model class's modules on `device`, weights not initialized, with the MTP module when asked."""
    with device, skip_weight_init():
        model = model_cls(cfg, max_positions, **expert_kwargs)
        if speculative_method == "mtp":
            if not model_cls.capabilities.mtp_drafting:
                raise ValueError(f"speculative_method='mtp' needs a model with MTP (next-n) layers, and "
                                 f"model_type {cfg.model_type!r} has none; use speculative_method='ngram'")
            model.add_mtp()
    return model


def build_meta_model(source, dtype: torch.dtype, max_positions: int, speculative_method: str | None = None,
                     expert_parallel_size: int = 1):
    """The source's model on the meta device in `dtype`: shapes and dtypes, no values, nothing read
    from the checkpoint. What the engine sizes before it builds the real one: the cache groups the
    model declares and the bytes of its weights (`worker/context_length.py`). This rank's slices with
    several ranks, as `build_model`."""
    cfg = source.hf_config
    model_cls = get_model_class(cfg.model_type)
    check_expert_parallel(model_cls, cfg.model_type, expert_parallel_size)
    expert_kwargs = {"expert_parallel_size": expert_parallel_size} if expert_parallel_size > 1 else {}
    model = _modules(model_cls, cfg, torch.device("meta"), max_positions, speculative_method, expert_kwargs)
    return model.to(dtype=dtype)


def numerics_record(model: nn.Module, device: torch.device, dtype: torch.dtype, quantization: str,
                    attention_backend: str, kv_cache_dtype: str, batch_invariant: bool) -> NumericsRecord:
    """Every choice that changes a cached row's bits, for the cache identity. Call it once the
    model is final (after layer swaps such as batch-invariant or few-row linears): module types
    and every weight's format are read off the model itself."""
    tensor_types, formats = _tensor_types(model)
    return NumericsRecord(device_type=device.type, compute_dtype=str(dtype).removeprefix("torch."),
                          quantization=quantization, tensor_types=tensor_types, weight_formats=formats,
                          kernel_isa=kernel_isa_name(), attention_backend=attention_backend,
                          kv_cache_dtype=kv_cache_dtype, batch_invariant=batch_invariant,
                          torch_version=torch.__version__)


def _tensor_types(model: nn.Module) -> tuple[str, tuple[str, ...]]:
    """(blake2b of each module's type and each weight's name, dtype, shape and packed format, with
    its activations' levels; the distinct formats): a tensor kept packed and the same tensor
    dequantized differ."""
    digest, formats = hashlib.blake2b(digest_size=16), set()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__qualname__}\n".encode())
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for tname, t in tensors:
            digest.update(f"{name}.{tname}:{t.dtype}:{tuple(t.shape)}\n".encode())
            formats.add(str(t.dtype).removeprefix("torch."))
        levels = getattr(module, "act_levels", "")  # the activations' int8 levels (quant_linear.py)
        for i, w in enumerate(getattr(module, "qweights", ())):
            digest.update(f"{name}.qweights.{i}:{w.kind}:{tuple(w.shape)}:{levels}\n".encode())
            formats.add(w.kind)
    return digest.hexdigest(), tuple(sorted(formats))


def _checkpoint_weights(source, quantization: str):
    """The checkpoint's (name, tensor) pairs; with several ranks, lazy slices each rank reads from."""
    keep_quantized = quantization == "gguf"
    if tp_size() > 1:
        return source.iter_weight_slices(torch.float32, keep_quantized)
    return source.iter_weights(torch.float32, keep_quantized)


def check_tensor_parallel_source(source, model_cls) -> None:
    """With several ranks, refuse what is not split yet, naming tensor_parallel_size and the cause:
    models without a split (Llama family and DeepSeek-V4 are split, V4's MTP module too). GGUF files
    and quantized weights are split (each rank reads its slices and keeps, or quantizes, them
    packed)."""
    n = tp_size()
    if n == 1:
        return
    where = f"tensor_parallel_size={n}"
    model_type = source.hf_config.model_type
    if not model_cls.capabilities.tensor_parallel:
        covered = model_types_with(lambda capabilities: capabilities.tensor_parallel)
        raise ValueError(f"{where} is not supported for model_type {model_type!r} yet "
                         f"(tensor parallelism covers {', '.join(covered)})")


def check_expert_parallel(model_cls, model_type: str, expert_parallel_size: int) -> None:
    """Refuse expert_parallel_size > 1 for a model whose experts are not split (or that has none)."""
    if expert_parallel_size > 1 and not model_cls.capabilities.expert_parallel:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} needs a model with routed experts that "
                         f"splits them (qwen3_moe, qwen2_moe, mixtral, deepseek_v2, deepseek_v3, deepseek_v4, "
                         f"gpt_oss); model_type {model_type!r} does not (use 1)")


WEIGHT_PROGRESS_DELAY_S = 0.5  # the bar appears only when loading lasts longer


def weight_progress(weights):
    """`weights` ((name, tensor) pairs) counted by a progress bar on stderr, shown only when
    stderr is a terminal, so logs and test output stay clean; tqdm is imported only then.

    The bar is first drawn after WEIGHT_PROGRESS_DELAY_S, with the count reached: drawn at once, its
    one frame said "0 tensors" whenever the loading took less than tqdm's 0.1 s between frames (a
    GGUF file whose matrices stay packed hands over its tensors in milliseconds)."""
    if not sys.stderr.isatty():
        return weights
    from tqdm.auto import tqdm

    return tqdm(weights, desc="loading weights", unit=" tensors", leave=False, delay=WEIGHT_PROGRESS_DELAY_S)


def release_free_memory() -> None:
    """Hand the heap pages that loading's temporaries left free back to the OS (glibc malloc_trim;
    nothing elsewhere), so the resident set after loading is the model's own. The collection walks
    only objects made since `build_model` froze the others (gc.freeze): a tenth of a second less."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
